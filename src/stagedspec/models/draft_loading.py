"""Rebuild a saved draft folder (`draft.save_draft`) on top of its oracle, as the model class its kind names.

Why apart from `draft`: loading has to know every draft kind, and the feature
draft (`feature_draft.FeatureDraftModel`) is built on `DraftModel`; in
`draft` the loader would import the subclass that imports it.  Here it sits
above both kinds, and `draft` keeps the model, its format and its saving.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError, first_line
from stagedspec.models.config import ModelConfig
from stagedspec.models.draft import INDEPENDENT, WEIGHTS_NAME, DraftModel, decode_int8_groups, read_draft_config
from stagedspec.models.feature_draft import FeatureDraftModel
from stagedspec.models.transformer import Transformer


def load_draft(
    folder: str | Path,
    oracle: Transformer,
    expected_fingerprint: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DraftModel:
    """Rebuild a saved draft on top of `oracle` (whose embedding it shares).

    `dtype`/`device` default to the oracle's.  Every way a draft can be
    unusable for this oracle is a StagedSpecError with the reason.
    """
    folder = Path(folder)
    cfg = read_draft_config(folder)
    if expected_fingerprint is not None and cfg["fingerprint"] != expected_fingerprint:
        raise StagedSpecError(
            f"draft {folder} was trained for another oracle/tokenizer "
            f"(fingerprint {cfg['fingerprint']!r}, this oracle has {expected_fingerprint!r})"
        )
    ocfg = oracle.config
    if cfg["vocab_size"] != ocfg.vocab_size:
        raise StagedSpecError(
            f"draft {folder} has a vocabulary of {cfg['vocab_size']} tokens, the oracle {ocfg.vocab_size}"
        )
    if cfg["hidden_size"] != ocfg.hidden_size:
        raise StagedSpecError(
            f"draft {folder} has width {cfg['hidden_size']}, the oracle {ocfg.hidden_size}: "
            "a draft shares the oracle's embedding, so the widths must match"
        )
    try:
        dcfg = ModelConfig.from_dict(cfg["model_config"])
    except (TypeError, ValueError) as exc:
        raise StagedSpecError(f"corrupt draft config in {folder}: {exc}") from None
    for field in ("arch", "n_heads", "n_kv_heads", "head_dim"):
        if getattr(dcfg, field) != getattr(ocfg, field):
            raise StagedSpecError(
                f"draft {folder} does not match the oracle's architecture "
                f"({field}: draft {getattr(dcfg, field)}, oracle {getattr(ocfg, field)})"
            )
    if not 1 <= dcfg.intermediate_size <= ocfg.intermediate_size:  # a draft's MLP may be pruned (`prune_mlp`)
        raise StagedSpecError(f"draft {folder} has an MLP of {dcfg.intermediate_size} channels, the oracle's "
                              f"{ocfg.intermediate_size}: it was not made from this oracle")
    layers = cfg["oracle_layers"]
    if not isinstance(layers, list) or len(layers) != dcfg.n_layers or any(
        not isinstance(i, int) or not 0 <= i < ocfg.n_layers for i in layers
    ):
        raise StagedSpecError(f"draft {folder} was initialised from layers {layers}, which this oracle lacks")

    try:
        tensors = decode_int8_groups(_read_weights(folder / WEIGHTS_NAME))
    except StagedSpecError as exc:
        raise StagedSpecError(f"corrupt draft weights {folder / WEIGHTS_NAME}: {exc}") from None
    head_tokens = tensors.get("head_tokens")
    head_from_oracle = cfg.get("head") == "oracle-rows"
    if head_from_oracle and head_tokens is None:
        raise StagedSpecError(f"corrupt draft {folder}: a head of the oracle's rows without its token ids")
    mlp_width = dcfg.intermediate_size if dcfg.intermediate_size != ocfg.intermediate_size else None
    taps = cfg.get("feature_taps", [])
    if not isinstance(taps, list) or (taps and cfg["kind"] == INDEPENDENT):
        raise StagedSpecError(f"corrupt draft config {folder}: feature_taps {taps!r}")
    try:
        if cfg["kind"] == INDEPENDENT:
            model = DraftModel(oracle, layers, head_tokens, dtype=dtype, device=device, mlp_width=mlp_width,
                               head_from_oracle=head_from_oracle)
        else:
            model = FeatureDraftModel(oracle, layers, head_tokens, dtype=dtype, device=device, mlp_width=mlp_width,
                                      head_from_oracle=head_from_oracle, taps=taps)
    except StagedSpecError as exc:
        raise StagedSpecError(f"corrupt draft {folder}: {exc}") from None
    own = model.own_state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    bad_shape = [k for k in own if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or bad_shape:
        raise StagedSpecError(
            f"corrupt draft {folder / WEIGHTS_NAME}: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {bad_shape[:3]}"
        )
    p = model.embed.weight
    model.load_state_dict({k: v.to(device=p.device, dtype=p.dtype if v.is_floating_point() else v.dtype)
                           for k, v in tensors.items()}, strict=False)
    model.training_meta = cfg.get("training", {})
    model.fingerprint = cfg["fingerprint"]
    return model.eval()


def _read_weights(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise StagedSpecError(f"draft weights {path} are missing")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own (Rust) error types for malformed files
        raise StagedSpecError(f"corrupt draft weights {path}: {first_line(exc)}") from None
