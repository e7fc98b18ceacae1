"""Integer codes and scales of GGUF K-quant tensors, read from their raw blocks.

Why: a dequantised Q4_K or Q6_K weight is a product of several stored
numbers (a super-block scale, a 6- or 8-bit sub-block scale, a code).  The
native kernels run those numbers themselves (`kernels/qlinear.cpp`, formats
`q4_k` and `q6_k`), so the model computes with exactly the weights the file
defines at the file's own size (4.5 and 6.56 bits a weight), where recovering
them from fp32 values would be ambiguous.

Block layouts (ggml's `block_q4_K` and `block_q6_K`, 256 weights each):

- Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and
  eight 6-bit mins, 128 bytes of 4-bit codes.  Weight = d * sc[j] * code -
  dmin * m[j] for group j of 32.  Codes of groups 2c and 2c+1 share bytes
  32c..32c+31 (low and high nibbles).
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs,
  16 int8 scales (one per 16 weights), fp16 d.  Weight = d * sc * (code - 32).
- Q5_0, 22 bytes per 32 weights: fp16 d, a uint32 of fifth bits (bit j =
  weight j), 16 bytes of low nibbles (weight j low, weight j+16 high).
  Weight = d * (code - 16).

The decoders are checked against `gguf.quants.dequantize` bit for bit
(`tests/test_gguf_codes.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

Q4K_BLOCK, Q6K_BLOCK, Q5_0_BLOCK = 144, 210, 22
KEPT_TYPES = ("Q4_K", "Q6_K", "Q5_0")  # GGUF types whose codes these decoders return


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor's stored blocks: `blocks` uint8 [rows, bytes per row], `kind` its GGUF type name."""

    kind: str
    blocks: np.ndarray
    cols: int

    def rows_permuted(self, order: Tensor) -> RawTensor:
        """The same tensor with its rows reordered (llama.cpp's Q/K row order undone); rows are independent."""
        return RawTensor(self.kind, self.blocks[order.numpy()], self.cols)


def _blocks(raw: RawTensor, size: int, weights: int = 256) -> np.ndarray:
    rows = raw.blocks.shape[0]
    return np.ascontiguousarray(raw.blocks).reshape(rows, raw.cols // weights, size)


def _fp16(b: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].copy())


def q4k_codes(raw: RawTensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Q4_K -> codes uint8 [N, K] (0..15), sc and m uint8 [N, K/32], d and dmin fp16 [N, K/256]."""
    b = _blocks(raw, Q4K_BLOCK)
    n, supers = b.shape[:2]
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
    s = b[..., 4:16].astype(np.uint8)
    sc = np.empty((n, supers, 8), np.uint8)
    m = np.empty((n, supers, 8), np.uint8)
    sc[..., :4], m[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    q = b[..., 16:].reshape(n, supers, 4, 32)  # chunk c of 64 weights: low nibbles first, then high
    codes = np.stack([q & 0x0F, q >> 4], axis=3).reshape(n, supers * 256)
    return (torch.from_numpy(codes), torch.from_numpy(sc.reshape(n, -1)), torch.from_numpy(m.reshape(n, -1)), d, dmin)


def q6k_codes(raw: RawTensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q6_K -> codes uint8 [N, K] (0..63), sc int8 [N, K/16], d fp16 [N, K/256]."""
    b = _blocks(raw, Q6K_BLOCK)
    n, supers = b.shape[:2]
    ql = b[..., :128].reshape(n, supers, 2, 2, 32)  # [half, lo/hi 32 bytes, l]
    qh = b[..., 128:192].reshape(n, supers, 2, 32)  # [half, l]
    # within each half of 128 weights, quarter j (32 weights) takes nibble j // 2 of ql[j % 2] and bits 2j of qh
    quarters = []
    for j in range(4):
        nib = (ql[:, :, :, j % 2] >> (4 * (j // 2))) & 0x0F
        quarters.append(nib | (((qh >> (2 * j)) & 3) << 4))
    codes = np.stack(quarters, axis=3).reshape(n, supers * 256)
    sc = b[..., 192:208].copy().view(np.int8).reshape(n, supers * 16)
    return torch.from_numpy(codes), torch.from_numpy(sc), _fp16(b[..., 208:210])


def q5_0_codes(raw: RawTensor) -> tuple[Tensor, Tensor]:
    """Q5_0 -> codes uint8 [N, K] (0..31), d fp16 [N, K/32]."""
    b = _blocks(raw, Q5_0_BLOCK, 32)
    n, groups = b.shape[:2]
    fifth = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [n, groups, 1]
    bits = ((fifth >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, groups, 32]
    qs = b[..., 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    codes = (low | (bits << 4)).reshape(n, groups * 32)
    return torch.from_numpy(codes), _fp16(b[..., 0:2])


def dequantized(raw: RawTensor) -> Tensor:
    """The fp32 weight [N, K] the decoded numbers stand for (tests compare it with gguf's own dequantisation)."""
    if raw.kind == "Q4_K":
        codes, sc, m, d, dmin = q4k_codes(raw)
        n, k = codes.shape
        dd, dm = d.float().repeat_interleave(8, 1), dmin.float().repeat_interleave(8, 1)
        w = codes.float().reshape(n, k // 32, 32) * (dd * sc.float())[..., None] - (dm * m.float())[..., None]
        return w.reshape(n, k)
    if raw.kind == "Q6_K":
        codes, sc, d = q6k_codes(raw)
        n, k = codes.shape
        scale = d.float().repeat_interleave(16, 1) * sc.float()
        return ((codes.float() - 32).reshape(n, k // 16, 16) * scale[..., None]).reshape(n, k)
    if raw.kind == "Q5_0":
        codes, d = q5_0_codes(raw)
        n, k = codes.shape
        return ((codes.float() - 16).reshape(n, k // 32, 32) * d.float()[..., None]).reshape(n, k)
    raise ValueError(f"no decoder for GGUF type {raw.kind}")
