"""What a forward pass costs on this machine, by row count: the data `auto` prices with.

At batch 1 a pass streams all weights once whatever its row count, so
verifying n tree nodes costs little more than one token — on hardware whose
kernels keep several rows as cheap as one.  Whether they do differs by
machine and dtype: on a CPU with native bf16, 4 rows cost what 1 costs; on
an AVX2-only CPU a bf16 pass over 4 rows costs about twice one row; on a GPU
64 rows cost 1.3x one row.  `--method auto` prices every configuration with
these curves instead of assuming any of them.

A `CostProfile` holds the oracle's curve and each draft's.  This module
keeps the data (the profile, its file, interpolation) and runs no model;
`stagedspec.profiling` measures profiles, as the decoding loop runs the
models, and caches them under the cache folder keyed by the models, the
dtype, the device, the thread count and the machine's fingerprint
(`stagedspec.hardware`); `stagedspec tune` re-measures.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from stagedspec.paths import learned_store

PROFILE_VERSION = 5  # 2: draft_overhead; 3: shared-pass row counts and segment_seconds; 4: verify_overhead;
# 5: verify_overhead timed after the pass (it came out 0 on a CPU before)
VERIFY_ROWS = (1, 8)  # verification overhead is measured on a root-only tree (`ar`) and an 8-node chain


def monotone(curve: Mapping[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in rows: a pass never costs more than a bigger pass measured cheaper.

    Timings on a shared machine are inflated now and then by other work; the
    fastest of several repeats (above) removes most of that, and this removes
    the rest where it contradicts a bigger pass.
    """
    out, cap = {}, float("inf")
    for rows in sorted(curve, reverse=True):
        cap = min(cap, curve[rows])
        out[rows] = cap
    return dict(sorted(out.items()))


def interpolate(curve: Mapping[int, float], rows: float) -> float:
    """Seconds of a pass over `rows` rows, linear between measured points, extended past the last two."""
    points = sorted(curve.items())
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, s0), (r1, s1) in zip(points, points[1:]):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    if len(points) == 1:
        return points[0][1]
    (r0, s0), (r1, s1) = points[-2], points[-1]
    return s1 + max(0.0, (s1 - s0) / (r1 - r0)) * (rows - r1)


@dataclass
class CostProfile:
    """Measured seconds per pass by row count: the oracle's, and each draft's (stage order, top down)."""

    oracle: dict[int, float]
    drafts: list[dict[int, float]] = field(default_factory=list)
    machine: str = ""
    key: str = ""
    measured_seconds: float = 0.0
    # Host seconds around each pass of the top draft when it grows a tree ("greedy", "sampled"): top-k,
    # sampling, masks, device-to-host copies.  Next to a 0.3 ms CUDA-graph pass they are most of the cost.
    draft_overhead: dict[str, float] = field(default_factory=dict)
    # Seconds one more request's segment adds to a ragged pass beyond its rows (`ragged_segment_cost`): the
    # oracle's, then each draft's.  Empty: unmeasured (priced as 0).
    segment_seconds: list[float] = field(default_factory=list)
    # Host seconds of a loop step's scoring and verification beyond the oracle's pass ("greedy", "sampled"),
    # at `VERIFY_ROWS` rows: reading the decisions back, and at T > 0 the acceptance rules and the draws, a
    # sizable share of a GPU pass (docs/measurements.md, "Verification overhead on an H100 at T=1").  Empty: 0.
    verify_overhead: dict[str, list[float]] = field(default_factory=dict)
    # CPUs' worth of other processes' work while this was measured (`stagedspec.threads`): a profile taken
    # beside a busy process prices every pass too high and is used for its run only, never cached.
    others_load: float = 0.0

    def step_seconds(self, rows: float, sampled: bool) -> float:
        """Predicted seconds of verifying a tree of `rows` nodes: the oracle's pass plus the host work around it
        (`verify_overhead`, linear in the rows through its two measured points, never below 0)."""
        points = self.verify_overhead.get("sampled" if sampled else "greedy")
        extra = 0.0
        if points and len(points) == len(VERIFY_ROWS):
            (r0, r1), (a, b) = VERIFY_ROWS, points
            extra = max(0.0, a + (b - a) * (rows - r0) / (r1 - r0))
        return self.oracle_seconds(rows) + extra

    def segment_cost(self, index: int) -> float:
        """Per-segment seconds of a ragged pass of model `index` (-1: the oracle, else a draft stage)."""
        i = 0 if index < 0 else index + 1
        return self.segment_seconds[i] if i < len(self.segment_seconds) else 0.0

    def oracle_seconds(self, rows: float) -> float:
        return self._lookup(-1, self.oracle, rows)

    def draft_pass_overhead(self, sampled: bool) -> float:
        return self.draft_overhead.get("sampled" if sampled else "greedy", 0.0)

    def draft_seconds(self, index: int, rows: float) -> float:
        return self._lookup(index, self.drafts[index], rows)

    def _lookup(self, which: int, curve: Mapping[int, float], rows: float) -> float:
        """`interpolate`, remembered: `--method auto` prices every arm from these curves every step."""
        memo = self.__dict__.setdefault("_memo", {})
        key = (which, rows)
        seconds = memo.get(key)
        if seconds is None:
            seconds = memo[key] = interpolate(curve, rows)
        return seconds

    def to_json(self) -> str:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostProfile":
        d = json.loads(text)
        if d.get("version") != PROFILE_VERSION:
            raise ValueError("old profile version")

        def curve(c: Mapping[str, float]) -> dict[int, float]:
            out = {int(k): float(v) for k, v in c.items()}
            if not out or any(v <= 0 for v in out.values()):
                raise ValueError("empty or non-positive curve")
            return out

        return cls(oracle=curve(d["oracle"]), drafts=[curve(c) for c in d["drafts"]], machine=d.get("machine", ""),
                   key=d.get("key", ""), measured_seconds=float(d.get("measured_seconds", 0.0)),
                   draft_overhead={str(k): float(v) for k, v in d.get("draft_overhead", {}).items()},
                   segment_seconds=[float(x) for x in d.get("segment_seconds", [])],
                   verify_overhead={str(k): [float(x) for x in v] for k, v in d.get("verify_overhead", {}).items()},
                   others_load=float(d.get("others_load", 0.0)))


def profile_path(key: str) -> Path:
    # The version is in the name (from version 3): processes running an older stagedspec keep reading (and
    # rewriting) their own files rather than re-measuring over each other's.
    return learned_store() / f"{key}.v{PROFILE_VERSION}.json"
