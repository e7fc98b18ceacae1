"""One decoder-only transformer covering the Llama family and GPT-2.

Written for small-batch decoding speed (few, fused matmuls: one QKV and one
gate/up projection per layer) and for speculation: every forward pass takes
explicit positions and an optional tree mask, and writes its keys/values into
a `KVCache` as *pending* entries the caller later keeps or drops.

Parameter names are our own; `stagedspec.models.loading` maps HF and GGUF
checkpoints onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stagedspec.cache import KVCache
from stagedspec.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 like the reference implementation, so bf16 and
        # fp32 runs differ only by the storage precision of activations.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_position, head_dim] in the rotate-half layout used by HF checkpoints."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, D] by the angles of its positions (cos/sin broadcast as [B or 1, 1, T, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias or cfg.arch == "gpt2")
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.arch == "gpt2")
        self.use_rope = cfg.arch == "llama"

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        k_cache: Tensor,
        v_cache: Tensor,
        start: int,
        mask: Tensor | None,
        row_independent: bool = False,
    ) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # [B, heads, T, D]
        qk, v = qkv.split([H + Hkv, Hkv], dim=1)
        if self.use_rope and rope is not None:
            cos, sin = rope
            qk = apply_rope(qk, cos, sin).to(x.dtype)  # q and k rotated in one go: fewer small ops
        q, k = qk.split([H, Hkv], dim=1)
        end = start + T
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        width = end if mask is None else mask.shape[-1]  # a fixed key width: see Transformer.forward
        keys, values = k_cache[:, :, :width], v_cache[:, :, :width]
        G = H // Hkv
        if row_independent and mask is not None:
            out = _attend_row_by_row(q, keys, values, mask, G)
        else:
            # Grouped-query attention without copying the cache: the G query heads
            # that share a KV head are folded into the query-length axis (the mask
            # comes folded the same way, see `Transformer._attention_bias`).
            out = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, D), keys, values, attn_mask=mask)
        return self.wo(out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D))


def _attend_row_by_row(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, G: int) -> Tensor:
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
                rows[b:b + 1, :, :, t], keys[b:b + 1], values[b:b + 1], attn_mask=masks[b:b + 1, :, t:t + 1]
            )[0]
    return out.reshape(B, H, T, D)


class MLP(nn.Module):
    """SwiGLU for Llama (fused gate/up), GELU for GPT-2."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.arch == "llama"
        bias = cfg.arch == "gpt2"
        up_out = 2 * cfg.intermediate_size if self.gated else cfg.intermediate_size
        self.w_up = nn.Linear(cfg.hidden_size, up_out, bias=bias)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.w_up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.w_down(F.silu(gate) * up)
        return self.w_down(F.gelu(h, approximate="tanh"))


def _norm(cfg: ModelConfig) -> nn.Module:
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

    def forward(self, x, rope, k_cache, v_cache, start, mask, row_independent=False):  # noqa: ANN001 - hot path
        x = x + self.attn(self.attn_norm(x), rope, k_cache, v_cache, start, mask, row_independent)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM.  `forward` is the only entry point; see its docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch not in ("llama", "gpt2"):
            raise ValueError(f"unsupported architecture {cfg.arch!r}")
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_position, cfg.hidden_size) if cfg.arch == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A quantised copy of the output head (set by `models.quant.quantize_model`); None: `head_weight` is used.
        self.head_q: nn.Module | None = None
        if cfg.arch == "llama":
            cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def quantised(self) -> bool:
        """Whether `models.quant.quantize_model` made this model's layers and head quantised."""
        return self.head_q is not None

    @property
    def head_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        cfg = self.config
        p = self.embed.weight
        return KVCache(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_len or cfg.max_position,
            batch=batch, dtype=p.dtype, device=p.device,
        )

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        tree_mask: Tensor | None = None,
        logits_rows: Tensor | slice | None = None,
        return_hidden: bool = False,
        key_width: int | None = None,
        row_independent: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run `tokens` [B, T] at `positions` [T] (or [B, T]) on top of the committed cache.

        - Attention: every new token sees the whole committed prefix; among the
          new tokens it sees those allowed by `tree_mask` [T, T] (bool,
          True = may attend; must include the diagonal), or the causal
          pattern when `tree_mask` is None.  A `tree_mask` of shape
          [T, cached + T] is used as the complete mask (a drafter growing a
          tree over several passes hides its earlier branches this way); one
          of shape [B, 1, T, cached + T] is a complete mask per sequence
          (batched generation of left-padded prompts).
        - The new keys/values become the cache's pending entries; the caller
          must `cache.commit(...)` the ones to keep.
        - Returns logits [B, T', V] for the rows selected by `logits_rows`
          (all rows by default; a prefill passes `slice(-1, None)` to skip
          the vocabulary head for the prompt).  With `return_hidden`, also
          the final normalised hidden states of those rows.
        - `key_width`: attend over exactly this many cache slots (the ones
          past the new tokens masked out) instead of the filled ones.  CPU
          attention kernels round differently for different key counts (and
          for different query counts), so a fixed width removes one way a
          row's result depends on the pass it is in (`ModelOracle` uses the
          cache size; `row_independent` removes the other).
        - `row_independent`: run attention one query token at a time
          (`_attend_row_by_row`), so a row's numbers do not depend on how many
          rows share the pass either; `ModelOracle(bit_exact=True)` uses it.
        """
        B, T = tokens.shape
        start = cache.reserve(T)
        x = self.embed(tokens)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            cos = self.rope_cos[positions].to(x.dtype)
            sin = self.rope_sin[positions].to(x.dtype)
            if cos.dim() == 2:  # [T, D] -> [1, 1, T, D]
                cos, sin = cos[None, None], sin[None, None]
            else:  # [B, T, D] -> [B, 1, T, D]
                cos, sin = cos[:, None], sin[:, None]
            rope = (cos, sin)
        mask = self._attention_mask(T, start, tree_mask, x.device)
        if key_width is not None:
            mask = self._widen(mask, T, start, key_width, x.device)
        if mask is not None:
            groups = 1 if row_independent else self.config.n_heads // self.config.n_kv_heads
            mask = self._attention_bias(mask, x.dtype, groups)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache.k[i], cache.v[i], start, mask, row_independent)
        if logits_rows is not None:
            x = x[:, logits_rows]
        h = self.norm(x)
        logits = F.linear(h, self.head_weight) if self.head_q is None else self.head_q(h)
        return (logits, h) if return_hidden else logits

    @staticmethod
    def _attention_mask(T: int, start: int, tree_mask: Tensor | None, device: torch.device) -> Tensor | None:
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
    def _attention_bias(mask: Tensor, dtype: torch.dtype, groups: int) -> Tensor:
        """The bool mask as SDPA's additive bias (0 / -inf), with each query row repeated for the
        `groups` query heads folded into it; made once per forward instead of once per layer."""
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        if groups == 1:
            return bias
        # [T, S] for one shared mask, [B, 1, T, S] for one mask per sequence
        return bias.repeat(groups, 1) if bias.dim() == 2 else bias.repeat(1, 1, groups, 1)

    @staticmethod
    def _widen(mask: Tensor | None, T: int, start: int, width: int, device: torch.device) -> Tensor:
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
        return n


def init_random(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    """Deterministic random weights for tests and tiny demo models."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias") or name.endswith("norm.bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
