"""Draft formats: which loader reads a `--draft` spec, asked of one registry.

A draft spec names one of three formats, tried in this order:

- `layers`: `layers:N`, the oracle's own first N layers (`Transformer.truncated_copy`);
- `folder`: a stagedspec draft folder (`draft_config.json`: an independent or a feature draft,
  `models.draft_loading`), `default` being the one shipped for the oracle's tokenizer;
- `checkpoint`: any model `models.loading.load_model` reads (an HF folder, a GGUF, a named
  model), which must share the oracle's tokenizer.

Why one registry: each format is named once, with the test that recognises a spec and the loader
that reads it, so the pipeline, its `--quant mixed` loader and `export` ask the same question instead
of probing paths each their own way.  The kinds of a draft folder are told apart by its loader,
which sits above both model classes, so `models.draft` never imports `models.feature_draft` (which
subclasses it), and nothing below this module imports it (tests/test_import_graph.py).

The layouts `stagedspec export` writes for other engines (HF, EAGLE, speculators) are not read back:
an HF export is a `checkpoint`; the EAGLE layouts compute something else (`export.eagle`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from stagedspec.errors import StagedSpecError
from stagedspec.models.draft import CONFIG_NAME, default_draft_dir
from stagedspec.models.draft_loading import load_draft
from stagedspec.models.loading import load_model
from stagedspec.models.matmul_plan import plan_matmuls
from stagedspec.models.transformer import Transformer
from stagedspec.tokenizer import tokenizer_fingerprint


@dataclass(frozen=True)
class DraftSource:
    """What a loader needs beside the spec: the oracle the draft proposes for, its tokenizer, and how to load."""

    oracle: Transformer
    tokenizer: Any  # the oracle's: a draft must share it
    dtype: torch.dtype
    device: str
    quant: str = "none"  # checkpoints only: "mixed" keeps a quantised GGUF's own formats (`--quant mixed`)


@dataclass(frozen=True)
class DraftFormat:
    """One format: its name, whether a spec is in it, and how to load such a spec."""

    name: str
    detects: Callable[[str], bool]
    load: Callable[[str, DraftSource], Transformer]


def truncated_copy(oracle: Transformer, n_layers: int) -> Transformer:
    """The oracle's first `n_layers` layers with its embeddings, final norm and head (shared, not copied:
    `Transformer.truncated_copy`).

    A weak but always-available draft that shares the vocabulary by construction.
    """
    if not 1 <= n_layers < oracle.config.n_layers:
        raise StagedSpecError(f"a truncated draft needs 1..{oracle.config.n_layers - 1} layers, got {n_layers}")
    return oracle.truncated_copy(n_layers)


def _load_layers(spec: str, source: DraftSource) -> Transformer:
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        raise StagedSpecError(f"bad draft spec {spec!r}: expected layers:N with an integer N") from None
    return truncated_copy(source.oracle, n)


def draft_folder(spec: str, tokenizer: Any, hidden_size: int | None = None) -> Path:
    """The folder of a `folder` spec: `default` is the draft shipped for `tokenizer` and an oracle of
    `hidden_size` (`default_draft_dir`)."""
    return default_draft_dir(tokenizer_fingerprint(tokenizer), hidden_size) if spec == "default" else Path(spec)


def _is_folder(spec: str) -> bool:
    return spec == "default" or (Path(spec) / CONFIG_NAME).exists()


def _load_folder(spec: str, source: DraftSource) -> Transformer:
    draft = load_draft(draft_folder(spec, source.tokenizer, source.oracle.config.hidden_size), source.oracle,
                       expected_fingerprint=tokenizer_fingerprint(source.tokenizer), dtype=source.dtype,
                       device=source.device)
    return plan_matmuls(draft)


def _load_checkpoint(spec: str, source: DraftSource) -> Transformer:
    # Under a quantised oracle the draft is quantised too (`draft_weights`): timing its fp32 kernels would be wasted
    # (100 s for Qwen2.5-Coder-0.5B on two cores); `--draft-weights native` plans them there.
    draft, draft_tok = load_model(spec, dtype=source.dtype, device=source.device, quant=source.quant,
                                  plan_kernels=not source.oracle.quantised)
    vocab = source.oracle.config.vocab_size
    if draft.config.vocab_size != vocab or tokenizer_fingerprint(draft_tok) != tokenizer_fingerprint(source.tokenizer):
        raise StagedSpecError(
            f"draft {spec} has a different vocabulary ({draft.config.vocab_size} tokens) from the oracle's "
            f"({vocab} tokens): speculation needs a shared tokenizer"
        )
    return draft


# In probing order: the first format whose test takes a spec reads it (`checkpoint` takes every spec left).
FORMATS: tuple[DraftFormat, ...] = (
    DraftFormat("layers", lambda spec: spec.startswith("layers:"), _load_layers),
    DraftFormat("folder", _is_folder, _load_folder),
    DraftFormat("checkpoint", lambda spec: True, _load_checkpoint),
)


def draft_format(spec: str) -> DraftFormat:
    """The format that reads `spec`."""
    return next(f for f in FORMATS if f.detects(spec))


def load_draft_spec(spec: str, source: DraftSource) -> Transformer:
    """The draft `spec`, read by its format (a one-line StagedSpecError when it cannot serve `source.oracle`)."""
    return draft_format(spec).load(spec, source)
