"""Memory pressure: running requests' trees give way before a request is kept waiting.

With batched passes every running request's tree rows share one pass, so the
pass's activations (the memory model's tree scratch) grow with the number of
requests and their tree sizes.  When a waiting request's KV cache would fit
but the tree rows of everyone would not, the scheduler turns speculation off
(root-only trees: one row a step) for the newcomer first, then for running
requests, newest first, rather than queue the newcomer; trees come back,
oldest request first, as memory frees.  A running request is never paused
or evicted: it keeps decoding, only with smaller trees.

Exactness: whether a step proposes a tree is decided before the step, from
server state the step's oracle pass cannot influence, which is the rule
trees live by (`stagedspec.verification`): greedy output is unchanged, a
sampled output keeps the oracle's distribution, but a seeded request that
had its tree turned off draws differently from its solo run (its draws are
spent on other proposals), so seed-for-seed equality holds only for
requests whose trees were never shrunk.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree


class SwitchableDrafter:
    """A request's drafter whose proposals the scheduler can turn off (root-only trees) and on again."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.enabled = True
        self.skipped_steps = 0
        self._proposed = False

    @property
    def forward_passes(self) -> int:
        return getattr(self.inner, "forward_passes", 0)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.inner.begin(prompt_ids)

    def propose(self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None,
                max_tokens: int) -> TokenTree:
        self._proposed = self.enabled
        if self.enabled:
            return self.inner.propose(context, sampling, generator, max_tokens)
        self.skipped_steps += 1
        return TokenTree([context[-1]], [-1])

    def verified(self, seconds: float) -> None:
        """Only a step the inner drafter proposed tells it what verifying cost."""
        hook = getattr(self.inner, "verified", None)
        if self._proposed and hook is not None:
            hook(seconds)
