"""`PassSpec`: what one model pass computes besides its tokens, positions and cache.

Why one record: a pass is described the same way wherever it runs (a model's
`forward`, a static-shape runner, the server's ragged batch of many
requests' passes), and each of those paths used to take the same six knobs
as separate arguments, which drifted (`return_hidden` was a bool or a
string).  Every path now reads this record, and `runner.RequestPasses.run_pass`
is the one place that chooses the path.

Shapes: T new tokens in the pass, C committed cache entries before it, H the
hidden size, B the batch (1 except for batched prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from torch import Tensor

Hidden = Literal["none", "rows", "all"]
HIDDEN_CHOICES: tuple[str, ...] = ("none", "rows", "all")


@dataclass(frozen=True, eq=False)
class PassSpec:
    """How one pass runs and what it returns (see `Transformer.forward` for the full contract).

    - `tree_mask`: which new tokens each new token sees: [T, T] (bool, diagonal
      included; the committed prefix is always visible), [T, C + T] (the complete
      mask), [B, 1, T, C + T] (one complete mask per sequence), or None (causal).
    - `logits_rows`: the rows the vocabulary head runs on (None: all; a prefill
      passes `slice(-1, None)`).
    - `hidden`: "none" (logits only), "rows" (also the final normalised hidden
      states of `logits_rows`) or "all" (of every row: a feature draft reads the
      oracle's state at every committed position).
    - `key_width`: attend over exactly this many cache slots (the rest masked), so
      that a row's rounding does not depend on how full the cache is.
    - `row_independent`: attention one query row at a time, so that a row's bits do
      not depend on the rows that share its pass (`--bit-exact`).
    - `features` [B, T, H]: a feature draft's per-row input features.
    """

    tree_mask: Tensor | None = None
    logits_rows: Tensor | slice | None = None
    hidden: Hidden = "none"
    key_width: int | None = None
    row_independent: bool = False
    features: Tensor | None = None

    def __post_init__(self) -> None:
        if self.hidden not in HIDDEN_CHOICES:
            raise ValueError(f"PassSpec.hidden must be one of {', '.join(HIDDEN_CHOICES)}, got {self.hidden!r}")

    @property
    def wants_hidden(self) -> bool:
        """Whether the pass returns (logits, hidden) rather than logits alone."""
        return self.hidden != "none"

    def but(self, **changes: object) -> PassSpec:
        """A copy with `changes` (a frozen record is never edited in place)."""
        return replace(self, **changes)


PLAIN = PassSpec()  # a causal pass over every row, logits only
