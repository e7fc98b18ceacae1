"""Two drafters proposing to the same oracle: a model's tree plus model-free chains, merged.

Prompt lookup is right exactly where a small draft is weakest (copying a
span of the prompt: a signature, a docstring, a variable name), and it costs
microseconds.  In a stage chain its proposals normally reach the oracle only
through the draft, which rejects those it would not have written itself;
merging them into the tree the oracle verifies gives the oracle both.

The extra proposals are deterministic, so they are merged as *fixed* nodes;
verification tries a node's drawn children before its fixed ones, which
keeps sampled decoding exact (see `stagedspec.verification`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch

from stagedspec.drafters.base import Drafter, StageTelemetry
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree

if TYPE_CHECKING:
    from stagedspec.oracle import Oracle


class MergedDrafter(Drafter):
    """`primary`'s tree with `extra`'s deterministic proposals merged in (common prefixes shared)."""

    def __init__(self, primary: Drafter, extra: Drafter) -> None:
        self.primary, self.extra = primary, extra
        self.primary_seconds = self.extra_seconds = 0.0

    @property
    def forward_passes(self) -> int:
        return self.primary.forward_passes + self.extra.forward_passes

    @property
    def name(self) -> str:
        return f"{self.primary.name}+{self.extra.name}"

    def attach_oracle(self, oracle: Oracle) -> None:
        """Pass the loop's oracle on to a drafter that reads its hidden states (a feature draft)."""
        for d in (self.primary, self.extra):
            d.attach_oracle(oracle)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.primary.begin(prompt_ids)
        self.extra.begin(prompt_ids)

    def stage_telemetry(self) -> list[StageTelemetry]:
        """The primary's stage rows, then one row for the merged extra drafter."""
        primary = self.primary.stage_telemetry()
        if primary is None:  # one stage with no figures of its own: timed here
            rows = [StageTelemetry(self.primary.name, self.primary.forward_passes, self.primary_seconds)]
        else:
            rows = list(primary)
        extra = StageTelemetry(f"{self.extra.name} (to oracle)", self.extra.forward_passes, self.extra_seconds)
        return [*rows, extra]

    def propose(
        self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None, max_tokens: int
    ) -> TokenTree:
        t0 = time.perf_counter()
        tree = self.primary.propose(context, sampling, generator, max_tokens)
        t1 = time.perf_counter()
        self.primary_seconds += t1 - t0
        t0 = t1
        tree.merge_fixed(self.extra.propose(context, sampling, generator, max_tokens))
        self.extra_seconds += time.perf_counter() - t0
        return tree
