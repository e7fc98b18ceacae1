"""Gemma-3 (text) checkpoints: HF config translation and the GGUF reader.

The model itself is `stagedspec.models.transformer.Transformer` with
`arch="gemma3"`; this module only turns the two ways Gemma-3 ships (an HF
folder with `model_type` gemma3_text, or a llama.cpp GGUF with
`general.architecture` gemma3) into our `ModelConfig` and HF-layout tensors.

Facts the GGUF reader relies on (llama.cpp's converter and runtime):
- every `*norm.weight` is stored with Gemma's +1 already added (its RMSNorm
  multiplies by the weight, HF's by 1 + weight), so we subtract 1 again;
  checked against transformers' own GGUF reader and numerically on the real
  model (tests/test_gemma3_real.py);
- Q/K rows keep HF's order (llama.cpp runs Gemma with NeoX-style RoPE);
- the layer pattern is not stored: every 6th layer is global, the rest use
  the sliding window, and local layers use RoPE base 10000;
- the attention scale is 1/sqrt(head_dim), except for the 27B model
  (62 layers), which uses 1/sqrt(hidden / heads).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.models.config import ModelConfig
from stagedspec.models.gguf_checkpoint import (
    GGUFCheckpoint, gguf_layer_name, gguf_required, gguf_tensor_loader, gguf_value, tidy_float,
)
from stagedspec.models.hf_layout import req_int, rope_params
from stagedspec.models.sources import FunctionSource, compose
from stagedspec.tokenizer import first_id, id_list

_GELU_TANH = {"gelu_pytorch_tanh", "gelu_new"}
DEFAULT_PATTERN = 6  # transformers' and llama.cpp's default: layers 6, 12, ... are global
LOCAL_ROPE_THETA = 10_000.0
GLOBAL_ROPE_THETA = 1_000_000.0
_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def gemma3_config(c: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig for an HF Gemma3TextConfig dict, rejecting options our model does not compute."""
    hidden, n_heads = req_int(c, "hidden_size"), req_int(c, "num_attention_heads")
    layers = req_int(c, "num_hidden_layers")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise StagedSpecError(f"unsupported Gemma-3 activation {act!r} (supported: tanh-approximate GELU)")
    for key in ("attention_bias", "attn_logit_softcapping", "use_bidirectional_attention"):
        if c.get(key):
            raise StagedSpecError(f"unsupported Gemma-3 config: {key}={c[key]!r}")
    local = layer_pattern(c, layers)
    window = c.get("sliding_window")
    if any(local) and not (isinstance(window, int) and window > 0):
        raise StagedSpecError(f"Gemma-3 config has sliding-window layers but no valid 'sliding_window' (got {window!r})")
    global_theta, local_theta = _rope_bases(c)
    softcap = c.get("final_logit_softcapping")
    return ModelConfig(
        arch="gemma3",
        vocab_size=req_int(c, "vocab_size"),
        hidden_size=hidden,
        n_layers=layers,
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        intermediate_size=req_int(c, "intermediate_size"),
        max_position=int(c.get("max_position_embeddings") or 131_072),
        head_dim=int(c.get("head_dim") or hidden // n_heads),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=global_theta,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=first_id(c.get("bos_token_id", 2)),
        eos_token_ids=id_list(c.get("eos_token_id", 1)),
        sliding_window=int(window) if any(local) else None,
        local_layers=local,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or 256),
        final_logit_softcap=float(softcap) if softcap else None,
    )


def layer_pattern(c: Mapping[str, Any], layers: int) -> list[bool]:
    """Per layer, whether it is a sliding-window layer: from `layer_types`, else `sliding_window_pattern`."""
    types = c.get("layer_types")
    if types:
        unknown = sorted({t for t in types if t not in _LAYER_TYPES})
        if unknown or len(types) != layers:
            raise StagedSpecError(
                f"unsupported Gemma-3 layer_types {unknown or types!r} (need {layers} entries of "
                "'sliding_attention' / 'full_attention')"
            )
        return [_LAYER_TYPES[t] for t in types]
    pattern = int(c.get("sliding_window_pattern") or DEFAULT_PATTERN)
    return [bool((i + 1) % pattern) for i in range(layers)]


def _rope_bases(c: Mapping[str, Any]) -> tuple[float, float]:
    """(global, local) RoPE bases from transformers 5's per-layer-type `rope_parameters` or the legacy keys."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", GLOBAL_ROPE_THETA)
        sliding.setdefault("rope_theta", LOCAL_ROPE_THETA)
        return rope_params(c, full), rope_params(c, sliding)
    legacy = {k: v for k, v in c.items() if k != "rope_parameters"}
    legacy.setdefault("rope_theta", GLOBAL_ROPE_THETA)
    if params:  # transformers 5 with one shared entry
        legacy["rope_parameters"] = params
    return rope_params(legacy), float(c.get("rope_local_base_freq") or LOCAL_ROPE_THETA)


# ====================================================================== GGUF
# llama.cpp tensor names (per layer) -> HF names under model.layers.N.
PER_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_RENAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}


def gguf_gemma3(reader: Any) -> GGUFCheckpoint:
    """A Gemma-3 GGUF as an HF Gemma3ForCausalLM checkpoint: config dict + lazy HF-layout tensors."""
    key = lambda k: f"gemma3.{k}"  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise StagedSpecError("GGUF file is missing tensor token_embd.weight")
    n_heads = int(gguf_required(reader, key("attention.head_count")))
    hidden = int(gguf_required(reader, key("embedding_length")))
    n_layers = int(gguf_required(reader, key("block_count")))
    head_dim = int(gguf_value(reader, key("attention.key_length"), 256))
    if int(gguf_value(reader, key("attention.value_length"), head_dim)) != head_dim:
        raise StagedSpecError("unsupported GGUF: Gemma-3 with different key and value head sizes")
    scaling = gguf_value(reader, key("rope.scaling.type"), "none")
    if scaling not in ("none", None):
        raise StagedSpecError(f"unsupported GGUF RoPE scaling {scaling!r}")
    pattern = gguf_value(reader, key("attention.sliding_window_pattern"))
    if isinstance(pattern, list):  # a per-layer flag list in newer files
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        n = int(pattern or DEFAULT_PATTERN)
        layer_types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(n_layers)]
    # llama.cpp's attention scale for Gemma-3: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the 27B model.
    scalar = hidden // n_heads if n_layers == 62 else head_dim
    softcap = gguf_value(reader, key("final_logit_softcapping"))
    hf_config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(gguf_required(reader, key("feed_forward_length"))),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(gguf_value(reader, key("attention.head_count_kv"), n_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(gguf_value(reader, key("context_length"), 32768)),
        "rms_norm_eps": tidy_float(gguf_value(reader, key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": tidy_float(gguf_value(reader, key("rope.freq_base"), GLOBAL_ROPE_THETA)),
        "rope_local_base_freq": LOCAL_ROPE_THETA,
        "sliding_window": int(gguf_value(reader, key("attention.sliding_window"), 4096)),
        "layer_types": layer_types,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": tidy_float(softcap) if softcap else None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf_value(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    makers: dict[str, Callable[[], Tensor]] = {}
    for name, t in tensors.items():
        hf_name = _RENAMES.get(name) or gguf_layer_name(name, PER_LAYER)
        if hf_name is None:
            continue
        load = gguf_tensor_loader(t)
        if name.endswith("norm.weight"):
            load = compose(load, lambda w: w - 1.0)  # undo llama.cpp's folded +1 (see the module docstring)
        makers[hf_name] = load
    return GGUFCheckpoint(reader, hf_config, FunctionSource(makers), list(tensors))
