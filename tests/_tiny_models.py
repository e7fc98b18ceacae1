"""Tiny random checkpoints written on the fly, so loader tests need no download.

`save_tiny_hf` writes an HF folder with transformers' own `save_pretrained`
(so the file layout is exactly what transformers produces) plus a small
byte-level tokenizer.  `save_tiny_gguf` writes the same weights as a GGUF the
way llama.cpp's converter lays them out (Q/K rows reordered for llama).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB = 300  # 3 specials + 256 byte symbols + a few merges fit below this


def tiny_tokenizer() -> HFTokenizer:
    """Byte-level BPE: specials first (like SmolLM2), then the 256 byte symbols, then a few merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def hf_config(kind: str) -> Any:
    """transformers config for one of the tiny test architectures."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=0)
    llama = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128,
                 rms_norm_eps=1e-5, rope_theta=10000.0, **common)
    if kind == "llama_gqa":
        return tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **llama)
    if kind == "llama_untied":
        return tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, **llama)
    if kind == "qwen2":
        return tf.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **llama)
    if kind == "mistral":
        return tf.MistralConfig(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                                sliding_window=None, **llama)
    if kind in ("gemma3", "gemma3_softcap"):
        # Window 6 so a 16-token prompt crosses it; a global layer between two local ones; an attention
        # scale (query_pre_attn_scalar) that is not 1/sqrt(head_dim), and global/local RoPE bases that differ.
        return tf.Gemma3TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            final_logit_softcapping=30.0 if kind == "gemma3_softcap" else None, tie_word_embeddings=True,
            pad_token_id=0, **common,
        )
    if kind == "gemma3_6":
        # The layout a GGUF implies: every 6th layer global, attention scale 1/sqrt(head_dim), RoPE bases 1e6/1e4.
        return tf.Gemma3TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, sliding_window=5, query_pre_attn_scalar=16,
            tie_word_embeddings=True, pad_token_id=0, vocab_size=VOCAB, bos_token_id=2, eos_token_id=1,
        )
    if kind == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=None,
                             activation_function="gelu_new", **common)
    raise ValueError(kind)


KINDS = ["llama_gqa", "llama_untied", "qwen2", "mistral", "gpt2", "gemma3", "gemma3_softcap"]


def make_hf_model(kind: str, seed: int = 0) -> Any:
    """A random fp32 transformers model whose every parameter (biases and norms too) is non-trivial.

    transformers initialises biases to zero and norms to one; perturbing all
    parameters makes the equivalence tests sensitive to a swapped or dropped
    bias, norm or Q/K row order.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def save_tiny_hf(kind: str, folder: Path, seed: int = 0, **save_kwargs: Any) -> Any:
    """Write a tiny HF checkpoint + tokenizer into `folder`; returns the transformers model."""
    model = make_hf_model(kind, seed)
    model.save_pretrained(folder, **save_kwargs)
    write_tiny_tokenizer(folder)
    return model


def write_tiny_tokenizer(folder: Path) -> None:
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>", "bos_token": "<|im_start|>", "add_bos_token": False, "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------------- GGUF
def save_tiny_gguf(model: Any, path: Path, quantize_first_mlp: bool = False) -> None:
    """Write a transformers Llama/Qwen2/GPT-2 model as a GGUF laid out like llama.cpp's converter.

    With `quantize_first_mlp`, layer 0's MLP matrices are stored as Q8_0 to
    exercise dequantisation (the loaded model then differs slightly).
    """
    import gguf

    from stagedspec.models.gguf_read import permute_qk

    cfg = model.config
    arch = {"llama": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if arch == "gpt2":
        _gpt2_gguf_meta(w, cfg)
        tensors = _gpt2_gguf_tensors(state, cfg)
    else:
        _llama_gguf_meta(w, cfg, arch)
        tensors = _llama_gguf_tensors(state, cfg, arch, permute_qk)
    _tokenizer_gguf_meta(w)
    for name, arr in tensors.items():
        if quantize_first_mlp and name.startswith("blk.0.ffn_") and name.endswith(".weight"):
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_gguf_meta(w: Any, cfg: Any, arch: str) -> None:
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.hidden_size // cfg.num_attention_heads)


def _llama_gguf_tensors(state: dict, cfg: Any, arch: str, permute_qk: Any) -> dict[str, np.ndarray]:
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{kind}"
                if key not in state:
                    continue
                arr = state[key]
                if arch == "llama" and gg in ("attn_q", "attn_k"):
                    heads = cfg.num_attention_heads if gg == "attn_q" else cfg.num_key_value_heads
                    arr = permute_qk(torch.from_numpy(arr), heads).numpy()
                out[f"blk.{i}.{gg}.{kind}"] = arr
    return out


def _gpt2_gguf_meta(w: Any, cfg: Any) -> None:
    w.add_uint32("gpt2.block_count", cfg.n_layer)
    w.add_uint32("gpt2.context_length", cfg.n_positions)
    w.add_uint32("gpt2.embedding_length", cfg.n_embd)
    w.add_uint32("gpt2.feed_forward_length", 4 * cfg.n_embd)
    w.add_uint32("gpt2.attention.head_count", cfg.n_head)
    w.add_float32("gpt2.attention.layer_norm_epsilon", cfg.layer_norm_epsilon)


def _gpt2_gguf_tensors(state: dict, cfg: Any) -> dict[str, np.ndarray]:
    p = "transformer."
    out = {"token_embd.weight": state[p + "wte.weight"], "position_embd.weight": state[p + "wpe.weight"],
           "output_norm.weight": state[p + "ln_f.weight"], "output_norm.bias": state[p + "ln_f.bias"]}
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for i in range(cfg.n_layer):
        for hf, gg in names.items():
            wt = state[f"{p}h.{i}.{hf}.weight"]
            out[f"blk.{i}.{gg}.weight"] = wt.T if wt.ndim == 2 else wt  # Conv1D -> Linear layout
            out[f"blk.{i}.{gg}.bias"] = state[f"{p}h.{i}.{hf}.bias"]
    return out


def _tokenizer_gguf_meta(w: Any) -> None:
    tok = tiny_tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_string("tokenizer.chat_template", CHATML)


# ---------------------------------------------------------------------- Gemma-3 GGUF (llama.cpp layout)
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPM_PIECES = ["▁", "t", "h", "e", "▁t", "he", "▁the", "i", "n", "in", "▁▁", "a"]


def tiny_spm_tokens() -> tuple[list[str], list[int]]:
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, a few pieces, a run of two spaces."""
    tokens = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["  ", "\n\n"]
    types = [3] * len(SPM_SPECIALS) + [6] * 256 + [1] * len(SPM_PIECES) + [4, 4]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    types += [3] * (VOCAB - len(types))
    return tokens, types


def save_tiny_gemma3_gguf(model: Any, path: Path, quant_type: Any = None) -> None:
    """Write a transformers Gemma3ForCausalLM as llama.cpp does: norms with +1 folded in, Q/K rows unchanged.

    The layer pattern is not written (llama.cpp does not): the model must use the default of every
    6th layer global.  `quant_type`: store layer 0's MLP matrices as raw bytes of that GGML type.
    """
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    a = "gemma3."
    w.add_uint32(a + "block_count", cfg.num_hidden_layers)
    w.add_uint32(a + "context_length", cfg.max_position_embeddings)
    w.add_uint32(a + "embedding_length", cfg.hidden_size)
    w.add_uint32(a + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(a + "attention.head_count", cfg.num_attention_heads)
    w.add_uint32(a + "attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(a + "attention.key_length", cfg.head_dim)
    w.add_uint32(a + "attention.value_length", cfg.head_dim)
    w.add_float32(a + "rope.freq_base", cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(a + "attention.sliding_window", cfg.sliding_window)
    tokens, types = tiny_spm_tokens()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if t != 1 else -float(i) for i, t in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"] + 1}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            arr = state[f"model.layers.{i}.{hf}.weight"]
            out[f"blk.{i}.{gg}.weight"] = arr + 1 if gg.endswith("norm") else arr
    for name, arr in out.items():
        if quant_type is not None and name.startswith("blk.0.ffn_") and arr.ndim == 2:
            block, size = gguf.constants.GGML_QUANT_SIZES[quant_type]
            raw = np.zeros((arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=quant_type)  # byte shape: gguf derives the element shape
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
