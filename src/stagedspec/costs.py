"""What a forward pass costs on this machine, by row count: measured once, cached, reused.

At batch 1 a pass streams all weights once whatever its row count, so
verifying n tree nodes costs little more than one token — on hardware whose
kernels keep several rows as cheap as one.  Whether they do differs by
machine and dtype: on a CPU with native bf16, 4 rows cost what 1 costs; on
an AVX2-only CPU a bf16 pass over 4 rows costs about twice one row; on a GPU
64 rows cost 1.3x one row.  `--method auto` prices every configuration with
these curves instead of assuming any of them.

A `CostProfile` holds the oracle's curve and each draft's, measured as the
decoding loop runs them, and is cached under the cache folder keyed by the
models, the dtype, the device, the thread count and the machine's
fingerprint (`stagedspec.hardware`); `stagedspec tune` re-measures.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from stagedspec import hardware
from stagedspec.threads import SPARE_CPU
from stagedspec.models.transformer import Transformer
from stagedspec.runner import StaticRunner, is_compiled, pass_mode, runner_capacity, wants_fixed_width
from stagedspec.paths import cache_root, write_text_atomic

# Row counts measured on each kind of device (a GPU's curve stays flat much longer).  The larger ones are
# the loads of the batched server's shared passes, where `auto` prices a request's rows by the curve's slope
# there (`stagedspec.auto.SharedLoad`); a solo run's trees stay within the first ones.
CPU_ORACLE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
CUDA_ORACLE_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
DRAFT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
RAGGED_SEGMENTS = 8  # segments of the ragged pass timed for the per-segment cost
PROFILE_VERSION = 5  # 2: draft_overhead; 3: shared-pass row counts and segment_seconds; 4: verify_overhead;
# 5: verify_overhead timed after the pass (it came out 0 on a CPU before)
MIN_REPEATS, SECONDS_PER_SHAPE = 2, 0.5  # a shape is timed `repeats` times, or as often as fits in this
VERIFY_ROWS = (1, 8)  # verification overhead is measured on a root-only tree (`ar`) and an 8-node chain


def _tree_mask(rows: int) -> tuple[torch.Tensor, list[int]]:
    """A bushy tree's mask and depths: node i's parent is (i - 1) // 2, like a binary tree."""
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    depth = [0] * rows
    for i in range(rows):
        mask[i, i] = True
        if i > 0:
            parent = (i - 1) // 2
            mask[i] |= mask[parent]
            depth[i] = depth[parent] + 1
    return mask, depth


def forward_cost_curve(
    model: Transformer,
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 24, 32, 48, 64),
    context: int = 256,
    repeats: int = 7,
    fixed_width: bool | None = None,
) -> dict[int, float]:
    """Seconds of one forward of n tree nodes on top of `context` cached tokens (fastest of `repeats`).

    `fixed_width` (default: as `ModelOracle` runs the model) times passes over
    the whole cache's key width, with a throwaway second row when n = 1 (see
    `ModelOracle.score`); draft stages run with `fixed_width=False`.
    """
    device = model.embed.weight.device
    context = max(1, min(context, model.config.max_position - max(sizes) - 2))
    cache = model.new_cache(context + max(sizes) + 1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict[int, float] = {}
    fixed = wants_fixed_width(model) if fixed_width is None else fixed_width

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    runner = None
    if pass_mode(model) != "eager":  # time the static-shape passes (CUDA graphs) the loop runs
        runner = StaticRunner(model, runner_capacity(context + max(sizes) + 1), graphs=pass_mode(model) == "graphs",
                              min_rows=2 if fixed and device.type == "cpu" else 1)
        cache = runner.cache
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
        if runner is not None:
            runner.run(prompt[0].tolist(), torch.arange(context), None, logits_rows=slice(-1, None))
        else:
            model(prompt, torch.arange(context, device=device), cache, logits_rows=slice(-1, None))
        cache.commit()
        for n in sizes:
            rows = max(n, 2) if fixed and runner is None else n
            toks = torch.randint(0, vocab, (1, rows), generator=g).to(device)
            mask, depth = _tree_mask(rows)
            pos = torch.tensor(depth, device=device) + context
            times: list[float] = []
            wanted = repeats + 1
            r = 0
            while r < wanted:  # the first pass of a new shape warms caches and kernels
                sync()
                t = time.perf_counter()
                if runner is not None:
                    runner.run(toks[0].tolist(), pos.cpu(), mask, logits_rows=slice(0, n))
                else:
                    model(toks, pos, cache, tree_mask=mask.to(device) if rows > 1 else None, logits_rows=slice(0, n),
                          key_width=cache.max_len if fixed else None)
                sync()
                if r:
                    times.append(time.perf_counter() - t)
                    if r == 1:  # slow shapes (a big model's wide passes) take fewer repeats: the whole stays seconds
                        wanted = 1 + max(MIN_REPEATS, min(repeats, int(SECONDS_PER_SHAPE / max(times[0], 1e-9))))
                r += 1
                cache.discard()
            out[n] = min(times)
    return monotone(out)


def ragged_segment_cost(model: Transformer, context: int = 256, segments: int = RAGGED_SEGMENTS, rows: int = 2,
                        repeats: int = 5, fixed_width: bool | None = None) -> float:
    """Seconds one more request's segment adds to a ragged pass (`stagedspec.models.ragged`) beyond its rows.

    A segment has its own attention call per layer against its own cache, and the work around it; the
    cost curves (one sequence) do not see that.  Times `segments` segments of `rows` rows each against one
    segment of all those rows (same rows, same cache length and key width), fastest of `repeats`, and
    returns the difference per extra segment (0 where ragged passes do not run: static passes, or an error).
    """
    from stagedspec.models.ragged import Segment, forward_ragged

    if pass_mode(model) != "eager" or segments < 2:
        return 0.0
    device = model.embed.weight.device
    total = segments * rows
    context = max(1, min(context, model.config.max_position - total - 2))
    cache = model.new_cache(context + total + 1)
    fixed = wants_fixed_width(model) if fixed_width is None else fixed_width
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def seg(n: int) -> Segment:
        toks = torch.randint(0, vocab, (1, n), generator=g).to(device)
        mask, depth = _tree_mask(n)
        return Segment(toks, torch.tensor(depth, device=device) + context, cache, mask.to(device), None,
                       cache.max_len if fixed else None)

    try:
        with torch.inference_mode():
            prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
            model(prompt, torch.arange(context, device=device), cache, logits_rows=slice(-1, None))
            cache.commit()
            best = {"one": math.inf, "many": math.inf}
            shapes = {"one": [seg(total)], "many": [seg(rows) for _ in range(segments)]}
            for r in range(2 * repeats + 1):  # alternating, so that both shapes see the same machine
                for key, parts in shapes.items():  # every segment reserves the same slots: the cost, not the result
                    sync()
                    t = time.perf_counter()
                    forward_ragged(model, parts)
                    sync()
                    if r:
                        best[key] = min(best[key], time.perf_counter() - t)
                    cache.discard()
    except Exception:  # noqa: BLE001 - a model ragged passes cannot run: no segment cost to price
        return 0.0
    return max(0.0, (best["many"] - best["one"]) / (segments - 1))


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


def model_fingerprint(model: Transformer) -> str:
    """A short key for 'the same weights in the same format' (config, dtype, quantisation, weight samples, and
    the fp32 kernel plan)."""
    h = hashlib.sha256(repr(sorted(vars(model.config).items())).encode())
    h.update(str(model.embed.weight.dtype).encode())
    h.update(str(getattr(model, "quantised", False)).encode())
    h.update(str(len(model.layers)).encode())
    if getattr(model, "head_q", None) is not None:  # int4, int8, or int8 up to some rows (`draft_weights`)
        kinds = {f"{type(m).__name__}:{getattr(m, 'max_rows', '')}" for m in model.modules()}
        h.update(repr(sorted(kinds)).encode())
    sample = model.embed.weight.detach().flatten()[:512].float().cpu()
    h.update(sample.numpy().tobytes())
    # Drafts distilled from one oracle share its config and embedding: a sample of their last layer tells them
    # apart (else two rounds of a draft would share a profile and what `auto` learned of the other's acceptance).
    for tensor in model.layers[-1].state_dict().values():
        h.update(tensor.detach().flatten()[:64].float().cpu().numpy().tobytes())
    plan = getattr(model, "matmul_plan_signature", None)  # fp32 CPU: which kernel runs which passes
    if plan is not None:
        h.update(f"plan={plan}".encode())
    return h.hexdigest()[:16]


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
    # at `VERIFY_ROWS` rows: reading the decisions back, and at T > 0 the acceptance rules and the draws.  On an
    # H100 at T=1 an 8-node tree's cost 0.67 ms more than `ar`'s, a fifth of a pass (2026-11-23).  Empty: 0.
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


def profile_key(oracle: Transformer, drafts: Sequence[Transformer], device: str) -> str:
    """The cache key: the models, their dtype and format, the device, the thread count, the machine."""
    parts = [model_fingerprint(oracle), *(model_fingerprint(d) for d in drafts), device,
             hardware.fingerprint(device)]
    if pass_mode(oracle) != "eager":  # static passes and CUDA graphs cost differently (`stagedspec.runner`)
        parts.append(pass_mode(oracle) + ("+compiled" if is_compiled(oracle) else ""))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def profile_path(key: str) -> Path:
    # The version is in the name (from version 3): processes running an older stagedspec keep reading (and
    # rewriting) their own files rather than re-measuring over each other's.
    return cache_root() / "costs" / f"{key}.v{PROFILE_VERSION}.json"


class OthersLoad:
    """CPUs' worth of other processes' work since construction (0.0 where `/proc/stat` is not readable)."""

    def __init__(self) -> None:
        from stagedspec.threads import allowed_cpus, read_busy_seconds

        self._cpus, self._read = allowed_cpus(), read_busy_seconds
        self._start = (time.perf_counter(), self._read(self._cpus), time.process_time())

    def since_start(self) -> float:
        wall0, busy0, own0 = self._start
        busy = self._read(self._cpus)
        wall = time.perf_counter() - wall0
        if busy is None or busy0 is None or wall <= 0:
            return 0.0
        return max(0.0, ((busy - busy0) - (time.process_time() - own0)) / wall)


def measure_profile(oracle: Transformer, drafts: Sequence[Transformer], device: str, *, repeats: int = 5,
                    quiet: bool = False) -> CostProfile:
    """Time the oracle's and every draft's passes by row count, as the loop runs them (a few seconds)."""
    if not quiet:
        print(f"stagedspec: measuring pass costs on {hardware.describe(device)} (once; cached)...",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    load = OthersLoad()
    rows = CUDA_ORACLE_ROWS if device.startswith("cuda") else CPU_ORACLE_ROWS
    oracle_curve = forward_cost_curve(oracle, sizes=rows, context=256, repeats=repeats)
    draft_curves = [forward_cost_curve(d, sizes=DRAFT_ROWS, context=256, repeats=repeats, fixed_width=False)
                    for d in drafts]
    overhead = draft_pass_overhead(drafts[0], draft_curves[0], repeats=repeats) if drafts else {}
    # A segment's own work cannot cost more than a whole one-row pass (a noisy machine can make it look so).
    segment = [min(ragged_segment_cost(oracle, repeats=repeats), oracle_curve[min(oracle_curve)])]
    segment += [min(ragged_segment_cost(d, repeats=repeats, fixed_width=False), c[min(c)])
                for d, c in zip(drafts, draft_curves)]
    verify = verify_step_overhead(oracle, repeats=repeats)
    return CostProfile(oracle_curve, draft_curves, hardware.describe(device), profile_key(oracle, drafts, device),
                       time.perf_counter() - t0, overhead, segment, verify, load.since_start())


def verify_step_overhead(oracle: Transformer, repeats: int = 5) -> dict[str, list[float]]:
    """Host seconds of a step's verification beyond the oracle's pass, at `VERIFY_ROWS` rows.

    Runs the loop's own calls (`ModelOracle.score`, then `verify` and
    `commit`) on chains of random tokens, greedy and sampled (T=1, top-k 50),
    over the curve's 256-token context, and times what follows the pass:
    reading the decisions back and, at T > 0, each row's softmax, top-k and
    draws.  The fastest of `repeats`.  Why: `auto` priced a step as its pass
    alone, so on a GPU at T=1 a tree whose verification cost more than `ar`'s
    (0.67 ms at 8 rows on an H100) looked as cheap as `ar`.  An earlier form
    subtracted the curve from a whole step timed over a shorter context; on a
    CPU that came out below zero and priced a sampled row's host work at
    nothing (AMD EPYC AVX2, SmolLM2, 2026-11-25).
    """
    from stagedspec.runner import ModelOracle
    from stagedspec.sampling import SamplingParams
    from stagedspec.tree import TokenTree
    from stagedspec.verification import verify

    g = torch.Generator().manual_seed(2)
    vocab = oracle.config.vocab_size
    steps = repeats + 1
    context = max(2, min(256, oracle.config.max_position - steps * max(VERIFY_ROWS) - 2))
    on_gpu = oracle.embed.weight.device.type == "cuda"
    out: dict[str, list[float]] = {}
    with torch.inference_mode():
        for key, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=1.0, top_k=50))):
            points = []
            for rows in VERIFY_ROWS:
                runner = ModelOracle(oracle, context + steps * rows + 2)
                runner.prefill(torch.randint(0, vocab, (context,), generator=g).tolist())
                root = int(torch.randint(0, vocab, (), generator=g))
                best = math.inf
                for i in range(steps):  # the first step runs the context and warms this shape up
                    tree = TokenTree.chain(root, torch.randint(0, vocab, (rows - 1,), generator=g).tolist())
                    scores = runner.score(tree)
                    if on_gpu:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    result = verify(tree, scores, sampling, g)
                    runner.commit(result.accepted)
                    seconds = time.perf_counter() - t
                    root = result.next_token
                    if i:
                        best = min(best, seconds)
                points.append(best)
            out[key] = points
    return out


def draft_pass_overhead(draft: Transformer, curve: Mapping[int, float], repeats: int = 5) -> dict[str, float]:
    """Host seconds per draft pass beyond the pass itself, when the draft grows small trees.

    Times real tree proposals (8 nodes, depth 4, as `auto`'s tree arms grow
    them), greedy and sampled (T=1, top-k 50), one new context token each
    time, and subtracts the passes' cost from `curve`; the fastest of
    `repeats`.
    """
    from stagedspec.drafters.model import ModelDrafter
    from stagedspec.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    vocab = draft.config.vocab_size
    out = {}
    with torch.inference_mode():
        for key, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=1.0, top_k=50))):
            # over the curve's 256-token context: a shorter one made the passes cheaper than the curve says,
            # and the host work came out too small
            length = max(2, min(256, draft.config.max_position - repeats - 16))
            drafter = ModelDrafter(draft, method="tree", tree_budget=8, max_depth=4, branching=2,
                                   max_len=length + repeats + 16)
            context = torch.randint(0, vocab, (length,), generator=g).tolist()
            drafter.begin(context)
            drafter.propose(context, sampling, g, 8)  # the context's own catch-up pass, not timed
            best = math.inf
            for _ in range(repeats):
                context.append(int(torch.randint(0, vocab, (), generator=g)))
                passes = drafter.forward_passes
                t = time.perf_counter()
                drafter.propose(context, sampling, g, 8)
                seconds = time.perf_counter() - t
                passes = drafter.forward_passes - passes
                best = min(best, max(0.0, seconds - passes * interpolate(curve, 3)) / max(1, passes))
            out[key] = best
    return out


# One measurement at a time in a process.  The server's first requests arrive together, each on a thread of its
# own: without this, each could measure a profile of its own (timings differ run to run), one on disk and others
# in memory, and a seeded request priced by one in memory could choose other arms than the same request run
# alone against the file.  The first caller measures and writes; the others wait and read what it wrote.
_MEASURING = threading.Lock()


def load_or_measure(oracle: Transformer, drafts: Sequence[Transformer], device: str, *, remeasure: bool = False,
                    quiet: bool = False) -> CostProfile:
    """The cached profile for these models on this machine, measuring (and caching) it when missing."""
    key = profile_key(oracle, drafts, device)
    path = profile_path(key)
    with _MEASURING:
        if not remeasure and path.exists():
            try:
                return CostProfile.from_json(path.read_text())
            except (ValueError, KeyError, TypeError, OSError):
                pass  # a corrupt or old cache entry is simply measured again
        profile = measure_profile(oracle, drafts, device, quiet=quiet)
        if profile.others_load >= SPARE_CPU:
            if not quiet:
                print(f"stagedspec: other processes kept {profile.others_load:.1f} CPUs busy while pass costs were "
                      "measured; using them for this run only (measured again next time)", file=sys.stderr)
            return profile
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, profile.to_json())  # processes measuring at once never share a temporary
        except OSError as e:  # a read-only cache folder costs a re-measure next time, nothing else
            if not quiet:
                print(f"stagedspec: could not cache the cost profile in {path.parent}: {e}", file=sys.stderr)
        return profile


def print_cost_curve(curve: Mapping[int, float]) -> None:
    base = curve[min(curve)]
    print("rows  ms/forward  cost vs 1 row")
    for n, secs in sorted(curve.items()):
        print(f"{n:4d}  {1000 * secs:10.2f}  {secs / base:6.2f}x")
