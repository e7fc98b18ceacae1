"""One decoder-only transformer covering the Llama family, Gemma-3 and GPT-2.

Written for small-batch decoding speed (few, fused matmuls: one QKV and one
gate/up projection per layer) and for speculation: every forward pass takes
explicit positions and an optional tree mask, and writes its keys/values into
a `KVCache` as *pending* entries the caller later keeps or drops.

Gemma-3 is the Llama layout with switches read from `ModelConfig` (see its
docstring); the one structural addition is sliding-window attention, which is
applied through the attention mask (`Transformer.local_attention_mask`) so tree masks,
the KV commit and the fixed key width work unchanged.

Parameter names are our own; `stagedspec.models.loading` maps HF and GGUF
checkpoints onto them.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stagedspec.cache import KVCache
from stagedspec.models.config import ModelConfig
from stagedspec.models.matmul_plan import planned_linear
from stagedspec.models.pass_spec import PLAIN, Hidden, PassSpec
from stagedspec.models.runtime import ModelRuntime


def decoding_mode(model: nn.Module) -> contextlib.AbstractContextManager:
    """Inference mode around a pass of a model in eval mode, or with gradients off: every decoding pass.

    Why: inference mode skips autograd's per-op bookkeeping (version counters,
    the autograd dispatch key), part of the fixed cost of the ~1,300 small ops
    of a decoding pass: 0.4-0.9 ms of a 13.5 ms int4 pass on the reference CPU.
    A model being trained (`train()` mode, gradients on: a draft in `distill`)
    keeps plain passes, so its gradients flow.  The pass writes the cache in
    place (allowed on ordinary tensors); what it returns is an inference
    tensor, which decoding only reads (training code that keeps an eval-mode
    teacher's outputs clones them, as `distill.teacher_topk` does).
    Already in inference mode (a compiled pass, which `stagedspec.runner`
    enters it around): nothing more, so the compiler traces no mode switch
    (one inside a CUDA-compiled pass broke PyTorch's dispatcher state).
    """
    if (model.training and torch.is_grad_enabled()) or torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    return torch.inference_mode()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # `F.rms_norm` is x * rsqrt(mean(x^2) + eps) in one kernel (60 norms per SmolLM2 pass).
        # In bf16 the weight goes into that kernel too: it accumulates in fp32 and rounds once, after
        # the weight (the reference rounds before it, so ~1 element in 4 differs by an ulp, closer to
        # the exact value), in place of a cast, the norm, a cast back and a multiply: 3 of ~50 ops a layer.
        if x.dtype == torch.float32:
            return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in fp32.

    transformers computes `(x_norm * (1 + w)).to(dtype)` in fp32 (unlike
    Llama's `w * x_norm.to(dtype)`); doing the same keeps bf16 runs as close
    to the reference as fp32 runs are.  The stored weight stays in HF's
    convention, so checkpoints map onto it without arithmetic.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables [max_position, head_dim] in the rotate-half layout used by HF checkpoints.

    The sin table's first half is negated (see `apply_rope`, which relies on it)."""
    if torch.empty(()).is_meta:  # a model built on the meta device gets its tables later (`loading.build_model`)
        return torch.empty(max_position, head_dim), torch.empty(max_position, head_dim)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    sin = angles.sin()
    return torch.cat([angles, angles], dim=-1).cos().float(), torch.cat([-sin, sin], dim=-1).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, D] by the angles of its positions (cos/sin broadcast as [B or 1, 1, T, D]).

    `sin` is the signed table of `rope_tables` (first half negated), so the
    rotate-half term x' * sin with x' = cat(-x2, x1) is cat(x2, x1) * sin:
    one flip of the two halves instead of two slices, a negation and a cat,
    the same numbers to the bit (negation is exact).
    """
    halves = x.unflatten(-1, (2, x.shape[-1] // 2))
    return x * cos + halves.flip(-2).flatten(-2) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias or cfg.arch == "gpt2")
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.arch == "gpt2")
        self.use_rope = cfg.arch in ("llama", "gemma3")
        # Gemma-3: RMSNorm on every q and k head (before RoPE), and its own attention scale.
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.arch == "gemma3" else None
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.arch == "gemma3" else None
        self.scale = None if cfg.query_pre_attn_scalar is None else float(cfg.query_pre_attn_scalar) ** -0.5
        # Set by `models.quant.quantize_model` on the native kernels: attention with every row computed alone
        # (`stagedspec.kernels.attention.cpp`), for passes over the cache (not the static path's slot tensors).
        self.native_attention = None

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        k_cache: Tensor,
        v_cache: Tensor,
        start: int | Tensor,
        mask: Tensor | None,
        row_independent: bool = False,
    ) -> Tensor:
        """`start`: the first cache slot of the new tokens, or (a static pass) a tensor of their slots."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # [B, heads, T, D]
        qk, v = qkv.split([H + Hkv, Hkv], dim=1)
        if self.q_norm is not None:
            qk = self.norm_qk(qk)
        if self.use_rope and rope is not None:
            cos, sin = rope
            qk = apply_rope(qk, cos, sin)  # q and k rotated in one go (cos/sin come in x's dtype: no cast)
        q, k = qk.split([H, Hkv], dim=1)
        if isinstance(start, Tensor):  # a static pass: device-side write slots, every slot is a key
            k_cache.index_copy_(2, start, k)
            v_cache.index_copy_(2, start, v)
            keys, values = k_cache, v_cache
        else:
            k_cache.narrow(2, start, T).copy_(k)  # narrow: one view op, where [:, :, a:b] makes three
            v_cache.narrow(2, start, T).copy_(v)
            width = start + T if mask is None else mask.shape[-1]  # a fixed key width: see Transformer.forward
            keys, values = k_cache.narrow(2, 0, width), v_cache.narrow(2, 0, width)
        G = H // Hkv
        if self.native_attention is not None and not isinstance(start, Tensor):
            out = self.native_attention.attention(q, keys, values, mask, self.scale or D ** -0.5)
        elif row_independent and mask is not None:
            out = attend_row_by_row(q, keys, values, mask, G, self.scale)
        else:
            # Grouped-query attention without copying the cache: the G query heads
            # that share a KV head are folded into the query-length axis (the mask
            # comes folded the same way, see `Transformer.mask_to_bias`).
            out = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, D), keys, values, attn_mask=mask,
                                                 scale=self.scale)
        # reshape, not view: other SDPA backends (CUDA flash/efficient, cuDNN off) return non-contiguous outputs
        return self.wo(out.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D))

    def norm_qk(self, qk: Tensor) -> Tensor:
        """q_norm on the H query heads and k_norm on the Hkv key heads of qk [B, H + Hkv, T, D], in one pass.

        Elementwise the same as normalising q and k separately (fp32, then
        (1 + w)), without splitting and re-joining the tensor RoPE rotates next.
        """
        assert self.q_norm is not None and self.k_norm is not None
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        w = torch.cat([self.q_norm.weight.float().expand(H, D), self.k_norm.weight.float().expand(Hkv, D)])
        xf = qk.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.q_norm.eps)
        return (xf * (1.0 + w[:, None, :])).to(qk.dtype)


def attend_row_by_row(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, G: int,
                       scale: float | None = None) -> Tensor:
    """Attention with every query token as its own SDPA call (its G grouped heads as the rows).

    Why: the CPU kernel's rounding of a row depends on the problem it is part
    of: how many query rows share a block (about one row in 20 of a 4-row
    problem differs by an ulp from the same row in a 2-row problem, in bf16),
    and even how many batch entries share the call (seen on the real model:
    a 3-entry call rounded its last entry differently from a 1-entry call).
    One call per token, always of the same shape, makes a row's numbers
    independent of the pass it is in, at several times the attention cost.
    q [B, H, T, D]; keys/values [B, Hkv, S, D]; mask [T, S] or [B, 1, T, S];
    returns [B, H, T, D].
    """
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    rows = q.reshape(B, Hkv, G, T, D)
    masks = mask if mask.dim() == 4 else mask[None, None].expand(B, 1, T, mask.shape[-1])
    out = torch.empty_like(rows)
    for b in range(B):
        for t in range(T):
            out[b, :, :, t] = F.scaled_dot_product_attention(
                rows[b:b + 1, :, :, t], keys[b:b + 1], values[b:b + 1], attn_mask=masks[b:b + 1, :, t:t + 1],
                scale=scale,
            )[0]
    return out.reshape(B, H, T, D)


class MLP(nn.Module):
    """SwiGLU for Llama (fused gate/up), GELU-tanh gated for Gemma-3, GELU for GPT-2."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.arch in ("llama", "gemma3")
        self.gelu_gate = cfg.arch == "gemma3"
        bias = cfg.arch == "gpt2"
        up_out = 2 * cfg.intermediate_size if self.gated else cfg.intermediate_size
        self.w_up = nn.Linear(cfg.hidden_size, up_out, bias=bias)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.w_up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu_gate else F.silu(gate)
            return self.w_down(act * up)
        return self.w_down(F.gelu(h, approximate="tanh"))


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gemma3":
        return OffsetRMSNorm(cfg.hidden_size, cfg.norm_eps)
    if cfg.arch == "llama":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)
        # Gemma-3 also normalises each sub-layer's output before it joins the residual stream.
        self.post_attn_norm = _norm(cfg) if cfg.arch == "gemma3" else None
        self.post_mlp_norm = _norm(cfg) if cfg.arch == "gemma3" else None
        # Set by `models.quant.quantize_model` on the native kernels: this whole block as one C++ call
        # (`stagedspec.kernels.layer.cpp`, the same operations and bits) for passes over the cache.
        self.native_layer: Callable[..., Tensor] | None = None

    def forward(self, x, rope, k_cache, v_cache, start, mask, row_independent=False):  # noqa: ANN001 - hot path
        if self.native_layer is not None and not isinstance(start, Tensor):
            return self.native_layer(x, rope, k_cache, v_cache, start, mask)
        return self.after_attention(x, self.attn(self.attn_norm(x), rope, k_cache, v_cache, start, mask,
                                                 row_independent))

    def after_attention(self, x: Tensor, h: Tensor) -> Tensor:
        """The rest of the block once attention gave `h` for input `x`: the residual joins and the MLP.

        Every pass that computes attention its own way (the cache-free training pass of a draft, the
        ragged pass of several requests) finishes the block here, so Gemma's extra norms are in one place."""
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")


@contextlib.contextmanager
def _without_init():
    """`torch.nn.init`'s functions as no-ops while a model is built on the meta device.

    Why: on meta tensors they run through PyTorch's decompositions, whose
    first use imports torch._dynamo: a noticeable part of every command's
    start, for values that are replaced at once
    (docs/measurements.md, "`torch.nn.init` on meta tensors at start-up on an AVX2 EPYC")."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


class Transformer(nn.Module):
    """Decoder-only LM.  `forward` is the only entry point; see its docstring."""

    @classmethod
    def skeleton(cls, cfg: ModelConfig) -> Transformer:
        """A model of `cfg` on the meta device: no memory, no random initialisation, no RoPE tables, for a
        caller that gives it every tensor at once (`loading.build_model`, `truncated_copy`)."""
        with torch.device("meta"), _without_init():
            return cls(cfg)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {cfg.arch!r} (supported: {', '.join(ARCHS)})")
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_position, cfg.hidden_size) if cfg.arch == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A quantised copy of the output head (set by `models.quant.quantize_model`); None: `head_weight` is used.
        self.head_q: nn.Module | None = None
        # A draft's head over part of the vocabulary (`models.head_subset`, `--draft-vocab`): those rows and their
        # token ids, scattered into the whole vocabulary by `expand_logits`; None: the whole head.
        self.subset_head: nn.Module | None = None
        self.subset_ids: Tensor | None = None
        # What this model runs with beside its weights: runner pool, native stack, matmul plan, weight format.
        self.runtime = ModelRuntime()
        if cfg.arch != "gpt2":
            cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        # Gemma-3: which layers attend over a sliding window, with their own RoPE base.
        self.local = [bool(v) for v in cfg.local_layers] if cfg.arch == "gemma3" else []
        if any(self.local):
            if len(self.local) != cfg.n_layers or not cfg.sliding_window:
                raise ValueError("local_layers needs one flag per layer and a sliding_window")
            cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_local_theta)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        # transformers scales the embeddings by sqrt(hidden) rounded to the weights' dtype; so do we.
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.arch == "gemma3" else None

    def truncated_copy(self, n_layers: int) -> Transformer:
        """This model's first `n_layers` layers with its embeddings, final norm, head, RoPE tables and kernel
        plans, all shared, not copied (a weak but always-available draft that shares the vocabulary)."""
        if not 1 <= n_layers < self.config.n_layers:
            raise ValueError(f"a truncated copy needs 1..{self.config.n_layers - 1} layers, got {n_layers}")
        cfg = copy.copy(self.config)
        cfg.n_layers = n_layers
        cfg.local_layers = list(cfg.local_layers[:n_layers])
        draft = Transformer.skeleton(cfg)
        draft.embed, draft.pos_embed, draft.norm, draft.lm_head = self.embed, self.pos_embed, self.norm, self.lm_head
        draft.head_q = self.head_q
        draft.runtime.head_row_plan = self.runtime.head_row_plan
        draft.runtime.matmul_plan_signature = self.runtime.matmul_plan_signature
        draft.layers = nn.ModuleList(list(self.layers)[:n_layers])
        stack = self.runtime.native_stack
        draft.runtime.native_stack = None if stack is None else type(stack).of(list(draft.layers))
        draft.local, draft.embed_scale = list(self.local[:n_layers]), self.embed_scale
        for name, table in self.named_buffers(recurse=False):  # the RoPE tables
            draft.register_buffer(name, table, persistent=False)
        left = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
        if left:  # a new tensor in Transformer that this copy does not share yet
            raise RuntimeError(f"truncated_copy left tensors unshared: {left}")
        return draft

    @property
    def quantised(self) -> bool:
        """Whether `models.quant.quantize_model` made this model's layers and head quantised."""
        return self.head_q is not None

    @property
    def head_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, max_len: int | None = None, batch: int = 1, spare: int = 0) -> KVCache:
        cfg = self.config
        p = self.embed.weight
        return KVCache(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_len or cfg.max_position,
            batch=batch, dtype=p.dtype, device=p.device, track_positions=any(self.local), spare=spare,
        )

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache,
                spec: PassSpec = PLAIN) -> Tensor | tuple[Tensor, Tensor]:
        """Run `tokens` [B, T] at `positions` [T] (or [B, T]) on top of the committed cache, as `spec` says.

        - Attention: every new token sees the whole committed prefix; among the
          new tokens it sees those allowed by `spec.tree_mask` [T, T] (bool,
          True = may attend; must include the diagonal), or the causal
          pattern when `tree_mask` is None.  A `tree_mask` of shape
          [T, cached + T] is used as the complete mask (a drafter growing a
          tree over several passes hides its earlier branches this way); one
          of shape [B, 1, T, cached + T] is a complete mask per sequence
          (batched generation of left-padded prompts).
        - The new keys/values become the cache's pending entries; the caller
          must `cache.commit(...)` the ones to keep.
        - Returns logits [B, T', V] for the rows selected by `spec.logits_rows`
          (all rows by default; a prefill passes `slice(-1, None)` to skip
          the vocabulary head for the prompt).  With `spec.hidden="rows"`, also
          the final normalised hidden states of those rows; `"all"`
          returns them for every row (the logits still only for `logits_rows`):
          a feature draft needs the oracle's hidden state at every committed
          position, the prompt's included (`stagedspec.models.feature_draft`).
        - `spec.features` [B, T, H]: extra per-row inputs, for models whose `embed_rows`
          fuses them with the token embedding (a feature draft); plain
          models take none.
        - `spec.key_width`: attend over exactly this many cache slots (the ones
          past the new tokens masked out) instead of the filled ones.  CPU
          attention kernels round differently for different key counts (and
          for different query counts), so a fixed width removes one way a
          row's result depends on the pass it is in (`ModelOracle` uses the
          cache size; `row_independent` removes the other).
        - `spec.row_independent`: run attention one query token at a time
          (`attend_row_by_row`), so a row's numbers do not depend on how many
          rows share the pass either; `ModelOracle(bit_exact=True)` uses it.
        """
        with decoding_mode(self):
            return self._forward(tokens, positions, cache, spec)

    def _forward(self, tokens: Tensor, positions: Tensor, cache: KVCache,
                 spec: PassSpec) -> Tensor | tuple[Tensor, Tensor]:
        B, T = tokens.shape
        start = cache.reserve(T)
        x, rope, local_rope = self.embed_rows(tokens, positions, spec.features)
        if cache.positions is not None:
            cache.positions[:, start:start + T] = positions
        bool_mask = self.build_mask(T, start, spec.tree_mask, x.device)
        if spec.key_width is not None:
            bool_mask = self.widen_mask(bool_mask, T, start, spec.key_width, x.device)
        row_independent = spec.row_independent
        groups = 1 if row_independent else self.config.n_heads // self.config.n_kv_heads
        mask = None if bool_mask is None else self.mask_to_bias(bool_mask, x.dtype, groups)
        local_mask = mask
        if any(self.local):
            local = self.local_attention_mask(bool_mask, positions, cache, start + T)
            if local is not None:
                local_mask = self.mask_to_bias(local, x.dtype, groups)
        taps = self.runtime.feature_taps if spec.wants_hidden else ()
        tapped: list[Tensor] = []
        stack = self.runtime.native_stack
        if stack is not None and not isinstance(start, Tensor) and cache.k.dim() == 5:
            if not taps:
                return self.head_logits(stack(x, rope, cache.k, cache.v, start, mask), spec.logits_rows, spec.hidden)
            lo = 0
            for hi in (*taps, len(self.layers)):  # the stack in parts, each block's input kept where tapped
                if hi > lo:
                    x = stack.part(lo, hi)(x, rope, cache.k[lo:hi], cache.v[lo:hi], start, mask)
                if hi < len(self.layers):
                    tapped.append(self.layers[hi].attn_norm(x))
                lo = hi
            return self.head_logits(x, spec.logits_rows, spec.hidden, tapped)
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped.append(layer.attn_norm(x))
            if self.local and self.local[i]:
                x = layer(x, local_rope, cache.k[i], cache.v[i], start, local_mask, row_independent)
            else:
                x = layer(x, rope, cache.k[i], cache.v[i], start, mask, row_independent)
        return self.head_logits(x, spec.logits_rows, spec.hidden, tapped)

    def forward_static(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, cache: KVCache,
                       spec: PassSpec = PLAIN) -> Tensor | tuple[Tensor, Tensor]:
        """One static-shape pass: `tokens` [1, T] at `positions` [T], written to cache `slots` [T].

        `mask` [T, cache.slots] (bool) says which cache slots each row sees, the
        new rows' own slots included; every slot is a key, so the shapes depend
        on T alone and no value is read back to the host: the pass can be
        captured as a CUDA graph and replayed at any position
        (`stagedspec.runner`).  The cache's length bookkeeping is the caller's.
        `spec`: its `logits_rows`, `hidden` and `features` (the mask is `mask`; every slot is a key).
        """
        if spec.tree_mask is not None:
            raise ValueError("a static pass takes its mask over the cache's slots as `mask`, not `spec.tree_mask`")
        with decoding_mode(self):
            return self._forward_static(tokens, positions, slots, mask, cache, spec)

    def _forward_static(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, cache: KVCache,
                        spec: PassSpec) -> Tensor | tuple[Tensor, Tensor]:
        B, T = tokens.shape
        x, rope, local_rope = self.embed_rows(tokens, positions, spec.features)
        groups = self.config.n_heads // self.config.n_kv_heads
        bias = self.mask_to_bias(mask, x.dtype, groups)
        local_bias = bias
        if any(self.local):
            assert cache.positions is not None
            cache.positions.index_copy_(1, slots, positions.expand(B, T))
            near = cache.positions[0][None, :] > positions[:, None] - int(self.config.sliding_window)  # [T, S]
            local_bias = self.mask_to_bias(mask & near, x.dtype, groups)
        taps = self.runtime.feature_taps if spec.wants_hidden else ()
        tapped: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped.append(layer.attn_norm(x))
            local = bool(self.local) and self.local[i]
            x = layer(x, local_rope if local else rope, cache.k[i], cache.v[i], slots, local_bias if local else bias)
        return self.head_logits(x, spec.logits_rows, spec.hidden, tapped)

    def embed_rows(self, tokens: Tensor, positions: Tensor,
               features: Tensor | None = None) -> tuple[Tensor, tuple | None, tuple | None]:
        """Token (and GPT-2 position) embeddings, and the RoPE angles of `positions` (global, local layers).

        A plain model has no use for `features`; a feature draft overrides this to fuse them in."""
        if features is not None:
            raise ValueError(f"{type(self).__name__} takes no input features")
        x = self.embed(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = local_rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            rope = _rope_at(self.rope_cos, self.rope_sin, positions, x.dtype)
            if any(self.local):
                local_rope = _rope_at(self.rope_local_cos, self.rope_local_sin, positions, x.dtype)
        return x, rope, local_rope

    def head_logits(self, x: Tensor, logits_rows: Tensor | slice | None,
                    hidden: Hidden = "none", tapped: list[Tensor] | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Final norm and vocabulary head over the selected rows (Gemma's logit soft-cap included).

        `hidden` as `PassSpec.hidden`: "rows" returns the selected rows' normalised hidden states too, "all"
        every row's.  `tapped`: the normalised inputs of the `runtime.feature_taps` layers, each [B, T, H],
        appended to the returned hidden states (the head reads the final ones only)."""
        if hidden == "all":
            h_all = self.norm(x)
            h = h_all if logits_rows is None else h_all[:, logits_rows]
        else:
            h = self.norm(x if logits_rows is None else x[:, logits_rows])
        if tapped and hidden != "none":
            picked = tapped if hidden == "all" or logits_rows is None else [t[:, logits_rows] for t in tapped]
            with_taps = torch.cat([h_all if hidden == "all" else h, *picked], dim=-1)
        if self.subset_head is not None:
            logits = self.subset_head(h)
        elif self.head_q is not None:
            logits = self.head_q(h)
        elif self.runtime.head_row_plan is not None:
            logits = planned_linear(h, self.head_weight, None, self.runtime.head_row_plan)
        else:
            logits = F.linear(h, self.head_weight)
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        logits = self.expand_logits(logits)
        if tapped and hidden != "none":
            return logits, with_taps
        if hidden == "all":
            return logits, h_all
        return (logits, h) if hidden == "rows" else logits

    def expand_logits(self, logits: Tensor) -> Tensor:
        """Logits [..., V'] of this model's head as full-vocabulary logits [..., V].  A head over the whole
        vocabulary returns them as they are; a draft whose head covers a subset of it scatters them
        (`models.draft.DraftModel`, `models.head_subset`), so every pass path returns token ids as columns."""
        if self.subset_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.subset_ids, logits)

    def local_attention_mask(self, mask: Tensor | None, positions: Tensor, cache: KVCache, filled: int) -> Tensor | None:
        """The attention mask of the sliding-window layers, or None when no key can fall outside the window.

        A key is visible to a query in a local layer when the global mask
        allows it and its position is within `sliding_window - 1` of the
        query's (transformers: kv_idx > q_idx - window).  Positions, not cache
        slots, decide: tree nodes sit at their depth and a drafter's cache
        holds branches out of slot order, so the cache records each slot's
        position.  Returns [B, 1, T, S] (bool), S the global mask's width.
        """
        window = int(self.config.sliding_window or 0)
        if int(positions.max()) < window:
            return None  # every position is < window, so every key is within it
        T = positions.shape[-1]
        if mask is None:  # one new token and no fixed width: it sees the whole cache
            mask = torch.ones(T, filled, dtype=torch.bool, device=positions.device)
        S = mask.shape[-1]
        key_pos = cache.positions[:, :S].to(positions.device)  # [B, S]; slots past `filled` are masked anyway
        query_pos = positions if positions.dim() == 2 else positions[None]  # [1 or B, T]
        near = key_pos[:, None, :] > query_pos[:, :, None] - window  # [B, T, S]
        base = mask if mask.dim() == 4 else mask[None, None]
        return base & near[:, None]

    @staticmethod
    def build_mask(T: int, start: int, tree_mask: Tensor | None, device: torch.device) -> Tensor | None:
        if tree_mask is None and T == 1:
            return None  # one new token sees everything: no mask needed
        if tree_mask is not None and tree_mask.shape[-1] == start + T:
            return tree_mask.to(device=device, dtype=torch.bool)  # caller gave the full mask
        new = tree_mask.to(device=device, dtype=torch.bool) if tree_mask is not None else torch.ones(
            T, T, dtype=torch.bool, device=device
        ).tril_()
        if start == 0:
            return new
        return torch.cat([torch.ones(T, start, dtype=torch.bool, device=device), new], dim=1)

    @staticmethod
    def mask_to_bias(mask: Tensor, dtype: torch.dtype, groups: int) -> Tensor:
        """The bool mask as SDPA's additive bias (0 / -inf), with each query row repeated for the
        `groups` query heads folded into it; made once per forward instead of once per layer."""
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        if groups == 1:
            return bias
        # [T, S] for one shared mask, [B, 1, T, S] for one mask per sequence
        return bias.repeat(groups, 1) if bias.dim() == 2 else bias.repeat(1, 1, groups, 1)

    @staticmethod
    def widen_mask(mask: Tensor | None, T: int, start: int, width: int, device: torch.device) -> Tensor:
        """The attention mask padded with masked-out keys to `width` columns."""
        if width < start + T:
            raise ValueError(f"key width {width} is smaller than the {start + T} cached and new tokens")
        if mask is None:  # one new token: it sees the whole prefix and itself
            mask = torch.ones(T, start + T, dtype=torch.bool, device=device)
        pad = torch.zeros(*mask.shape[:-1], width - mask.shape[-1], dtype=torch.bool, device=device)
        return torch.cat([mask, pad], dim=-1)

    def num_bytes(self) -> int:
        """Bytes of weights streamed per decoding step (what bandwidth figures are based on).

        Counts parameters and the code/scale buffers of quantised layers; the
        embedding table is gathered (one row per token), not streamed, unless
        it doubles as the unquantised output head.
        """
        def size(t: Tensor) -> int:
            return t.numel() * t.element_size()

        n = sum(size(p) for p in self.parameters())
        n += sum(size(b) for name, b in self.named_buffers() if not name.startswith("rope_"))
        if self.pos_embed is not None:
            n -= size(self.pos_embed.weight)
        if self.lm_head is not None or self.head_q is not None:
            n -= size(self.embed.weight)
        if self.lm_head is not None and self.head_q is not None:
            n -= size(self.lm_head.weight)  # kept only as a float reference of the quantised head
        if self.subset_head is not None:  # the whole head is kept (shared, or as the reference) but not computed
            if self.head_q is not None:
                n -= sum(size(t) for t in [*self.head_q.parameters(), *self.head_q.buffers()])
            else:
                n -= size(self.head_weight)
        return n


ARCHS = ("llama", "gemma3", "gpt2")


def _rope_at(cos_table: Tensor, sin_table: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin rows of `positions` ([T] or [B, T]) shaped to broadcast over heads: [1 or B, 1, T, D]."""
    cos, sin = cos_table[positions].to(dtype), sin_table[positions].to(dtype)
    if cos.dim() == 2:  # [T, D] -> [1, 1, T, D]
        return cos[None, None], sin[None, None]
    return cos[:, None], sin[:, None]  # [B, T, D] -> [B, 1, T, D]


def init_random(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    """Deterministic random weights for tests and tiny demo models."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if model.config.arch == "gemma3" else 1.0)  # Gemma norms store (scale - 1)
            elif name.endswith(".bias") or name.endswith("norm.bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
