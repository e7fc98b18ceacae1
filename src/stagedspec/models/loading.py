"""Load checkpoints (HF folders, GGUF files, the embedded default) into our `Transformer`.

Every source is first seen as *HF-layout tensors*: a name -> tensor lookup
(`sources`) using transformers' parameter names and layouts (separate q/k/v,
rotate-half RoPE rows, Conv1D [in, out] for GPT-2).  One mapping
(`convert_hf_state`) then renames, fuses (q|k|v, gate|up) and casts them into
our parameter names, so HF folders and GGUF files share a single, tested
path.  The steps before it live below this module, so that none of them
imports the loader: a spec becomes files in `specs`, a GGUF becomes
HF-layout tensors in `gguf_read` (Gemma-3's in `gemma3`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError, first_line
from stagedspec.kernels.huge_pages import move_to_huge_pages
from stagedspec.models.config import ModelConfig
from stagedspec.models.gemma3 import gemma3_config
from stagedspec.models.gguf_checkpoint import GGUFCheckpoint
from stagedspec.models.gguf_codes import KEPT_TYPES, RawTensor
from stagedspec.models.gguf_read import read_gguf
from stagedspec.models.hf_layout import GPT2_CONV1D, req_int, rope_params
from stagedspec.models.matmul_plan import plan_matmuls
from stagedspec.models.quant import check_quant, quantize_model, resolve_kernels, resolve_quant
from stagedspec.models.sources import DictSource, SafetensorsSource, TensorSource
from stagedspec.models.specs import resolve_model_path
from stagedspec.models.transformer import Transformer, rope_tables
from stagedspec.pass_options import PassOptions, PassRuntime
from stagedspec.tokenizer import Tokenizer, first_id, id_list

# HF `architectures` entries we can run, by family (all three run as our "llama" arch).
LLAMA_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
GPT2_FAMILY = {"GPT2LMHeadModel": "gpt2"}
GEMMA3_FAMILY = {"Gemma3ForCausalLM": "gemma3_text"}
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "gpt2": "GPT2LMHeadModel", "gemma3_text": "Gemma3ForCausalLM"}
_GELU_TANH = {"gelu_new", "gelu_pytorch_tanh"}


# ====================================================================== public API
def load_model(
    spec: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", quant: str = "none",
    plan_kernels: bool = True, kernels: str = "auto", pass_options: PassOptions | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer from `"default"`, a named model (`gemma3-270m`), an HF folder or a `.gguf`.

    The model comes back in eval mode with gradients off, weights in `dtype`
    (the RoPE tables stay fp32, as in transformers).  `quant` ("int4",
    "int8", "mixed") loads fp32 weights and quantises the layers and the
    output head (see `stagedspec.models.quant`), on the CPU, with `kernels`
    ("auto": the native ones where they build; "native"; "torch").
    fp32 weights on the CPU get this machine's faster matmul kernel per row
    count (`stagedspec.models.matmul_plan`; `plan_kernels=False`: plain
    `F.linear`, for a model that is trained rather than decoded with).
    `pass_options`: how its passes run (`stagedspec.runner`; None: the
    environment's defaults, `PassOptions.from_environment`).
    """
    quant = resolve_quant(quant, spec, device)  # "auto": "mixed" for a quantised source on a CPU, else "none"
    check_quant(quant, dtype, device)
    path = resolve_model_path(spec)
    load_dtype = dtype if quant == "none" else torch.float32
    if path.is_dir():
        model, tok = load_hf_folder(path, load_dtype, device)
        sources: dict[str, list[RawTensor]] = {}
    else:
        keep_codes = quant == "mixed" and resolve_kernels(kernels) is not None
        model, tok, sources = load_gguf_with_sources(path, load_dtype, device, keep_codes=keep_codes)
    if quant != "none":
        quantize_model(model, quant, dtype, kernels, sources)
        check_no_deferred(model)
        if str(device).startswith("cpu"):
            move_to_huge_pages(model)  # the packed weights every pass streams, on 2 MB pages where Linux gives them
    elif plan_kernels:
        plan_matmuls(model)  # fp32 on the CPU: each layer's faster kernel per row count, timed here once
    if pass_options is not None:
        model.runtime.passes = PassRuntime(pass_options)
    return model, tok


def load_hf_folder(folder: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    """HF-format folder: config.json + model.safetensors (or a sharded index) + tokenizer.json."""
    hf_config = read_hf_config(folder)
    cfg = config_from_hf(hf_config)
    source = SafetensorsSource.from_folder(folder)
    model = build_model(cfg, convert_hf_state(cfg, source, dtype), device)
    return model, Tokenizer.from_folder(folder)


def load_gguf(path: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    """A GGUF file: weights are dequantised to fp32 and then cast to `dtype`."""
    model, tok, _ = load_gguf_with_sources(path, dtype, device)
    return model, tok


def load_gguf_with_sources(path: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                           keep_codes: bool = False) -> tuple[Transformer, Tokenizer, dict[str, list[RawTensor]]]:
    """`load_gguf`, plus each linear layer's stored blocks (`gguf_sources`) for quantisation in the file's formats.

    `keep_codes`: the caller will run every layer whose parts are all in a kept format (Q4_K, Q6_K, Q5_0) on
    those parts' own codes (`quant.from_source`), so those layers' weights are never dequantised: they are
    left on the meta device, shaped, for `quantize_model` to replace.  Why: dequantising Qwen2.5-Coder-1.5B's
    196 layer tensors to fp32 took 15 of the 21 s of loading it and about 6 GB of memory, all thrown away.
    """
    ckpt = read_gguf(path)
    cfg = config_from_hf(ckpt.hf_config)
    sources = gguf_sources(ckpt, cfg)
    deferred = {f"{name}.weight": (sum(r.blocks.shape[0] for r in raws), raws[0].cols)
                for name, raws in sources.items()
                if keep_codes and name != "head" and all(r.kind in KEPT_TYPES for r in raws)}
    model = build_model(cfg, convert_hf_state(cfg, ckpt.source, dtype, deferred), device, set(deferred))
    return model, Tokenizer.from_gguf(ckpt.reader), sources


def check_no_deferred(model: Transformer) -> None:
    """Fail loudly if a weight `load_gguf_with_sources` deferred was not replaced by its layer's own codes."""
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"weights left undequantised and unreplaced: {left[:3]}")


def load_model_from_state(
    hf_config: Mapping[str, Any],
    hf_state: Mapping[str, Tensor],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Transformer:
    """Build our model from an in-memory HF config dict and HF state dict (e.g. `hf_model.state_dict()`).

    Tensors that need no renaming, fusing or casting are adopted as they are,
    so the result may share memory with `hf_state`.
    """
    cfg = config_from_hf(hf_config)
    return build_model(cfg, convert_hf_state(cfg, DictSource(dict(hf_state)), dtype), device)


# ====================================================================== config
def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        hint = "; to load a GGUF, pass the .gguf file itself" if any(folder.glob("*.gguf")) else ""
        raise StagedSpecError(f"no config.json in {folder} (not an HF model folder{hint})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StagedSpecError(f"cannot read {path}: {first_line(exc)}") from None
    if not isinstance(data, dict):
        raise StagedSpecError(f"{path} is not a JSON object")
    return data


def hf_architecture(hf_config: Mapping[str, Any]) -> str:
    """The single supported `architectures` entry of a config, or an error naming what was found."""
    archs = list(hf_config.get("architectures") or [])
    if not archs and hf_config.get("model_type") in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[hf_config["model_type"]]]  # configs built in code often lack `architectures`
    for name in archs:
        if name in LLAMA_FAMILY or name in GPT2_FAMILY or name in GEMMA3_FAMILY:
            return name
    if "Gemma3ForConditionalGeneration" in archs or hf_config.get("model_type") == "gemma3":
        raise StagedSpecError(
            "unsupported model architecture Gemma3ForConditionalGeneration (the multimodal Gemma-3; "
            "stagedspec runs the text-only Gemma3ForCausalLM checkpoints, e.g. gemma-3-270m or a GGUF)"
        )
    found = ", ".join(archs) if archs else f"model_type={hf_config.get('model_type')!r}"
    supported = ", ".join([*LLAMA_FAMILY, *GEMMA3_FAMILY, *GPT2_FAMILY])
    raise StagedSpecError(f"unsupported model architecture {found} (supported: {supported})")


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """Translate an HF config dict into our ModelConfig, rejecting features our model lacks.

    Rejecting (rather than ignoring) RoPE scaling, biased output projections
    or exact-erf GELU matters: the model would load but silently compute a
    different function than the reference.
    """
    arch = hf_architecture(hf_config)
    if arch in GPT2_FAMILY:
        return _gpt2_config(hf_config)
    if arch in GEMMA3_FAMILY:
        return gemma3_config(hf_config)
    return _llama_config(hf_config, LLAMA_FAMILY[arch])


def _llama_config(c: Mapping[str, Any], family: str) -> ModelConfig:
    hidden, n_heads = req_int(c, "hidden_size"), req_int(c, "num_attention_heads")
    vocab, layers, inter = req_int(c, "vocab_size"), req_int(c, "num_hidden_layers"), req_int(c, "intermediate_size")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise StagedSpecError(f"unsupported activation {act!r} (Llama-family models must use 'silu')")
    if c.get("mlp_bias"):
        raise StagedSpecError("unsupported config: mlp_bias=true")
    if family != "qwen2" and c.get("attention_bias"):
        raise StagedSpecError("unsupported config: attention_bias=true (biased output projection)")
    rope = rope_params(c)
    max_pos = int(c.get("max_position_embeddings") or 4096)
    # A sliding window changes nothing while the context fits inside it, so
    # the honest translation is to cap the context there.
    window = c.get("sliding_window")
    uses_window = family == "mistral" or (family == "qwen2" and c.get("use_sliding_window"))
    if uses_window and window:
        max_pos = min(max_pos, int(window))
    return ModelConfig(
        arch="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=layers,
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        intermediate_size=inter,
        max_position=max_pos,
        head_dim=int(c.get("head_dim") or hidden // n_heads),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope,
        qkv_bias=family == "qwen2",
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=first_id(c.get("bos_token_id")),
        eos_token_ids=id_list(c.get("eos_token_id")),
    )


def _gpt2_config(c: Mapping[str, Any]) -> ModelConfig:
    hidden, n_heads = req_int(c, "n_embd"), req_int(c, "n_head")
    vocab, layers = req_int(c, "vocab_size"), req_int(c, "n_layer")
    act = c.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise StagedSpecError(f"unsupported GPT-2 activation {act!r} (supported: tanh-approximate GELU)")
    if c.get("scale_attn_by_inverse_layer_idx") or c.get("scale_attn_weights") is False:
        raise StagedSpecError("unsupported GPT-2 attention scaling options")
    return ModelConfig(
        arch="gpt2",
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        intermediate_size=int(c.get("n_inner") or 4 * hidden),
        max_position=int(c.get("n_positions") or 1024),
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=first_id(c.get("bos_token_id")),
        eos_token_ids=id_list(c.get("eos_token_id")),
    )


# ====================================================================== HF -> ours
def hf_to_ours_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """For each of our parameter names, the HF tensor names concatenated (along rows) to form it.

    The HF names carry no `model.`/`transformer.` prefix here; `_resolve_prefix`
    finds whichever prefix the checkpoint uses.
    """
    out: dict[str, list[str]] = {}
    if cfg.arch in ("llama", "gemma3"):
        gemma = cfg.arch == "gemma3"
        out["embed.weight"] = ["embed_tokens.weight"]
        for i in range(cfg.n_layers):
            ly = f"layers.{i}."  # the same prefix on both sides
            out[ly + "attn_norm.weight"] = [ly + "input_layernorm.weight"]
            if gemma:  # HF's `post_attention_layernorm` is Llama's pre-MLP norm but Gemma's post-attention one
                out[ly + "attn.q_norm.weight"] = [ly + "self_attn.q_norm.weight"]
                out[ly + "attn.k_norm.weight"] = [ly + "self_attn.k_norm.weight"]
                out[ly + "post_attn_norm.weight"] = [ly + "post_attention_layernorm.weight"]
                out[ly + "mlp_norm.weight"] = [ly + "pre_feedforward_layernorm.weight"]
                out[ly + "post_mlp_norm.weight"] = [ly + "post_feedforward_layernorm.weight"]
            else:
                out[ly + "mlp_norm.weight"] = [ly + "post_attention_layernorm.weight"]
            out[ly + "attn.wqkv.weight"] = [ly + f"self_attn.{p}_proj.weight" for p in "qkv"]
            if cfg.qkv_bias:
                out[ly + "attn.wqkv.bias"] = [ly + f"self_attn.{p}_proj.bias" for p in "qkv"]
            out[ly + "attn.wo.weight"] = [ly + "self_attn.o_proj.weight"]
            out[ly + "mlp.w_up.weight"] = [ly + "mlp.gate_proj.weight", ly + "mlp.up_proj.weight"]
            out[ly + "mlp.w_down.weight"] = [ly + "mlp.down_proj.weight"]
        out["norm.weight"] = ["norm.weight"]
    else:
        out["embed.weight"] = ["wte.weight"]
        out["pos_embed.weight"] = ["wpe.weight"]
        pairs = [("attn_norm", "ln_1"), ("attn.wqkv", "attn.c_attn"), ("attn.wo", "attn.c_proj"),
                 ("mlp_norm", "ln_2"), ("mlp.w_up", "mlp.c_fc"), ("mlp.w_down", "mlp.c_proj")]
        for i in range(cfg.n_layers):
            for ours, theirs in pairs:
                for kind in ("weight", "bias"):
                    out[f"layers.{i}.{ours}.{kind}"] = [f"h.{i}.{theirs}.{kind}"]
        out["norm.weight"], out["norm.bias"] = ["ln_f.weight"], ["ln_f.bias"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ["lm_head.weight"]
    return out


def convert_hf_state(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype,
                     deferred: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Tensor]:
    """Our state dict from HF-layout tensors: renamed, fused, GPT-2 Conv1D transposed, cast to `dtype`.

    `deferred`: our names whose tensors are not read, given as meta tensors of the shapes named (see
    `load_gguf_with_sources`).
    """
    deferred = deferred or {}
    names = hf_to_ours_names(cfg)
    available = source.names()
    prefix = _resolve_prefix(cfg, available)
    wanted = [n for parts in names.values() for n in parts]
    missing = [_hf_key(n, prefix) for n in wanted if _hf_key(n, prefix) not in available]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise StagedSpecError(f"checkpoint is missing tensors: {', '.join(missing[:3])}{more}")
    state: dict[str, Tensor] = {}
    for ours, parts in names.items():
        if ours in deferred:
            state[ours] = torch.empty(deferred[ours], dtype=dtype, device="meta")
            continue
        tensors = []
        for part in parts:
            t = source.get(_hf_key(part, prefix))
            if cfg.arch == "gpt2" and part.endswith(GPT2_CONV1D):
                t = t.t()  # Conv1D stores [in, out]; nn.Linear wants [out, in]
            tensors.append(t.to(dtype))
        state[ours] = tensors[0].contiguous() if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return state


def _resolve_prefix(cfg: ModelConfig, available: set[str]) -> str:
    """The prefix the checkpoint puts before module names (`model.`, `transformer.` or none)."""
    probe = "wte.weight" if cfg.arch == "gpt2" else "embed_tokens.weight"
    for prefix in ("model.", "transformer.", ""):
        if prefix + probe in available:
            return prefix
    raise StagedSpecError(f"checkpoint is missing tensors: {probe} (no embedding table found)")


def _hf_key(name: str, prefix: str) -> str:
    return name if name == "lm_head.weight" else prefix + name


def build_model(cfg: ModelConfig, state: dict[str, Tensor], device: str = "cpu",
                deferred: set[str] | None = None) -> Transformer:
    """Instantiate on the meta device (no random init, no memory), then adopt the given tensors.

    Skipping the random initialisation saves seconds on real models and
    never holds two copies of the weights; the RoPE tables are
    non-persistent buffers, so they are recomputed here.  `deferred`: names
    left on the meta device on purpose, for the quantiser to replace.
    """
    deferred = deferred or set()
    model = Transformer.skeleton(cfg)
    expected = set(model.state_dict())
    if set(state) != expected:
        missing = sorted(expected - set(state))
        raise StagedSpecError(f"checkpoint is missing tensors: {', '.join(missing[:3])}")
    for name, tensor in state.items():
        want = tuple(model.get_parameter(name).shape)
        if tuple(tensor.shape) != want:
            raise StagedSpecError(
                f"tensor {name} has shape {tuple(tensor.shape)}, but the config implies {want}"
            )
    model.load_state_dict({k: v if k in deferred else v.to(device) for k, v in state.items()}, strict=True, assign=True)
    if cfg.arch != "gpt2":
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    if hasattr(model, "rope_local_cos"):
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_local_theta)
        model.rope_local_cos, model.rope_local_sin = cos.to(device), sin.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and n not in deferred]
    if left:  # a new buffer in Transformer that this loader does not know how to fill
        raise RuntimeError(f"build_model left tensors uninitialised: {left}")
    model.eval().requires_grad_(False)
    return model


# ====================================================================== GGUF
def gguf_sources(ckpt: GGUFCheckpoint, cfg: ModelConfig) -> dict[str, list[RawTensor]]:
    """Our linear layers' names ("layers.0.attn.wqkv", "head") -> the stored GGUF parts stacked along their rows.

    `stagedspec.models.quant` keeps K-quant parts in their own formats from these.  Layers whose parts are
    not all known (an unusual file) are left out and are quantised from their fp32 values as before.
    """
    if not ckpt.raw:
        return {}
    prefix = _resolve_prefix(cfg, ckpt.source.names())
    out: dict[str, list[RawTensor]] = {}
    for ours, parts in hf_to_ours_names(cfg).items():
        if not ours.endswith(".weight") or not ours.startswith("layers."):
            continue
        raws = [ckpt.raw.get(_hf_key(part, prefix)) for part in parts]
        if all(r is not None for r in raws):
            out[ours[: -len(".weight")]] = raws  # type: ignore[assignment]
    head = ckpt.raw.get("lm_head.weight") if not cfg.tie_embeddings else ckpt.raw.get(_hf_key("embed_tokens.weight", prefix))
    if head is not None:
        out["head"] = [head]
    return out


