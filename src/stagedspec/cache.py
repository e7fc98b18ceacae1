"""A static (preallocated) KV cache that understands speculation.

A forward pass writes the keys/values of its new tokens into the slots right
after the committed prefix; they are *pending* until the caller decides which
of them survive.  `commit(keep)` moves only the kept entries (the accepted
path of a token tree) down next to the prefix, so the cost is proportional to
the accepted path, never to the cache size.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stagedspec.errors import StagedSpecError


class KVCache:
    """Keys and values for every layer: shape [layers, batch, kv_heads, max_len, head_dim]."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        track_positions: bool = False,
        spare: int = 0,
    ) -> None:
        """`spare`: slots past `max_len` that no entry is ever kept in.  A static-shape pass (see
        `stagedspec.runner`) writes its padding rows there, so a bucket of rows always fits."""
        self.slots = max_len + spare  # physical slots; the static passes attend over all of them
        shape = (n_layers, batch, n_kv_heads, self.slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # The position of each slot's token [batch, max_len], written by the model's forward.  Only
        # sliding-window models need it (slot order is not position order once trees are cached).
        self.positions = torch.zeros(batch, self.slots, dtype=torch.long, device=device) if track_positions else None
        self.max_len = max_len
        self.length = 0  # committed entries, slots [0, length)
        self.pending = 0  # entries of the last forward, slots [length, length + pending)

    def reserve(self, n_new: int) -> int:
        """Claim slots for `n_new` pending entries; returns the first slot.

        Any earlier pending entries are discarded: a forward always builds on
        the committed prefix only.
        """
        if self.length + n_new > self.max_len:
            raise StagedSpecError(
                f"context is full: {self.length} cached + {n_new} new tokens exceed "
                f"the cache size of {self.max_len} tokens"
            )
        self.pending = n_new
        return self.length

    def commit(self, keep: Sequence[int] | torch.Tensor | None = None) -> None:
        """Keep the pending entries at indices `keep` (ascending), in that order; drop the rest.

        `keep=None` keeps all of them.  Kept entries are compacted so that the
        committed prefix stays contiguous.
        """
        if keep is None:
            self.length += self.pending
            self.pending = 0
            return
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)  # checked in Python: no tensor ops
        n = len(keep)
        if n and (max(keep) >= self.pending or min(keep) < 0):
            raise ValueError(f"keep indices {keep} outside the {self.pending} pending entries")
        if keep != list(range(n)):  # not already in place: one device-side gather of the kept entries
            src = torch.tensor([self.length + i for i in keep], device=self.k.device)
            dst = slice(self.length, self.length + n)
            self.k[:, :, :, dst] = self.k.index_select(3, src)
            self.v[:, :, :, dst] = self.v.index_select(3, src)
            if self.positions is not None:
                self.positions[:, dst] = self.positions.index_select(1, src)
        self.length += n
        self.pending = 0

    def discard(self) -> None:
        """Drop the pending entries."""
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Forget committed entries past `length` (a drafter rolling back to the oracle's view)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
        self.pending = 0

    def reset(self) -> None:
        self.length = 0
        self.pending = 0
