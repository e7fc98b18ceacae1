"""The models a command runs, loaded once (`ModelSet`): the oracle, its tokenizer, the draft models and the
n-gram, with the per-machine choices their loading made (device, dtype and why, weight formats).

Why one record: the CLI, the library and the server used to load the same parts each their own way; each
now holds a `ModelSet` (`ModelSet.load` from specs: paths, names, `layers:N`) and builds what a request needs
from it (`Pipeline.over`).  The record is frozen: nothing after loading resolves a choice again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from stagedspec.draft_weights import choose_draft_weights, split_weights_suffix
from stagedspec.drafters.ngram_files import load_ngram
from stagedspec.dtypes import resolve_dtype
from stagedspec.errors import StagedSpecError
from stagedspec.kernels.huge_pages import move_to_huge_pages
from stagedspec.methods import method_named
from stagedspec.models.draft import bundled_draft_for
from stagedspec.models.draft_formats import DraftSource, draft_format, load_draft_spec
from stagedspec.models.feature_draft import is_feature_draft
from stagedspec.models.head_subset import check_draft_vocab, draft_subset, restrict_head, split_vocab_suffix
from stagedspec.models.loading import load_model
from stagedspec.models.named import paired_draft
from stagedspec.models.quant import resolve_quant
from stagedspec.models.transformer import Transformer
from stagedspec.pass_options import PassOptions, PassRuntime
from stagedspec.tokenizer import tokenizer_fingerprint


@dataclass(frozen=True)
class ModelSet:
    """Loaded models and what loading chose for this machine.  `draft_models`: top stage first."""

    model: Transformer
    tokenizer: Any  # stagedspec.tokenizer.Tokenizer
    draft_models: tuple[Transformer, ...] = ()
    ngram: Any = None  # drafters.ngram.NgramModel
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    dtype_reason: str = "as asked"
    quant: str = "none"

    @classmethod
    def load(cls, oracle: str = "default", draft: str | Sequence[str] | None = None, *, method: str = "auto",
             ngram: str | None = None, context: bool = True, dtype: str = "auto", device: str = "cpu",
             quant: str = "auto", draft_weights: str = "auto", draft_vocab: str = "auto",
             pass_options: PassOptions | None = None) -> ModelSet:
        """The oracle `oracle`, then the drafts `method` runs with (`draft_specs`), then the n-gram `ngram`
        (for a method that reads one), checked to make that method.

        `quant` ("auto" as the CLI takes it, "int4", "int8", "mixed", "none") is resolved here once; `dtype`
        "auto" asks the hardware (`dtypes.resolve_dtype`); drafts run with the oracle's pass options, on
        `draft_weights` (`stagedspec.draft_weights`) and over the vocabulary `draft_vocab` (`models.head_subset`)."""
        check_draft_choices(method, draft, draft_vocab)
        device = check_device(device)
        quant = resolve_quant(quant, oracle, device)
        torch_dtype, dtype_reason = resolve_dtype(dtype, device, quant)
        model, tokenizer = load_model(oracle, dtype=torch_dtype, device=device, quant=quant, pass_options=pass_options)
        draft_models = [load_draft_model(d, model, tokenizer, torch_dtype, device, draft_weights, draft_vocab)
                        for d in draft_specs(method, draft, oracle, tokenizer, model.config.hidden_size)]
        if any(is_feature_draft(m) for m in draft_models[1:]):
            raise StagedSpecError("a feature draft can only be the first --draft (the stage right below the oracle): "
                                  "only the oracle computes the hidden states it reads")
        m = method_named(method)
        loaded_ngram = None
        if m.bottom and ngram is not None:
            loaded_ngram = load_ngram(ngram, tokenizer)
        m.check_bottom(loaded_ngram is not None, context)
        return cls(model, tokenizer, tuple(draft_models), loaded_ngram, device, torch_dtype, dtype_reason, quant)


def check_draft_choices(method: str, draft: str | Sequence[str] | None, draft_vocab: str) -> None:
    """The method's count of drafts and the --draft-vocab value, checked before any model is read: a wrong one
    is then a one-line error at once (on a fresh machine, not one after the default model's one-time
    conversion and its progress bars)."""
    check_draft_vocab(draft_vocab)
    method_named(method).check_drafts([draft] if isinstance(draft, str) else list(draft or []))


def check_device(device: str) -> str:
    """A valid device name, with CUDA set up for our passes.

    On CUDA, cuDNN's SDPA backend is turned off: it builds a new plan for
    every new (query, key) shape, and speculation makes many shapes (an H100
    profile of `staged` spent 65% of its CPU time there; without it `tree`
    went from 21 to 55 tok/s). The flash / memory-efficient / math backends
    that take over return non-contiguous outputs, which `Attention.forward`
    reshapes.
    """
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StagedSpecError(f"device {device!r} requested but no CUDA GPU is available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise StagedSpecError(f"unknown device {device!r}: use cpu or cuda")
    if device.startswith("cuda") and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def parse_stages(specs: Sequence[str]) -> tuple[str, list[str], str | None, bool]:
    """`--stages ORACLE,DRAFT...,BOTTOM` -> (oracle, drafts, ngram spec or None, use prompt lookup).

    BOTTOM is `ngram`, `ngram:FILE`, `context`, or a `+`-joined mix such as
    `context+ngram`; it may be omitted (then `context+ngram`).
    """
    specs = [s.strip() for s in specs if s.strip()]
    if len(specs) < 2:
        raise StagedSpecError("--stages needs at least an oracle and one more stage, e.g. default,DRAFT,ngram")

    def is_bottom(spec: str) -> bool:
        return all(part == "context" or part == "ngram" or part.startswith("ngram:") for part in spec.split("+"))

    bottom = specs[-1] if is_bottom(specs[-1]) else "context+ngram"
    middle = specs[1:-1] if is_bottom(specs[-1]) else specs[1:]
    for spec in middle:
        if is_bottom(spec):
            raise StagedSpecError(f"stage {spec!r} is model-free and can only be the last stage")
    ngram, context = None, False
    for part in bottom.split("+"):
        if part == "context":
            context = True
        else:
            ngram = part.split(":", 1)[1] if ":" in part else "default"
    return specs[0], middle, ngram, context


def load_draft_model(spec: str, oracle: Transformer, oracle_tokenizer, dtype: torch.dtype, device: str,  # noqa: ANN001
                     weights: str = "auto", vocab: str = "auto") -> Transformer:
    """Resolve a --draft SPEC: `layers:N`, a distilled draft folder, an HF folder or a .gguf.

    `weights` (--draft-weights, or a `SPEC@FORMAT` suffix) picks the draft's weight format: "native" (the
    pipeline's dtype), "int8", or "auto": int8 for a quantised oracle, and on a bf16 CPU oracle whichever this
    machine runs faster, measured once and cached (`stagedspec.draft_weights`).  `vocab` (--draft-vocab, or a
    `SPEC@full` suffix) cuts its head to part of the vocabulary (`models.head_subset`; "auto": the bundled subset
    of the oracle's tokenizer, for a GGUF, HF or layers:N draft).  The output never depends on either."""
    spec, own_vocab = split_vocab_suffix(spec)
    spec, own = split_weights_suffix(spec)
    weights = own or weights
    draft = choose_draft_weights(lambda: _load_draft(spec, oracle, oracle_tokenizer, dtype, device), oracle, weights,
                                 load_mixed=_mixed_loader(spec, oracle, oracle_tokenizer, dtype, device))
    ids = draft_subset(own_vocab or vocab, draft, tokenizer_fingerprint(oracle_tokenizer))
    draft = draft if ids is None else restrict_head(draft, ids)
    if str(device).startswith("cpu"):
        move_to_huge_pages(draft)  # as the oracle's (`models.loading.load_model`)
    return draft


def _mixed_loader(spec: str, oracle: Transformer, oracle_tokenizer, dtype: torch.dtype,  # noqa: ANN001
                  device: str) -> Callable[[], Transformer] | None:
    """A loader of the draft `spec` in its quantised GGUF's own formats (`--quant mixed`), or None where its
    source is not one (a distilled draft, `layers:N`, an HF folder, a float GGUF)."""
    if draft_format(spec).name != "checkpoint":
        return None
    try:
        if resolve_quant("auto", spec, device) != "mixed":
            return None
    except StagedSpecError:
        return None  # a bad path: `_load_draft` names it
    return lambda: _load_draft(spec, oracle, oracle_tokenizer, dtype, device, quant="mixed")


def _load_draft(spec: str, oracle: Transformer, oracle_tokenizer, dtype: torch.dtype, device: str,  # noqa: ANN001
                quant: str = "none") -> Transformer:
    """The draft `spec`, its passes run with its oracle's options: a pipeline's models share one `PassOptions`."""
    draft = load_draft_spec(spec, DraftSource(oracle, oracle_tokenizer, dtype, device, quant))
    draft.runtime.passes = PassRuntime(oracle.runtime.passes.options)
    return draft


def draft_specs(method: str, draft: str | Sequence[str] | None, oracle: str, tokenizer,
                hidden_size: int | None = None) -> list[str]:
    """The draft specs `method` runs with, from `draft` (one spec, or for `staged` a list from the stage below
    the oracle downwards): none for `ar` and `lookup`; for `auto` with none given, the draft shipped for the
    oracle (`--draft default`, found by `tokenizer`) or the oracle's named pair (`models.named`), if any."""
    drafts = [draft] if isinstance(draft, str) else list(draft or [])
    m = method_named(method)
    m.check_drafts(drafts)
    if not m.uses_drafts:
        return []
    if m.drafts == "any" and not drafts:
        pair = paired_draft(oracle) if isinstance(oracle, str) else None
        bundled = bundled_draft_for(tokenizer_fingerprint(tokenizer), hidden_size) is not None
        drafts = ["default"] if bundled else [pair] if pair else []
    return drafts
