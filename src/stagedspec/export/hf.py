"""`--format hf`: an independent draft as a self-contained transformers causal-LM folder.

Why this layout: `AutoModelForCausalLM.from_pretrained(folder)` and vLLM's draft-model path both
read config.json + model.safetensors + the tokenizer files, so the folder needs neither stagedspec
nor the oracle.  The draft's shared (frozen) embedding is written in full: standalone, the draft
owns its copy.  Its restricted head becomes a full-vocabulary `lm_head` (`common.full_vocab_head`),
whose greedy proposals are the native draft's.  transformers is not imported: the files are written
directly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stagedspec.export.common import (DTYPES, copy_tokenizer_files, full_vocab_head, llama_config, llama_layer_tensors,
                                      write_json, write_safetensors)
from stagedspec.models.draft import DraftModel


def hf_tensors(draft: DraftModel) -> dict[str, torch.Tensor]:
    """The draft's weights under transformers' Llama/Qwen2 names, with a full-vocabulary untied head."""
    cfg = draft.config
    tensors = {"model.embed_tokens.weight": draft.embed.weight, "model.norm.weight": draft.norm.weight,
               "lm_head.weight": full_vocab_head(draft)}
    for i, layer in enumerate(draft.layers):
        tensors.update(llama_layer_tensors(layer, cfg, f"model.layers.{i}."))
    return tensors


def export_hf(draft: DraftModel, oracle_spec: str, out: Path, dtype: str) -> list[str]:
    """Write the folder; returns the file names written."""
    cfg = draft.config
    extra = {"stagedspec": {"exported_from": "stagedspec-draft", "oracle_layers": list(draft.oracle_layers),
                            "restricted_head_size": None if draft.head_tokens is None else int(draft.head_tokens.numel()),
                            "fill_rows": "mean of the restricted head rows"}}
    write_safetensors(hf_tensors(draft), out / "model.safetensors", DTYPES[dtype])
    write_json(out / "config.json", llama_config(cfg, cfg.n_layers, "bfloat16" if dtype == "bf16" else "float32",
                                                 **extra))
    return ["config.json", "model.safetensors", *copy_tokenizer_files(oracle_spec, out)]
