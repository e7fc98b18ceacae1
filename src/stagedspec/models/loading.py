"""Load checkpoints (HF folders, GGUF files, the embedded default) into our `Transformer`.

Every source is first seen as *HF-layout tensors*: a name -> tensor lookup
using transformers' parameter names and layouts (separate q/k/v, rotate-half
RoPE rows, Conv1D [in, out] for GPT-2).  One mapping (`convert_hf_state`)
then renames, fuses (q|k|v, gate|up) and casts them into our parameter names,
so HF folders and GGUF files share a single, tested path.  GGUF files are
turned into HF-layout tensors by dequantising and by undoing llama.cpp's
reordering of the Q/K rows.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from stagedspec.errors import StagedSpecError, first_line
from stagedspec.models.config import ModelConfig
from stagedspec.models.gguf_codes import RawTensor
from stagedspec.models.quant import check_quant, quantize_model
from stagedspec.models.transformer import Transformer, rope_tables
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
    plan_kernels: bool = True, kernels: str = "auto",
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
    """
    from stagedspec.models.quant import resolve_quant

    quant = resolve_quant(quant, spec, device)  # "auto": "mixed" for a quantised source on a CPU, else "none"
    check_quant(quant, dtype, device)
    path = resolve_model_path(spec)
    load_dtype = dtype if quant == "none" else torch.float32
    if path.is_dir():
        model, tok = load_hf_folder(path, load_dtype, device)
        sources: dict[str, list[RawTensor]] = {}
    else:
        model, tok, sources = load_gguf_with_sources(path, load_dtype, device)
    if quant != "none":
        quantize_model(model, quant, dtype, kernels, sources)
    elif plan_kernels:
        from stagedspec.models.matmul_plan import plan_matmuls

        plan_matmuls(model)  # fp32 on the CPU: each layer's faster kernel per row count, timed here once
    return model, tok


def resolve_model_path(spec: str | Path) -> Path:
    """Turn a user's model spec into an existing folder or .gguf file, or say what is wrong."""
    if str(spec) == "default":
        from stagedspec.models.default import default_model_dir

        return default_model_dir()
    from stagedspec.models.named import NAMED, named_model_dir

    if str(spec) in NAMED:
        return named_model_dir(str(spec))
    path = Path(spec).expanduser()
    if not path.exists():
        raise StagedSpecError(f"model path does not exist: {path}")
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        return path
    raise StagedSpecError(f"not a model folder or .gguf file: {path}")


def hf_folder_for(spec: str | Path) -> Path:
    """An HF-format folder transformers can load for `spec` (a GGUF is converted once into the cache).

    Used by reference tests and benchmarks that compare against transformers.
    """
    path = resolve_model_path(spec)
    if path.is_dir():
        return path
    from stagedspec.models.default import ensure_hf_folder, gguf_cache_dir

    return ensure_hf_folder(path, gguf_cache_dir(path))


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


def load_gguf_with_sources(path: Path, dtype: torch.dtype = torch.bfloat16,
                           device: str = "cpu") -> tuple[Transformer, Tokenizer, dict[str, list[RawTensor]]]:
    """`load_gguf`, plus each linear layer's stored blocks (`gguf_sources`) for quantisation in the file's formats."""
    ckpt = read_gguf(path)
    cfg = config_from_hf(ckpt.hf_config)
    model = build_model(cfg, convert_hf_state(cfg, ckpt.source, dtype), device)
    return model, Tokenizer.from_gguf(ckpt.reader), gguf_sources(ckpt, cfg)


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
        from stagedspec.models.gemma3 import gemma3_config

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


def req_int(c: Mapping[str, Any], key: str) -> int:
    """A required positive integer from the config, or an error naming the key."""
    value = c.get(key)
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        n = 0
    if n <= 0 or isinstance(value, bool):
        raise StagedSpecError(f"model config has no valid {key!r} (got {value!r})")
    return n


def rope_params(c: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> float:
    """RoPE base, from the legacy `rope_theta`/`rope_scaling` keys or transformers 5's `rope_parameters`.

    `params`: one layer type's entry of a per-layer-type `rope_parameters` (Gemma-3).
    """
    params = c.get("rope_parameters") or {} if params is None else params
    scaling = c.get("rope_scaling") or {}
    for p in (params, scaling):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ("default", None):
            raise StagedSpecError(f"unsupported RoPE scaling type {kind!r}")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise StagedSpecError("unsupported config: partial rotary embeddings")
    return float(params.get("rope_theta") or c.get("rope_theta") or 10000.0)


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


# ====================================================================== tensor sources
class TensorSource:
    """Lazy name -> tensor lookup, so a checkpoint is never held twice in memory."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str) -> Tensor:
        raise NotImplementedError


@dataclass
class DictSource(TensorSource):
    tensors: dict[str, Tensor]

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> Tensor:
        return self.tensors[name]


class SafetensorsSource(TensorSource):
    """One or more .safetensors files, opened lazily (memory-mapped by safetensors)."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        self._handles = []
        for f in files:
            if not f.is_file():
                raise StagedSpecError(f"missing weights file {f}")
            try:
                handle = safe_open(str(f), framework="pt")
                keys = list(handle.keys())
            except Exception as exc:
                raise StagedSpecError(
                    f"cannot read {f}: not a valid safetensors file, corrupt or truncated ({first_line(exc)})"
                ) from None
            self._handles.append(handle)
            self._where.update({k: (handle, f) for k in keys})

    @classmethod
    def from_folder(cls, folder: Path) -> "SafetensorsSource":
        single = folder / "model.safetensors"
        index = folder / "model.safetensors.index.json"
        if single.is_file():
            return cls([single])
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise StagedSpecError(f"cannot read {index}: {first_line(exc)}") from None
            return cls([folder / name for name in sorted(set(weight_map.values()))])
        raise StagedSpecError(f"no model.safetensors or model.safetensors.index.json in {folder}")

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> Tensor:
        handle, f = self._where[name]
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise StagedSpecError(f"cannot read tensor {name!r} from {f}: {first_line(exc)}") from None


class FunctionSource(TensorSource):
    """Tensors produced on demand by callables (used for GGUF dequantisation)."""

    def __init__(self, makers: dict[str, Callable[[], Tensor]]) -> None:
        self._makers = makers

    def names(self) -> set[str]:
        return set(self._makers)

    def get(self, name: str) -> Tensor:
        return self._makers[name]()


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


_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def convert_hf_state(cfg: ModelConfig, source: TensorSource, dtype: torch.dtype) -> dict[str, Tensor]:
    """Our state dict from HF-layout tensors: renamed, fused, GPT-2 Conv1D transposed, cast to `dtype`."""
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
        tensors = []
        for part in parts:
            t = source.get(_hf_key(part, prefix))
            if cfg.arch == "gpt2" and part.endswith(_CONV1D):
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


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")


@contextlib.contextmanager
def _without_init():
    """`torch.nn.init`'s functions as no-ops while a model is built on the meta device.

    Why: on meta tensors they run through PyTorch's decompositions, whose
    first use imports torch._dynamo: 3.3 s of every command's start on an AVX2
    EPYC (Zen 3), 2026-11-26, for values that are replaced at once."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def build_model(cfg: ModelConfig, state: dict[str, Tensor], device: str = "cpu") -> Transformer:
    """Instantiate on the meta device (no random init, no memory), then adopt the given tensors.

    Skipping the random initialisation saves seconds on real models and
    never holds two copies of the weights; the RoPE tables are
    non-persistent buffers, so they are recomputed here.
    """
    with torch.device("meta"), _without_init():
        model = Transformer(cfg)
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
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    if cfg.arch != "gpt2":
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    if hasattr(model, "rope_local_cos"):
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_local_theta)
        model.rope_local_cos, model.rope_local_sin = cos.to(device), sin.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a new buffer in Transformer that this loader does not know how to fill
        raise RuntimeError(f"build_model left tensors uninitialised: {left}")
    model.eval().requires_grad_(False)
    return model


# ====================================================================== GGUF
@dataclass
class GGUFCheckpoint:
    """A GGUF file seen as an HF checkpoint: config dict + lazy HF-layout tensors."""

    reader: Any
    hf_config: dict[str, Any]
    source: TensorSource
    tensor_names: list[str] = field(default_factory=list)
    raw: dict[str, RawTensor] = field(default_factory=dict)  # HF name -> stored blocks, for 2-D weights


def open_gguf(path: Path) -> Any:
    """The GGUF file at `path` (`gguf_file.GGUFFile`: metadata decoded, tensors mapped), or a one-line error."""
    from stagedspec.models.gguf_file import open_gguf_file

    return open_gguf_file(path)


def read_gguf(path: Path) -> GGUFCheckpoint:
    reader = open_gguf(path)
    arch = gguf_value(reader, "general.architecture")
    if arch in ("llama", "qwen2"):
        return _gguf_llama(reader, arch)
    if arch == "gpt2":
        return _gguf_gpt2(reader)
    if arch == "gemma3":
        from stagedspec.models.gemma3 import gguf_gemma3

        return gguf_gemma3(reader)
    raise StagedSpecError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2, gemma3, gpt2)")


def gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as exc:
        raise StagedSpecError(f"corrupt GGUF metadata {key!r}: {first_line(exc)}") from None


def gguf_required(reader: Any, key: str) -> Any:
    value = gguf_value(reader, key)
    if value is None:
        raise StagedSpecError(f"GGUF file has no {key!r} metadata")
    return value


def tidy_float(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.9999997e-06); restore the intended decimal."""
    return float(f"{float(x):.7g}")


def gguf_tensor_loader(t: Any) -> Callable[[], Tensor]:
    """Dequantise one GGUF tensor to fp32, shaped [rows, cols] in PyTorch order."""
    from gguf.quants import dequantize

    def load() -> Tensor:
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise StagedSpecError(f"cannot dequantise GGUF tensor {t.name} ({t.tensor_type.name}): {first_line(exc)}") from None
        # GGUF lists dimensions fastest-first (ne order); PyTorch wants them reversed.
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        return torch.from_numpy(arr.copy())

    return load


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


def raw_tensor(t: Any) -> RawTensor | None:
    """A 2-D GGUF tensor's stored blocks (a view of the mapped file, nothing read), else None."""
    if len(t.shape) != 2:
        return None
    return RawTensor(t.tensor_type.name, t.data, int(t.shape[0]))


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
        if hf_name.endswith(_CONV1D):  # GGUF stores Linear layout; HF GPT-2 uses Conv1D [in, out]
            load = compose(load, lambda w: w.t().contiguous())
        makers[hf_name] = load
    return GGUFCheckpoint(reader, hf_config, FunctionSource(makers), list(tensors))


def gguf_layer_name(name: str, per_layer: Mapping[str, str], layer_prefix: str = "model.layers.") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None for unknown tensors)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in per_layer:
        return None
    return f"{layer_prefix}{parts[1]}.{per_layer[parts[2]]}.{parts[3]}"


def compose(load: Callable[[], Tensor], fn: Callable[[Tensor], Tensor]) -> Callable[[], Tensor]:
    return lambda: fn(load())


def gguf_to_hf_state(ckpt: GGUFCheckpoint, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Materialise HF-layout fp32 tensors from a GGUF checkpoint (used to write the cached HF folder)."""
    wanted = sorted(ckpt.source.names()) if names is None else list(names)
    return {n: ckpt.source.get(n) for n in wanted}
