"""Read a GGUF file as an HF checkpoint (`read_gguf`): Llama, Qwen2 and GPT-2 here, Gemma-3 in `gemma3`.

GGUF files are turned into HF-layout tensors by dequantising and by undoing
llama.cpp's reordering of the Q/K rows, so they load through the same
mapping as HF folders (`loading.convert_hf_state`).  Why not in `loading`:
converting a GGUF into a cached HF folder (`default`, `named`) reads it
here, and resolving a model spec into those folders (`specs`) comes before
loading; with the reader in the loader, each would import the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.models.gemma3 import gguf_gemma3
from stagedspec.models.gguf_checkpoint import (
    GGUFCheckpoint, gguf_layer_name, gguf_required, gguf_tensor_loader, gguf_value, open_gguf, raw_tensor,
    tidy_float,
)
from stagedspec.models.gguf_codes import RawTensor
from stagedspec.models.hf_layout import GPT2_CONV1D
from stagedspec.models.sources import FunctionSource, compose


def read_gguf(path: Path) -> GGUFCheckpoint:
    reader = open_gguf(path)
    arch = gguf_value(reader, "general.architecture")
    if arch in ("llama", "qwen2"):
        return _gguf_llama(reader, arch)
    if arch == "gpt2":
        return _gguf_gpt2(reader)
    if arch == "gemma3":
        return gguf_gemma3(reader)
    raise StagedSpecError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2, gemma3, gpt2)")


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) back to HF's rotate-half order.

    llama.cpp's converter reorders each head's rows from [first half | second
    half] to interleaved (x0, x_{D/2}, x1, x_{D/2+1}, ...), because its RoPE
    rotates adjacent pairs.  Our RoPE (like HF's) rotates halves, so the rows
    of each head are put back: view rows as [head, D/2, 2] and swap the last
    two axes.  Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's Q/K row order from HF's (inverse of `unpermute_qk`; used to write test GGUFs)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_llama(reader: Any, arch: str) -> GGUFCheckpoint:
    key = lambda k: f"{arch}.{k}"  # noqa: E731 - metadata keys are namespaced by arch
    tensors = {t.name: t for t in reader.tensors}
    n_heads = int(gguf_required(reader, key("attention.head_count")))
    n_kv = int(gguf_value(reader, key("attention.head_count_kv"), n_heads))
    hidden = int(gguf_required(reader, key("embedding_length")))
    head_dim = int(gguf_value(reader, key("attention.key_length"), hidden // n_heads))
    rope_dim = int(gguf_value(reader, key("rope.dimension_count"), head_dim))
    if rope_dim != head_dim:
        raise StagedSpecError(f"unsupported GGUF: RoPE on {rope_dim} of {head_dim} head dimensions")
    scaling = gguf_value(reader, key("rope.scaling.type"), "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensors:
        raise StagedSpecError(f"unsupported GGUF RoPE scaling {scaling!r}")
    if "token_embd.weight" not in tensors:
        raise StagedSpecError("GGUF file is missing tensor token_embd.weight")
    vocab = gguf_value(reader, key("vocab_size")) or int(tensors["token_embd.weight"].shape[-1])
    n_layers = int(gguf_required(reader, key("block_count")))
    hf_arch = "LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"
    hf_config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(gguf_required(reader, key("feed_forward_length"))),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(gguf_value(reader, key("context_length"), 4096)),
        "rms_norm_eps": tidy_float(gguf_value(reader, key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": tidy_float(gguf_value(reader, key("rope.freq_base"), 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    renames = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    makers: dict[str, Callable[[], Tensor]] = {}
    raws: dict[str, RawTensor] = {}
    for name, t in tensors.items():
        hf_name = renames.get(name) or gguf_layer_name(name, per_layer)
        if hf_name is None:
            continue
        load = gguf_tensor_loader(t)
        raw = raw_tensor(t)
        # Only the llama converter reorders Q/K rows; qwen2 files keep HF order.
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = n_heads if ".attn_q." in name else n_kv
            load = compose(load, lambda w, h=heads: unpermute_qk(w, h))
            raw = raw and raw.rows_permuted(unpermute_qk(torch.arange(raw.blocks.shape[0]), heads))
        makers[hf_name] = load
        if raw is not None:
            raws[hf_name] = raw
    return GGUFCheckpoint(reader, hf_config, FunctionSource(makers), list(tensors), raws)


def _gguf_gpt2(reader: Any) -> GGUFCheckpoint:
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(gguf_required(reader, "gpt2.embedding_length"))
    if "token_embd.weight" not in tensors:
        raise StagedSpecError("GGUF file is missing tensor token_embd.weight")
    hf_config: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "n_embd": hidden,
        "n_layer": int(gguf_required(reader, "gpt2.block_count")),
        "n_head": int(gguf_required(reader, "gpt2.attention.head_count")),
        "n_inner": int(gguf_value(reader, "gpt2.feed_forward_length", 4 * hidden)),
        "n_positions": int(gguf_value(reader, "gpt2.context_length", 1024)),
        "layer_norm_epsilon": tidy_float(gguf_value(reader, "gpt2.attention.layer_norm_epsilon", 1e-5)),
        "activation_function": "gelu_new",
        # llama.cpp writes the embedding again as `output`; an identical copy is a tied head.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_value(reader, "tokenizer.ggml.eos_token_id"),
    }
    renames = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
               "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
               "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                 "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
    makers: dict[str, Callable[[], Tensor]] = {}
    for name, t in tensors.items():
        hf_name = renames.get(name) or gguf_layer_name(name, per_layer, layer_prefix="transformer.h.")
        if hf_name is None:
            continue
        load = gguf_tensor_loader(t)
        if hf_name.endswith(GPT2_CONV1D):  # GGUF stores Linear layout; HF GPT-2 uses Conv1D [in, out]
            load = compose(load, lambda w: w.t().contiguous())
        makers[hf_name] = load
    return GGUFCheckpoint(reader, hf_config, FunctionSource(makers), list(tensors))


def gguf_to_hf_state(ckpt: GGUFCheckpoint, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Materialise HF-layout fp32 tensors from a GGUF checkpoint (used to write the cached HF folder)."""
    wanted = sorted(ckpt.source.names()) if names is None else list(names)
    return {n: ckpt.source.get(n) for n in wanted}
