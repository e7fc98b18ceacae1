"""One forward pass over several sequences' passes at once, each over its own KV cache ("ragged" batching).

Why: on a memory-bound CPU, a pass over 8 rows costs little more than a pass
over 1, because the weights are streamed once either way.  A server with 8
requests decoding at once should therefore run each layer's matmuls once for
all of them.  The requests' caches differ in length and their trees in size,
so padding them into a [B, T] batch would change every request's attention
shapes (and so its rounding).  Instead the rows of all passes are
concatenated into one [1, sum T] sequence for every row-wise operation
(embedding, norms, QKV/O/MLP matmuls, RoPE, the head), and attention runs
per segment, against that segment's own cache, with exactly the mask, key
width and call shape `Transformer.forward` would use for it alone.

So a segment differs from its solo pass only in how many rows share the
row-wise matmuls; attention (the only op that mixes rows) is the solo call.

A segment may also ask for what the feature-draft passes need: its final
normalised hidden states (`PassSpec.hidden`: "rows", those of its logits
rows, or "all" of its rows; the oracle records them for a feature draft) and
per-row input `features` (a `FeatureDraftModel` fuses them with
the token embedding, a row-wise op like the others).
`tests/test_ragged.py` checks a one-segment pass is bit-identical to
`Transformer.forward`, and several segments agree with their solo passes.

Padding (`pad=True`, what the server's batcher asks for): the total row
count of a ragged pass changes from round to round, and so do the matmuls'
shapes.  On the CPU every new row count M costs native memory that is kept:
oneDNN builds (and caches, 1024 by default) a bf16 matmul primitive per
(M, weight shape), and glibc keeps the heap fragmented by the many
differently sized buffers; a server that saw hundreds of row counts grew
by hundreds of MB (docs/serving.md, the soak).  So the concatenated rows
are padded up to one of a few sizes (`padded_rows`: 1, 2, 4, 8, then steps
of an eighth of the next power of two: 35 sizes up to 4096 rows), and so
are the head's picked rows.  Padding rows are token 0 at position 0, take no part in attention (each segment attends over its own
rows and cache only; a padding row's attention output is zero) and nothing
reads their outputs, so a real row sees them only as other rows of the
row-wise matmuls, as it sees its neighbours' rows (`tests/test_ragged.py`:
padded and unpadded passes agree).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from stagedspec.cache import KVCache
from stagedspec.pass_options import env_flag
from stagedspec.models.pass_spec import PLAIN, PassSpec
from stagedspec.models.transformer import Transformer, apply_rope, attend_row_by_row, decoding_mode


PAD_BY_DEFAULT = env_flag(os.environ, "STAGEDSPEC_RAGGED_PAD", True)


def padded_rows(n: int) -> int:
    """The rows a padded ragged pass of `n` rows runs as: 1, 2, 4 or 8, then the next multiple of an eighth
    of the next power of two, at least 8 (9-64 in steps of 8, 65-128 of 16, 129-256 of 32, ...): 35 sizes up
    to 4096 rows.  Up to 64 rows a pass costs about the same whatever its rows (the weights' streaming
    dominates); beyond, at most a fifth of the rows are padding."""
    if n <= 0:
        return n
    if n <= 8:
        return 1 << max(n - 1, 0).bit_length()
    step = max(8, (1 << (n - 1).bit_length()) // 8)
    return -(-n // step) * step


@dataclass
class Segment:
    """One sequence's pass: what `Transformer.forward` takes (batch 1)."""

    tokens: Tensor  # [1, T]
    positions: Tensor  # [T]
    cache: KVCache
    spec: PassSpec = PLAIN  # its `features`, if any, [1, T, H] (zeros for a feature draft's segment without)


@dataclass
class _Prepared:
    """A segment's per-pass attention inputs, built once and used by every layer."""

    start: int
    rows: slice  # its rows in the concatenated sequence
    mask: Tensor | None  # additive bias of the global layers
    local_mask: Tensor | None  # of the sliding-window layers


def forward_ragged(model: Transformer, segments: list[Segment],
                   pad: bool = False) -> list[Tensor | tuple[Tensor, Tensor]]:
    """Run every segment's pass in one go; returns each segment's logits [1, T', V] (with `spec.hidden`:
    logits and hidden states [1, T' or T, H]), as `forward` would.  `pad`: run the row-wise ops over
    `padded_rows` rows, and the head over `padded_rows` of the picked rows (see the module docstring)."""
    if not segments:
        return []
    if any(s.tokens.shape[0] != 1 for s in segments):
        raise ValueError("ragged passes take batch-1 segments")
    with decoding_mode(model):
        return _forward_ragged(model, segments, pad)


def _forward_ragged(model: Transformer, segments: list[Segment], pad: bool) -> list[Tensor | tuple[Tensor, Tensor]]:
    prepared, offset = [], 0
    for s in segments:
        T = s.tokens.shape[1]
        prepared.append(_prepare(model, s, offset))
        offset += T
    extra = padded_rows(offset) - offset if pad else 0
    tokens = torch.cat([s.tokens for s in segments], dim=1)
    positions = torch.cat([s.positions for s in segments])
    features = _features(model, segments)
    if extra:  # padding rows: token 0 at position 0 (zero features), never attended to nor read
        tokens = torch.cat([tokens, tokens.new_zeros(1, extra)], dim=1)
        positions = torch.cat([positions, positions.new_zeros(extra)])
        if features is not None:
            features = torch.cat([features, features.new_zeros(1, extra, features.shape[-1])], dim=1)
    x, rope, local_rope = model.embed_rows(tokens, positions, features)  # row-wise
    stack = model.runtime.native_stack
    taps = model.runtime.feature_taps if any(s.spec.wants_hidden for s in segments) else ()
    tapped: list[Tensor] = []
    if stack is not None and not taps and all(s.cache.k.dim() == 5 and not isinstance(p.start, Tensor)
                                 for s, p in zip(segments, prepared)):
        # every block in one native call, attention per segment inside it: the same operations and bits as
        # the loop below (`tests/test_ragged.py`), without a Python call per operation
        x = stack.ragged(x, rope, [s.cache.k for s in segments], [s.cache.v for s in segments],
                         [p.start for p in prepared], [p.rows.stop - p.rows.start for p in prepared],
                         [p.mask for p in prepared])
    else:
        for i, layer in enumerate(model.layers):  # the blocks one by one (also where `feature_taps` keeps inputs)
            if i in taps:
                tapped.append(layer.attn_norm(x))
            local = bool(model.local) and model.local[i]
            h = _attention(layer.attn, layer.attn_norm(x), local_rope if local else rope, segments, prepared, i,
                           local)
            x = layer.after_attention(x, h)
    picked = []
    for s, p in zip(segments, prepared):
        rows = range(p.rows.start, p.rows.stop)
        picked.append(rows[s.spec.logits_rows] if s.spec.logits_rows is not None else rows)
    index_rows = [r for rows in picked for r in rows]
    if pad and index_rows:  # the head's rows padded too (repeats of the last; their logits are not read)
        index_rows += [index_rows[-1]] * (padded_rows(len(index_rows)) - len(index_rows))
    index = torch.tensor(index_rows, dtype=torch.long, device=x.device)
    hidden = None
    if any(s.spec.wants_hidden for s in segments):  # the norm over every row (row-wise), the head over the picked
        logits, hidden = model.head_logits(x, index, "all", tapped)
    else:
        logits = model.head_logits(x[:, index], None)  # a draft's restricted head comes back scattered
    out: list[Tensor | tuple[Tensor, Tensor]] = []
    at = 0
    for s, p, rows in zip(segments, prepared, picked):
        seg_logits = logits[:, at:at + len(rows)]
        at += len(rows)
        if not s.spec.wants_hidden:
            out.append(seg_logits)
        else:
            assert hidden is not None
            own = p.rows if s.spec.hidden == "all" else slice(rows.start, rows.stop, rows.step)
            out.append((seg_logits, hidden[:, own]))
    return out


def _features(model: Transformer, segments: list[Segment]) -> Tensor | None:
    """The segments' input features, one row per token (zeros where a segment has none), or None if none has."""
    if all(s.spec.features is None for s in segments):
        return None
    W = next(s.spec.features.shape[-1] for s in segments if s.spec.features is not None)  # H, or wider with taps
    p = model.embed.weight
    return torch.cat([s.spec.features if s.spec.features is not None else p.new_zeros(1, s.tokens.shape[1], W)
                      for s in segments], dim=1)


def _prepare(model: Transformer, s: Segment, offset: int) -> _Prepared:
    """Reserve the segment's cache slots and build its masks exactly as `Transformer.forward` does."""
    T = s.tokens.shape[1]
    cache, positions = s.cache, s.positions
    device = model.embed.weight.device
    dtype = model.embed.weight.dtype
    start = cache.reserve(T)
    if cache.positions is not None:
        cache.positions[:, start:start + T] = positions
    bool_mask = model.build_mask(T, start, s.spec.tree_mask, device)
    if s.spec.key_width is not None:
        bool_mask = model.widen_mask(bool_mask, T, start, s.spec.key_width, device)
    groups = 1 if s.spec.row_independent else model.config.n_heads // model.config.n_kv_heads
    mask = None if bool_mask is None else model.mask_to_bias(bool_mask, dtype, groups)
    local_mask = mask
    if any(model.local):
        local = model.local_attention_mask(bool_mask, positions, cache, start + T)
        if local is not None:
            local_mask = model.mask_to_bias(local, dtype, groups)
    return _Prepared(start, slice(offset, offset + T), mask, local_mask)


def _attention(attn, x: Tensor, rope, segments: list[Segment], prepared: list[_Prepared],  # noqa: ANN001
               layer: int, local: bool) -> Tensor:
    """`Attention.forward` with the projections over all rows and SDPA per segment."""
    _, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = attn.wqkv(x).view(1, T, H + 2 * Hkv, D).transpose(1, 2)  # [1, heads, T, D]
    qk, v = qkv.split([H + Hkv, Hkv], dim=1)
    if attn.q_norm is not None:
        qk = attn.norm_qk(qk)
    if attn.use_rope and rope is not None:
        cos, sin = rope
        qk = apply_rope(qk, cos, sin).to(x.dtype)
    q, k = qk.split([H, Hkv], dim=1)
    G = H // Hkv
    outs = []
    for s, p in zip(segments, prepared):
        n = p.rows.stop - p.rows.start
        k_cache, v_cache = s.cache.k[layer], s.cache.v[layer]
        end = p.start + n
        k_cache[:, :, p.start:end] = k[:, :, p.rows]
        v_cache[:, :, p.start:end] = v[:, :, p.rows]
        mask = p.local_mask if local else p.mask
        width = end if mask is None else mask.shape[-1]
        keys, values = k_cache[:, :, :width], v_cache[:, :, :width]
        qs = q[:, :, p.rows]
        if attn.native_attention is not None:  # every row alone: the segment's solo numbers, bit for bit
            o = attn.native_attention.attention(qs, keys, values, mask, attn.scale or D ** -0.5)
        elif s.spec.row_independent and mask is not None:
            o = attend_row_by_row(qs, keys, values, mask, G, attn.scale)
        else:
            o = F.scaled_dot_product_attention(qs.reshape(1, Hkv, G * n, D), keys, values, attn_mask=mask,
                                               scale=attn.scale)
        outs.append(o.reshape(1, H, n, D).transpose(1, 2).reshape(1, n, H * D))
    extra = T - prepared[-1].rows.stop
    if extra:  # padding rows attend to nothing: their attention output is zero
        outs.append(x.new_zeros(1, extra, H * D))
    return attn.wo(torch.cat(outs, dim=1))

