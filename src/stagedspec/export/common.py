"""What every export format shares: loading a draft for export, refusing what cannot be exported,
the full-vocabulary head of a restricted draft, HF tensor names, and atomic file writes.

Why a full-vocabulary head: transformers' assisted generation and vLLM's draft models need the
draft's logits over the oracle's whole vocabulary, while a stagedspec draft owns a head over its V'
most frequent tokens (the others get -inf).  `full_vocab_head` keeps every restricted row, unchanged,
at its token id and fills each other row with the mean of the restricted rows: a fill token's logit
is then the mean of the restricted logits, which is below their maximum unless all V' restricted
logits are equal, so a fill token never wins the argmax and the greedy proposals are the draft's.
(Llama's `lm_head` has no bias in transformers or vLLM, so a -inf bias is not available; a fill row
of zeros would win whenever every restricted logit is negative.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from stagedspec.errors import StagedSpecError, first_line
from stagedspec.models.config import ModelConfig
from stagedspec.models.draft import CONFIG_NAME, DraftModel
from stagedspec.models.draft_formats import draft_folder, draft_format
from stagedspec.models.draft_loading import load_draft
from stagedspec.models.feature_draft import is_feature_draft
from stagedspec.models.loading import load_model
from stagedspec.models.specs import hf_folder_for
from stagedspec.models.transformer import Transformer
from stagedspec.paths import write_text_atomic
from stagedspec.tokenizer import tokenizer_fingerprint

# Files of an HF model folder that describe its tokenizer and generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def load_for_export(draft_spec: str, oracle_spec: str) -> tuple[Transformer, Any, DraftModel]:
    """(oracle, tokenizer, draft) in fp32 on the CPU, or a one-line StagedSpecError for a draft no format takes.

    fp32 so that the written weights are the draft's own numbers (a bf16 draft upcasts exactly) and
    the native reference a test compares against is not rounded twice.  No kernel planning or
    weight-format timing: nothing is decoded here.
    """
    fmt = draft_format(draft_spec).name
    if fmt == "layers":
        raise StagedSpecError(f"draft {draft_spec} is the oracle's own first layers, not a model of its own: "
                              "nothing to export (serve the oracle, or distil a draft with `stagedspec distill`)")
    oracle, tokenizer = load_model(oracle_spec, dtype=torch.float32, device="cpu", plan_kernels=False)
    if oracle.config.arch != "llama":
        raise StagedSpecError(f"drafts for a {oracle.config.arch} oracle cannot be exported: the export formats "
                              "are Llama-family layouts (Llama, SmolLM2, Qwen2-style attention biases)")
    if fmt != "folder":
        raise StagedSpecError(f"{draft_spec} is not a stagedspec draft folder (no {CONFIG_NAME}); an HF folder "
                              "or a GGUF draft is already a standalone model: serve it as it is")
    draft = load_draft(draft_folder(draft_spec, tokenizer, oracle.config.hidden_size), oracle,
                       expected_fingerprint=tokenizer_fingerprint(tokenizer), dtype=torch.float32, device="cpu")
    return oracle, tokenizer, draft


def require_kind(draft: DraftModel, fmt: str, feature: bool) -> None:
    """A clear error when the draft's kind does not fit the format (hf: independent; eagle: feature)."""
    if is_feature_draft(draft) and not feature:
        raise StagedSpecError(f"a feature draft reads the oracle's hidden states and cannot be a standalone "
                              f"{fmt} model: export it with --format eagle or --format speculators")
    if feature and not is_feature_draft(draft):
        raise StagedSpecError(f"--format {fmt} is for feature drafts (EAGLE-style); this draft is independent: "
                              "export it with --format hf")


def full_vocab_head(draft: DraftModel) -> Tensor:
    """The draft's head over the whole vocabulary [V, H]: restricted rows at their ids, the others their mean.

    See the module docstring for why the mean row can never win the argmax.  A draft with the oracle's
    (shared) head returns that head.
    """
    weight = draft.head_weight.detach().float()
    if draft.head_tokens is None:
        return weight.clone()
    full = weight.mean(dim=0, keepdim=True).expand(draft.config.vocab_size, -1).clone()
    full[draft.head_tokens] = weight
    return full


def llama_layer_tensors(layer: nn.Module, cfg: ModelConfig, prefix: str,
                        with_input_norm: bool = True) -> dict[str, Tensor]:
    """One of our Llama blocks as HF tensors under `prefix` (fused QKV and gate/up split back apart)."""
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out: dict[str, Tensor] = {}
    if with_input_norm:
        out[prefix + "input_layernorm.weight"] = layer.attn_norm.weight
    out[prefix + "post_attention_layernorm.weight"] = layer.mlp_norm.weight
    q, k, v = layer.attn.wqkv.weight.split([H * D, Hkv * D, Hkv * D], dim=0)
    out.update({prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": layer.attn.wo.weight})
    if layer.attn.wqkv.bias is not None:
        qb, kb, vb = layer.attn.wqkv.bias.split([H * D, Hkv * D, Hkv * D], dim=0)
        out.update({prefix + "self_attn.q_proj.bias": qb, prefix + "self_attn.k_proj.bias": kb,
                    prefix + "self_attn.v_proj.bias": vb})
    gate, up = layer.mlp.w_up.weight.chunk(2, dim=0)
    out.update({prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": layer.mlp.w_down.weight})
    return out


def llama_config(cfg: ModelConfig, n_layers: int, dtype: str, **extra: Any) -> dict[str, Any]:
    """An HF config dict for a Llama-family model with our config's shapes.

    A draft with Q/K/V biases (Qwen2-style) is a `Qwen2ForCausalLM`: Llama's `attention_bias` would
    also add a bias to the output projection, Qwen2's is exactly ours.
    """
    qwen = cfg.qkv_bias
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else (list(cfg.eos_token_ids) or None)
    out: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": cfg.norm_eps,
        # both spellings: transformers 5 reads `rope_parameters`, earlier versions and vLLM `rope_theta`
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if qwen:
        out["use_sliding_window"] = False
    else:
        out.update(attention_bias=False, mlp_bias=False)
    out.update(extra)
    return out


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write through a temporary name, so an interrupted export never leaves a half-written config."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_safetensors(tensors: Mapping[str, Tensor], path: Path, dtype: torch.dtype,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Floating tensors cast to `dtype`, contiguous and unshared (safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    ready = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).cpu().contiguous().clone()
             for k, v in tensors.items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(ready, str(tmp), metadata=dict(metadata or {"format": "pt"}))
    os.replace(tmp, path)


def copy_tokenizer_files(oracle_spec: str, out: Path) -> list[str]:
    """Copy the oracle's tokenizer (and generation defaults) next to the exported weights.

    A GGUF oracle has none on disk: its converted HF folder (`models.specs.hf_folder_for`, made once
    and cached) has them.
    """
    try:
        source = hf_folder_for(oracle_spec)
    except StagedSpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - the GGUF conversion can fail in many library-specific ways
        raise StagedSpecError(f"cannot get the oracle's tokenizer files: {first_line(exc)}") from None
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    if "tokenizer.json" not in copied:
        raise StagedSpecError(f"the oracle's folder {source} has no tokenizer.json to ship with the export")
    return copied


def prepare_out(out: str | Path) -> Path:
    """The output folder, created; an existing non-empty folder is refused rather than mixed into."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise StagedSpecError(f"--out {path} exists and is not an empty folder")
    path.mkdir(parents=True, exist_ok=True)
    return path
