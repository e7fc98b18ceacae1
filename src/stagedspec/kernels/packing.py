"""Lay quantised weights out the way the native kernels read them (see `qlinear.cpp`'s header).

Why tiles: a tile is 8 output features by one group of 32 inputs, contiguous
in memory with its scales, so one pass over the weights is one sequential
stream, and each loaded tile serves every row of the pass before the next loads.
Output counts are padded to a multiple of 8 with zero weights; the kernels
never write the padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32  # inputs per quantisation group
TILE = 8  # output features per tile


def _pad_rows(t: Tensor, multiple: int) -> Tensor:
    extra = (-t.shape[0]) % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])


def _scales_by_tile(values: Tensor) -> Tensor:
    """fp16 [N, G] -> uint8 [tiles, G, 16]: each (tile, group)'s 8 values, as bytes."""
    v = _pad_rows(values.to(torch.float16).contiguous(), TILE)
    tiles, groups = v.shape[0] // TILE, v.shape[1]
    v = v.reshape(tiles, TILE, groups).permute(0, 2, 1).contiguous()
    return v.view(torch.uint8).reshape(tiles, groups, 2 * TILE)


def pack_int4(codes: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """codes uint8 [N, K] in 0..15, scale and low [N, K/32] (weight = scale * code + low) -> packed uint8."""
    n, k = codes.shape
    assert k % GROUP == 0 and scale.shape == low.shape == (n, k // GROUP)
    c = _pad_rows(codes.to(torch.uint8), TILE)
    tiles, groups = c.shape[0] // TILE, k // GROUP
    # k = g*32 + half*16 + 4v + i  ->  [tile, g, v, o, i, half]
    c = c.reshape(tiles, TILE, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, groups, 128)
    return torch.cat([nibbles, _scales_by_tile(scale), _scales_by_tile(low)], dim=-1).reshape(-1).contiguous()


def pack_int8(codes: Tensor, scale: Tensor) -> Tensor:
    """codes int8 [N, K] in -127..127, scale [N, K/32] (weight = scale * code) -> packed uint8."""
    n, k = codes.shape
    assert k % GROUP == 0 and scale.shape == (n, k // GROUP)
    c = _pad_rows(codes.to(torch.int8), TILE)
    tiles, groups = c.shape[0] // TILE, k // GROUP
    c = c.reshape(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4).contiguous()  # [tile, g, v, o, i]
    body = c.view(torch.uint8).reshape(tiles, groups, 256)
    return torch.cat([body, _scales_by_tile(scale)], dim=-1).reshape(-1).contiguous()


def dequantize_int4(codes: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """The fp32 weight [N, K] that int4 codes stand for (reference for tests)."""
    n, k = codes.shape
    c = codes.float().reshape(n, k // GROUP, GROUP)
    return (c * scale.float()[..., None] + low.float()[..., None]).reshape(n, k)


def dequantize_int8(codes: Tensor, scale: Tensor) -> Tensor:
    n, k = codes.shape
    return (codes.float().reshape(n, k // GROUP, GROUP) * scale.float()[..., None]).reshape(n, k)


def _scales_from_tiles(raw: Tensor, n: int) -> Tensor:
    """uint8 [tiles, G, 16] -> fp32 [n, G]: the inverse of `_scales_by_tile`."""
    tiles, groups = raw.shape[:2]
    v = raw.contiguous().view(torch.float16).reshape(tiles, groups, TILE).permute(0, 2, 1)
    return v.reshape(tiles * TILE, groups)[:n].float()


def unpack_int4(packed: Tensor, n: int, k: int) -> Tensor:
    """The fp32 weight [n, k] that `pack_int4`'s output multiplies by (tests and dequantised copies)."""
    tiles, groups = -(-n // TILE), k // GROUP
    p = packed.reshape(tiles, groups, 160)
    codes = _int4_codes_from_vectors(p[..., :128], n, k)
    return dequantize_int4(codes, _scales_from_tiles(p[..., 128:144], n), _scales_from_tiles(p[..., 144:], n))


def unpack_int8(packed: Tensor, n: int, k: int) -> Tensor:
    """The fp32 weight [n, k] that `pack_int8`'s output multiplies by."""
    tiles, groups = -(-n // TILE), k // GROUP
    p = packed.reshape(tiles, groups, 272)
    codes = p[..., :256].contiguous().view(torch.int8).reshape(tiles, groups, 8, TILE, 4)
    codes = codes.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)[:n]
    return dequantize_int8(codes, _scales_from_tiles(p[..., 256:], n))


# ------------------------------------------------------------------ GGUF K-quant formats, kept exactly
SUPER = 256  # inputs per K-quant super-block
FORMATS = {"int4": 0, "int8": 1, "q4_k": 2, "q6_k": 3, "q5_0": 4}  # the native kernels' format numbers
BITS_PER_WEIGHT = {"int4": 5.0, "int8": 8.5, "q4_k": 1184 * 8 / (SUPER * TILE), "q6_k": 1680 * 8 / (SUPER * TILE),
                   "q5_0": 5.5}


def _by_tile(values: Tensor, per_group: int) -> Tensor:
    """[N, G * per_group] bytes -> uint8 [tiles, G, TILE * per_group]: output o's bytes at o*per_group."""
    v = _pad_rows(values.contiguous(), TILE)
    tiles = v.shape[0] // TILE
    groups = v.shape[1] // per_group
    v = v.reshape(tiles, TILE, groups, per_group).permute(0, 2, 3, 1)  # [tile, g, k, o]: k-th byte of o
    return v.reshape(tiles, groups, per_group * TILE)


def _int4_code_vectors(codes: Tensor) -> Tensor:
    """codes uint8 [N, K] in 0..15 -> uint8 [tiles, G, 128]: the int4 layout's code vectors."""
    n, k = codes.shape
    c = _pad_rows(codes.to(torch.uint8), TILE)
    tiles, groups = c.shape[0] // TILE, k // GROUP
    c = c.reshape(tiles, TILE, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [tile, g, v, o, i, half]
    return (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, groups, 128)


def _with_super_heads(groups: Tensor, heads: Tensor) -> Tensor:
    """groups [tiles, G, B] and heads [tiles, G/8, H] -> each super-block's head, then its 8 groups."""
    tiles, g, b = groups.shape
    body = groups.reshape(tiles, g // 8, 8 * b)
    return torch.cat([heads, body], dim=-1).reshape(-1).contiguous()


def _fp16_heads(*values: Tensor) -> Tensor:
    """fp16 [N, G/8] tensors -> uint8 [tiles, G/8, 16 * len(values)]: each super-block's 8 values of each."""
    return torch.cat([_scales_by_tile(v) for v in values], dim=-1)


def pack_q4k(codes: Tensor, sc: Tensor, m: Tensor, d: Tensor, dmin: Tensor) -> Tensor:
    """Q4_K kept exactly -> packed uint8 (layout in `qlinear.cpp`).

    codes uint8 [N, K] in 0..15; sc, m uint8 [N, K/32] (6-bit); d, dmin fp16 [N, K/256];
    weight = (d * sc) * code - dmin * m.
    """
    n, k = codes.shape
    assert k % SUPER == 0 and sc.shape == m.shape == (n, k // GROUP) and d.shape == dmin.shape == (n, k // SUPER)
    groups = torch.cat([_int4_code_vectors(codes), _by_tile(sc.to(torch.uint8), 1), _by_tile(m.to(torch.uint8), 1)], -1)
    return _with_super_heads(groups, _fp16_heads(d, dmin))


def pack_q6k(codes: Tensor, sc: Tensor, d: Tensor) -> Tensor:
    """Q6_K kept exactly -> packed uint8: codes uint8 [N, K] in 0..63, sc int8 [N, K/16], d fp16 [N, K/256];
    weight = d * sc * (code - 32)."""
    n, k = codes.shape
    assert k % SUPER == 0 and sc.shape == (n, k // 16) and d.shape == (n, k // SUPER)
    c = _pad_rows(codes.to(torch.uint8), TILE)
    tiles, groups = c.shape[0] // TILE, k // GROUP
    c = c.reshape(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, g, v, o, i]: input 4v+i
    low, high = c & 0x0F, c >> 4
    nibbles = (low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(tiles, groups, 128)
    h = high.reshape(tiles, groups, 2, 4, TILE, 4)  # [.., u, k, o, i]: code vector 4u + k
    pairs = (h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)).reshape(tiles, groups, 64)
    s = sc.to(torch.int8).view(torch.uint8).reshape(n, groups, 2)
    scales = torch.cat([_by_tile(s[..., 0], 1), _by_tile(s[..., 1], 1)], dim=-1)
    return _with_super_heads(torch.cat([nibbles, pairs, scales], dim=-1), _fp16_heads(d))


def pack_q5(codes: Tensor, d: Tensor) -> Tensor:
    """Q5_0 kept exactly -> packed uint8: codes uint8 [N, K] in 0..31, d fp16 [N, K/32]; weight = d * (code - 16)."""
    n, k = codes.shape
    assert k % GROUP == 0 and d.shape == (n, k // GROUP)
    c = _pad_rows(codes.to(torch.uint8), TILE)
    tiles, groups = c.shape[0] // TILE, k // GROUP
    fifth = (c >> 4).reshape(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, g, v, o, i]
    bits = sum(fifth[:, :, v] << v for v in range(8)).reshape(tiles, groups, 32)
    return torch.cat([_int4_code_vectors(c[:n] & 0x0F), bits.to(torch.uint8), _scales_by_tile(d)], dim=-1).reshape(-1).contiguous()


def unpack_q5(packed: Tensor, n: int, k: int) -> Tensor:
    """The fp32 weight [n, k] that `pack_q5`'s output multiplies by."""
    tiles, groups = -(-n // TILE), k // GROUP
    p = packed.reshape(tiles, groups, 176)
    low = _int4_codes_from_vectors(p[..., :128], tiles * TILE, k)
    bits = p[..., 128:160].reshape(tiles, groups, 1, TILE, 4)
    fifth = torch.cat([(bits >> v) & 1 for v in range(8)], dim=2)  # [tile, g, v, o, i]
    fifth = fifth.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)
    codes = (low | (fifth << 4))[:n].float().reshape(n, groups, GROUP)
    d = _scales_from_tiles(p[..., 160:], n)
    return ((codes - 16) * d[..., None]).reshape(n, k)


def _super_split(packed: Tensor, n: int, k: int, head: int, group: int) -> tuple[Tensor, Tensor]:
    tiles, supers = -(-n // TILE), k // SUPER
    p = packed.reshape(tiles, supers, head + 8 * group)
    return p[..., :head], p[..., head:].reshape(tiles, supers * 8, group)


def _from_tiles(raw: Tensor, n: int, per_group: int) -> Tensor:
    """uint8 [tiles, G, TILE * per_group] -> [n, G * per_group]: the inverse of `_by_tile`."""
    tiles, groups = raw.shape[:2]
    v = raw.reshape(tiles, groups, per_group, TILE).permute(0, 3, 1, 2)
    return v.reshape(tiles * TILE, groups * per_group)[:n]


def _int4_codes_from_vectors(vectors: Tensor, n: int, k: int) -> Tensor:
    tiles, groups = vectors.shape[:2]
    nib = vectors.reshape(tiles, groups, 4, TILE, 4)
    codes = torch.stack([nib & 0x0F, nib >> 4], dim=-1)  # [tile, g, v, o, i, half]
    return codes.permute(0, 3, 1, 5, 2, 4).reshape(tiles * TILE, k)[:n]


def unpack_q4k(packed: Tensor, n: int, k: int) -> Tensor:
    """The fp32 weight [n, k] that `pack_q4k`'s output multiplies by, computed as the kernels do."""
    heads, groups = _super_split(packed, n, k, 32, 144)
    d = _scales_from_tiles(heads[..., :16], n).repeat_interleave(8, dim=1)
    dmin = _scales_from_tiles(heads[..., 16:], n).repeat_interleave(8, dim=1)
    codes = _int4_codes_from_vectors(groups[..., :128], n, k).float().reshape(n, k // GROUP, GROUP)
    sc, m = _from_tiles(groups[..., 128:136], n, 1).float(), _from_tiles(groups[..., 136:], n, 1).float()
    return (codes * (d * sc)[..., None] - (dmin * m)[..., None]).reshape(n, k)


def unpack_q6k(packed: Tensor, n: int, k: int) -> Tensor:
    """The fp32 weight [n, k] that `pack_q6k`'s output multiplies by."""
    heads, groups = _super_split(packed, n, k, 16, 208)
    tiles, g = groups.shape[:2]
    d = _scales_from_tiles(heads, n).repeat_interleave(16, dim=1)  # per sub-block of 16
    nib = groups[..., :128].reshape(tiles, g, 4, TILE, 4)
    low = torch.cat([nib & 0x0F, nib >> 4], dim=2)  # [tile, g, v(8), o, i]
    pairs = groups[..., 128:192].reshape(tiles, g, 2, 1, TILE, 4)
    high = torch.stack([(pairs >> (2 * j)) & 3 for j in range(4)], dim=3).reshape(tiles, g, 8, TILE, 4)
    codes = (low | (high << 4)).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)[:n].float()
    s = torch.stack([_from_tiles(groups[..., 192:200], n, 1), _from_tiles(groups[..., 200:], n, 1)], dim=-1)
    sc = s.contiguous().view(torch.int8).reshape(n, k // 16).float()
    return ((codes - 32).reshape(n, k // 16, 16) * (d * sc)[..., None]).reshape(n, k)


def random_format(fmt: str, n: int, k: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random weights [n, k] in format `fmt`: (packed, the fp32 weight it stands for). For self-checks and tests."""
    groups = k // GROUP
    if fmt == "int4":
        codes, scale = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), (torch.rand(n, groups, generator=g) * 0.05).half()
        packed = pack_int4(codes, scale, (torch.randn(n, groups, generator=g) * 0.1).half())
        return packed, unpack_int4(packed, n, k)
    if fmt == "q5_0":
        packed = pack_q5(torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8),
                         (torch.rand(n, groups, generator=g) * 0.01).half())
        return packed, unpack_q5(packed, n, k)
    if fmt == "int8":
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        packed = pack_int8(codes, (torch.rand(n, groups, generator=g) * 0.005).half())
        return packed, unpack_int8(packed, n, k)
    supers = k // SUPER
    d = (torch.rand(n, supers, generator=g) * 0.01).half()
    if fmt == "q4_k":
        six = lambda: torch.randint(0, 64, (n, groups), generator=g, dtype=torch.uint8)  # noqa: E731
        packed = pack_q4k(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), six(), six(), d,
                          (torch.rand(n, supers, generator=g) * 0.01).half())
        return packed, unpack_q4k(packed, n, k)
    if fmt == "q6_k":
        packed = pack_q6k(torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
                          torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8), d)
        return packed, unpack_q6k(packed, n, k)
    raise ValueError(f"unknown format {fmt!r}")


def random_segments(fmts: tuple[str, ...], k: int, g: torch.Generator) -> tuple[Tensor, list[int], list[int]]:
    """One random weight with a segment per format (output counts 20, 12, ... not all multiples of 8)."""
    parts = [random_format(f, 20 - 4 * (i % 3), k, g)[0] for i, f in enumerate(fmts)]
    return torch.cat(parts), [FORMATS[f] for f in fmts], [20 - 4 * (i % 3) for i in range(len(fmts))]


def unpack_segments(packed: Tensor, formats: list[int], outs: list[int], k: int) -> Tensor:
    """The fp32 weight [sum(outs), k] of a weight stored as segments (`qlinear`'s layout: one after another)."""
    names = {v: name for name, v in FORMATS.items()}
    unpack = {"int4": unpack_int4, "int8": unpack_int8, "q4_k": unpack_q4k, "q6_k": unpack_q6k, "q5_0": unpack_q5}
    pieces, at = [], 0
    for fmt, n in zip(formats, outs):
        name = names[fmt]
        size = int(-(-n // TILE) * TILE * k * BITS_PER_WEIGHT[name] / 8)
        pieces.append(unpack[name](packed[at:at + size], n, k))
        at += size
    return torch.cat(pieces)
