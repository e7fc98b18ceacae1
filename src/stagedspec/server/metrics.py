"""Server counters in the Prometheus text exposition format (no client library needed).

The scheduler's worker thread updates them and HTTP handlers read them, so
every access holds one lock; the numbers are cheap sums, never histograms.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict


def resident_bytes() -> int:
    """This process's resident memory (Linux `/proc/self/statm`; 0 where it cannot be read).

    Why it is exported: a soak test (`stagedspec bench-serve --soak-minutes`) checks from outside
    that serving does not leak, and a Prometheus scrape shows the same figure."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.queued = 0
        self.memory_in_use = 0  # bytes: weights + scratch + KV of admitted requests
        self.memory_budget = 0
        self.requests: dict[str, int] = defaultdict(int)  # finished requests by outcome
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.oracle_passes = 0
        self.steps = 0  # oracle verification steps (each emits accepted + 1 tokens)
        self.accepted = 0  # draft tokens accepted, summed over steps
        self.tokens_by_stage: dict[str, int] = defaultdict(int)  # who proposed each emitted token
        self.seconds_by_stage: dict[str, float] = defaultdict(float)
        self.passes_by_stage: dict[str, int] = defaultdict(int)
        self.ragged_passes = 0  # batched passes: one per model per barrier, however many requests they carry
        self.ragged_segments = 0  # request passes those carried
        self.trees_off = 0  # running requests whose trees are off (root-only) for memory (`server.pressure`)
        self.tree_levels: dict[int, int] = {}  # running requests per shrink level > 0 (`server.pressure`)

    def update(self, **gauges: object) -> None:
        with self._lock:
            for name, value in gauges.items():
                setattr(self, name, value)

    def record_step(self, origins: list[str], accepted: int, oracle_passes: int) -> None:
        with self._lock:
            self.tokens_generated += len(origins)
            self.steps += 1
            self.accepted += accepted
            self.oracle_passes += oracle_passes
            for o in origins:
                self.tokens_by_stage[o] += 1

    def record_finish(self, outcome: str, stages: list[dict]) -> None:
        with self._lock:
            self.requests[outcome] += 1
            for row in stages:
                self.seconds_by_stage[row["stage"]] += row["seconds"]
                self.passes_by_stage[row["stage"]] += row["forward_passes"]

    def record_prompt(self, n_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += n_tokens

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def render(self) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP stagedspec_{name} {help_text}")
                lines.append(f"# TYPE stagedspec_{name} {kind}")
                for labels, value in samples:
                    lines.append(f"stagedspec_{name}{labels} {value:g}" if isinstance(value, float)
                                 else f"stagedspec_{name}{labels} {value}")

            def by(label: str, d: dict) -> list[tuple[str, float]]:
                return [(f'{{{label}="{k}"}}', v) for k, v in sorted(d.items())]

            metric("requests_running", "gauge", "Requests in the running batch.", [("", self.running)])
            metric("requests_queued", "gauge", "Requests waiting for a slot or for memory.", [("", self.queued)])
            metric("requests_total", "counter", "Finished requests by outcome.", by("outcome", self.requests))
            metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", self.prompt_tokens)])
            metric("tokens_generated_total", "counter", "Tokens emitted to requests.", [("", self.tokens_generated)])
            metric("oracle_passes_total", "counter", "Oracle forward passes.", [("", self.oracle_passes)])
            metric("steps_total", "counter", "Oracle verification steps.", [("", self.steps)])
            metric("mean_accepted_length", "gauge", "Tokens emitted per oracle step, since start.",
                   [("", float(self.mean_accepted_length))])
            metric("stage_tokens_total", "counter", "Emitted tokens by the stage that proposed them.",
                   by("stage", self.tokens_by_stage))
            metric("stage_seconds_total", "counter", "Seconds spent per stage (finished requests).",
                   by("stage", {k: float(v) for k, v in self.seconds_by_stage.items()}))
            metric("stage_forward_passes_total", "counter", "Forward passes per stage (finished requests).",
                   by("stage", self.passes_by_stage))
            metric("batched_passes_total", "counter", "Ragged passes run for several requests at once.",
                   [("", self.ragged_passes)])
            metric("batched_request_passes_total", "counter", "Request passes carried by the ragged passes.",
                   [("", self.ragged_segments)])
            metric("requests_speculation_off", "gauge", "Running requests whose trees are off under memory "
                   "pressure.", [("", self.trees_off)])
            metric("requests_tree_shrunk", "gauge", "Running requests whose tree budget is shrunk under memory "
                   "pressure, by shrink level (each level halves the node budget; the last is root-only).",
                   by("level", self.tree_levels))
            metric("memory_in_use_bytes", "gauge", "Weights + scratch + KV of admitted requests (memory model).",
                   [("", self.memory_in_use)])
            metric("memory_budget_bytes", "gauge", "--max-memory.", [("", self.memory_budget)])
            metric("process_resident_bytes", "gauge", "Resident memory of the server process (measured).",
                   [("", resident_bytes())])
            return "\n".join(lines) + "\n"
