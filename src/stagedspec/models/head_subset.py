"""A draft model's output head cut to the tokens that matter (FR-Spec's frequency-ranked vocabulary).

Why: a small model's vocabulary head is a large share of the bytes its pass
streams.  Qwen2.5-Coder-0.5B's Q8_0 head is 145 MB of the 391 MB a one-row
pass reads (the layers are 247 MB); over the 24,576 tokens the bundled
Qwen feature draft proposes from it is 23 MB, and a one-row pass of the 0.5B
went from 21.5-24.0 ms to 18.5-18.9 ms on an AMX Xeon (docs/measurements.md,
"A 0.5B draft with a 24,576-token head").  Zhao et al. (FR-Spec, 2025) keep
most of the acceptance with the most frequent 32k tokens of a 128k vocabulary.

Exactness does not depend on it.  The draft's logits outside the subset are
-inf (probability 0), so the distribution a token is drawn from, and the q
used to accept it, is the softmax over the subset; the oracle verifies every
token and emits its own choice where the draft could not propose it.

`--draft-vocab` picks the subset: "auto" (the token ids of the bundled draft
made for the same tokenizer, where that draft's head is a subset), "full",
or a file of token ids (a JSON list, or one id per line).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from stagedspec.errors import StagedSpecError
from stagedspec.models.draft import WEIGHTS_NAME, DraftModel, bundled_drafts_for
from stagedspec.models.quant import Int8Linear, RowSwitchLinear
from stagedspec.models.transformer import Transformer

DRAFT_VOCABS = ("auto", "full")  # or a file of token ids
SUBSET_PAYS = 2  # a subset at most half the vocabulary: below that the scatter costs about what the rows save


def token_ids_file(path: str, vocab_size: int) -> Tensor:
    """Ascending unique token ids [V'] from a JSON list or a one-id-per-line file, checked against the vocabulary."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StagedSpecError(f"cannot read --draft-vocab file {path}: {exc.__class__.__name__}") from None
    try:
        values = json.loads(text) if text.lstrip().startswith(("[", "{")) else [int(s) for s in text.split()]
    except ValueError:
        raise StagedSpecError(f"--draft-vocab file {path} is neither a JSON list of token ids nor one id per "
                              "line") from None
    if not isinstance(values, list) or not values or not all(isinstance(v, int) for v in values):
        raise StagedSpecError(f"--draft-vocab file {path} holds no list of integer token ids")
    return checked_ids(torch.tensor(values, dtype=torch.long), vocab_size, str(path))


def checked_ids(ids: Tensor, vocab_size: int, where: str) -> Tensor:
    ids = torch.unique(ids)  # sorted too
    if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise StagedSpecError(f"{where}: token ids must lie in 0..{vocab_size - 1}")
    return ids


def bundled_subset(fingerprint: str, vocab_size: int) -> Tensor | None:
    """The token ids of a bundled draft's restricted head for this tokenizer (`fingerprint`), if any."""
    for folder, recorded in bundled_drafts_for(fingerprint):
        if recorded.get("vocab_size") != vocab_size or recorded.get("head") not in ("restricted", "oracle-rows"):
            continue
        with safe_open(str(folder / WEIGHTS_NAME), "pt") as f:
            if "head_tokens" in f.keys():
                return checked_ids(f.get_tensor("head_tokens").long(), vocab_size, str(folder))
    return None


def draft_subset(choice: str, draft: Transformer, fingerprint: str) -> Tensor | None:
    """The token ids `--draft-vocab choice` gives `draft` (None: its whole head).

    "auto" cuts only a model with a whole-vocabulary head of its own reading (a GGUF or HF draft, or
    `layers:N`), and only to a subset of at most half the vocabulary; a distilled draft keeps its head."""
    vocab = draft.config.vocab_size
    if isinstance(draft, DraftModel):
        if choice not in DRAFT_VOCABS:
            raise StagedSpecError("--draft-vocab applies to GGUF, HF and layers:N drafts; a distilled draft keeps "
                                  "the head it was trained with")
        return None
    if choice == "full":
        return None
    if choice == "auto":
        ids = bundled_subset(fingerprint, vocab)
        return ids if ids is not None and ids.numel() * SUBSET_PAYS <= vocab else None
    return token_ids_file(choice, vocab)


def restrict_head(model: Transformer, ids: Tensor) -> Transformer:
    """`model` computing its head over `ids` only (ascending token ids), in place: its rows are copied, in the
    head's own weight format (int8 stays int8), and `head_logits` scatters them into the whole vocabulary with
    -inf elsewhere.  The whole head stays where it is shared (a `layers:N` draft's is the oracle's)."""
    ids = checked_ids(ids, model.config.vocab_size, "--draft-vocab")
    head = model.head_q
    rows = ids.to(model.head_weight.device)
    if head is None:
        weight = model.head_weight.detach()[rows]
        subset: nn.Module = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                      dtype=weight.dtype)
        with torch.no_grad():
            subset.weight.copy_(weight)
        subset.weight.requires_grad_(False)
    elif isinstance(head, RowSwitchLinear):
        subset = RowSwitchLinear(head.dense_weight[rows], None, head.max_rows)
    elif hasattr(head, "dequantized"):  # int8, or a GGUF's own format (its rows as int8: a draft needs no more)
        subset = Int8Linear(head.dequantized()[rows].float(), None, getattr(head, "kernels", "auto"))
    else:
        raise StagedSpecError(f"--draft-vocab cannot cut a head of type {type(head).__name__}")
    model.subset_head = subset
    model.subset_ids = rows
    return model


def split_vocab_suffix(spec: str) -> tuple[str, str | None]:
    """`DRAFT@full` -> ("DRAFT", "full"): a draft spec may name its own `--draft-vocab` ("auto" or "full"), as
    `DRAFT@int8` names its weights, so one bench run can compare both.  The suffixes may come in either order."""
    base, sep, tail = spec.rpartition("@")
    if sep and base and tail in DRAFT_VOCABS:
        return base, tail
    head, sep, last = base.rpartition("@")
    if sep and head and tail and last in DRAFT_VOCABS:  # DRAFT@full@int8
        return f"{head}@{tail}", last
    return spec, None


def check_draft_vocab(choice: str) -> None:
    """A clear error for a --draft-vocab value that is neither a known word nor a file."""
    if choice not in DRAFT_VOCABS and not Path(choice).is_file():
        raise StagedSpecError(f"--draft-vocab {choice!r} is neither auto, full nor a file of token ids")
