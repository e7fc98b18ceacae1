"""The contract of the model whose output must be reproduced exactly (`Oracle`).

A module of its own at the bottom of the core: the loop (`stagedspec.generation`) verifies with an oracle,
and drafters (`stagedspec.drafters.base.Drafter.attach_oracle`) may read one, so both import it from here and
neither from the other.  `stagedspec.runner.ModelOracle` is the one that runs a loaded model.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from torch import Tensor

from stagedspec.tree import TokenTree


class Oracle(Protocol):
    """The model whose output must be reproduced exactly.

    `bit_exact`: greedy steps keep only what was verified on slot-aligned rows
    (`keep_slot_aligned`); True only for a `ModelOracle` asked for it, False for
    every other oracle.  `forward_passes`: the passes it ran (the stats report them).
    """

    forward_passes: int
    bit_exact: bool

    def prefill(self, prompt_ids: Sequence[int]) -> None: ...

    def score(self, tree: TokenTree) -> Tensor:
        """Logits [N, V]: row i is the next-token distribution after the path to node i."""
        ...

    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root and the `accepted` nodes (in order) of the last scored tree."""
        ...
