"""Model hyper-parameters, independent of where the weights come from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer.

    `arch` is "llama" (Llama / SmolLM2 / Qwen2 style: RMSNorm, RoPE, GQA,
    SwiGLU), "gpt2" (LayerNorm, learned positions, GELU MLP) or "gemma3"
    (the Llama layout plus Gemma-3's differences, each a field below so the
    model code reads them by name: RMSNorm with a (1 + weight) scale, norms
    after attention and MLP as well as before, RMSNorm on q and k, a
    GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), and sliding-window
    layers with their own RoPE base interleaved with global ones).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    max_position: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma-3 only (defaults mean "not used"):
    sliding_window: int | None = None  # keys at least this many positions back are hidden in local layers
    local_layers: list[bool] = field(default_factory=list)  # per layer: True = sliding-window (local) attention
    rope_local_theta: float = 10000.0  # RoPE base of the local layers
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default: head_dim)
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
