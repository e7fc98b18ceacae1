"""`--format eagle` and `--format speculators`: a feature draft in the layouts vLLM's EAGLE loaders read.

Sources (formats and facts only, no code):

- `eagle`: vLLM's EAGLE-1 Llama draft, `vllm/model_executor/models/llama_eagle.py` at vllm-project/vllm
  commit e1c4a55214c63e19e83f82ad6c552d82148bae0b (`EagleLlamaForCausalLM`).  config.json is a plain
  Llama config (vLLM's `EAGLEConfig` renames the architecture to `Eagle` + it); the weights are
  `fc.weight` [H, 2H] applied to concat(token embedding, target hidden state), then `layers.{i}.*` with
  HF Llama names, the first layer without `input_layernorm`, no final norm, an optional `lm_head.weight`;
  `embed_tokens` is shared with the target.
- `speculators`: the `speculators` library's EAGLE config, `src/speculators/models/eagle.py`
  (`EagleSpeculatorConfig`, `EagleSpeculator`) and `src/speculators/config.py` at vllm-project/speculators
  commit 1c2e04354239139fd14467168c3dfa4b53e9f9c6, the last commit with the EAGLE-1 type (its commit
  792b9e6c removed it; newer speculators and vLLM releases read `eagle3` only, whose first layer
  attends over concat(norm(embedding), norm(hidden)), which a stagedspec feature draft does not compute).
  With `layernorms: true` and `fusion_bias: true`: `embedding_layernorm`, `fusion_fc` (weight + bias)
  over concat(embedding, hidden), one decoder layer `transformer.*` with its input norm,
  `pre_lm_head_layernorm`; embedding and head are the verifier's.  vLLM's reader of this config,
  `vllm/transformers_utils/configs/speculators/base.py` at commit 94699746757f9d68e2f4bd89ad2c4b10ed962457,
  requires `speculators_config.proposal_methods[0].speculative_tokens`, `speculators_config.verifier.name_or_path`,
  `speculators_model_type` and a `transformer_layer_config` dict.

Why exports are refused by default: a stagedspec feature draft computes
head(norm(layers(fc(concat(f, e)) + b))) with every layer's input norm, and feeds norm(output) to
deeper tree levels.  Neither layout computes exactly that (`differences` lists what differs for a
given draft), so the exported draft would propose other tokens than the native one.  The output of
vLLM stays its own either way (it verifies every token); only the acceptance changes.  `--approximate`
writes the nearest layout anyway and records the differences in the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stagedspec.errors import StagedSpecError
from stagedspec.export.common import (DTYPES, copy_tokenizer_files, full_vocab_head, llama_config,
                                      llama_layer_tensors, write_json, write_safetensors)
from stagedspec.models.draft import DraftModel
from stagedspec.models.specs import hf_folder_for

VLLM_COMMIT = "e1c4a55214c63e19e83f82ad6c552d82148bae0b"
SPECULATORS_COMMIT = "1c2e04354239139fd14467168c3dfa4b53e9f9c6"
SPECULATORS_VERSION = "0.4.0"  # the last release with the EAGLE-1 type (v0.5.0 removed it)


def differences(draft: DraftModel, fmt: str) -> list[str]:
    """How the format's computation differs from this feature draft's (empty: exact)."""
    own_head = draft.head is not None
    nonzero_bias = bool(draft.fc.bias is not None and draft.fc.bias.detach().abs().max() > 0)
    if fmt == "eagle":
        out = ["its first layer has no input norm",
               "it has no norm before the head and feeds the un-normalised output to deeper levels"]
        if nonzero_bias:
            out.insert(0, "its fc has no bias (this draft's is not zero)")
        return out
    out = ["it normalises the token embedding before the fc"]
    if own_head:
        out.append("its head is the verifier's full head, not the draft's own")
    return out


def check_exportable(draft: DraftModel, fmt: str, approximate: bool) -> list[str]:
    """The differences to record, or a one-line StagedSpecError when the export is refused."""
    if getattr(draft, "feature_taps", ()):
        raise StagedSpecError(f"this feature draft also reads the inputs of oracle layers {list(draft.feature_taps)}; "
                              f"the EAGLE-1 layouts of --format {fmt} read the final hidden state alone")
    if fmt == "speculators" and draft.config.n_layers != 1:
        raise StagedSpecError(f"the speculators EAGLE layout holds one decoder layer; this feature draft has "
                              f"{draft.config.n_layers}: use --format eagle")
    diffs = differences(draft, fmt)
    if diffs and not approximate:
        raise StagedSpecError(f"--format {fmt} cannot hold this feature draft exactly ({'; '.join(diffs)}); "
                              "--approximate writes the nearest layout, whose proposals differ from the native draft's")
    return diffs


def _fc_halves(draft: DraftModel) -> torch.Tensor:
    """fc's weight with its input halves swapped: ours reads concat(feature, embedding), theirs the reverse."""
    H = draft.config.hidden_size
    w = draft.fc.weight.detach()
    return torch.cat([w[:, H:], w[:, :H]], dim=1)


def eagle_tensors(draft: DraftModel) -> dict[str, torch.Tensor]:
    """Weights under vLLM's EAGLE-1 names.  The final norm's weight is folded into the head's columns:
    a positive 1/rms factor per position does not move the argmax, so the first level's ranking keeps
    the norm's per-channel scale."""
    cfg = draft.config
    tensors: dict[str, torch.Tensor] = {"fc.weight": _fc_halves(draft),
                                        "lm_head.weight": full_vocab_head(draft) * draft.norm.weight.detach().float()}
    for i, layer in enumerate(draft.layers):
        tensors.update(llama_layer_tensors(layer, cfg, f"layers.{i}.", with_input_norm=i > 0))
    return tensors


def speculators_tensors(draft: DraftModel) -> dict[str, torch.Tensor]:
    """Weights under `EagleSpeculator`'s names (layernorms and fusion bias on).  The embedding norm's
    weight is the mean RMS of the embedding rows, so norm(e) has the scale of the e the fc was trained on."""
    embed = draft.embed.weight.detach().float()
    mean_rms = embed.pow(2).mean(dim=-1).add(draft.config.norm_eps).sqrt().mean()
    tensors: dict[str, torch.Tensor] = {
        "embedding_layernorm.weight": torch.full((draft.config.hidden_size,), float(mean_rms)),
        "fusion_fc.weight": _fc_halves(draft),
        "fusion_fc.bias": draft.fc.bias.detach(),
        "pre_lm_head_layernorm.weight": draft.norm.weight.detach(),
    }
    tensors.update(llama_layer_tensors(draft.layers[0], draft.config, "transformer."))
    return tensors


def verifier_architectures(oracle_spec: str) -> list[str]:
    """The oracle's `architectures` from its (converted) HF config, as the speculators config records them."""
    import json

    try:
        cfg = json.loads((hf_folder_for(oracle_spec) / "config.json").read_text(encoding="utf-8"))
        return [str(a) for a in cfg.get("architectures") or []] or ["LlamaForCausalLM"]
    except (OSError, ValueError):
        return ["LlamaForCausalLM"]


def speculators_config(draft: DraftModel, dtype: str, verifier: str, architectures: list[str],
                       speculative_tokens: int, diffs: list[str]) -> dict[str, Any]:
    """config.json of an `EagleSpeculatorConfig` (speculators_model_type "eagle")."""
    layer = llama_config(draft.config, 1, dtype)
    return {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer,
        "layernorms": True,
        "fusion_bias": True,
        "speculators_config": {
            "algorithm": "eagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
        "dtype": dtype,
        "torch_dtype": dtype,
        "stagedspec_export": {"source": f"vllm-project/speculators@{SPECULATORS_COMMIT}", "approximate": diffs},
    }


def export_feature(draft: DraftModel, fmt: str, oracle_spec: str, out: Path, dtype: str, *, approximate: bool,
                   verifier: str | None, speculative_tokens: int) -> list[str]:
    """Write `fmt` ("eagle" or "speculators") into `out`; returns the file names written."""
    diffs = check_exportable(draft, fmt, approximate)
    name = "bfloat16" if dtype == "bf16" else "float32"
    if fmt == "eagle":
        write_safetensors(eagle_tensors(draft), out / "model.safetensors", DTYPES[dtype])
        config = llama_config(draft.config, draft.config.n_layers, name,
                              stagedspec_export={"source": f"vllm-project/vllm@{VLLM_COMMIT}", "approximate": diffs})
    else:
        write_safetensors(speculators_tensors(draft), out / "model.safetensors", DTYPES[dtype])
        config = speculators_config(draft, name, verifier or str(hf_folder_for(oracle_spec)),
                                    verifier_architectures(oracle_spec), speculative_tokens, diffs)
    write_json(out / "config.json", config)
    return ["config.json", "model.safetensors", *copy_tokenizer_files(oracle_spec, out)]
