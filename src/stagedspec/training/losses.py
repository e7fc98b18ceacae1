"""The distillation loss: a bucket KL between the oracle's top-k and the draft's support, and its backward
through the draft's head in chunks of rows.

Its own module because two trainers use it, the token draft's (`training.distill`) and the feature
draft's (`training.feature`), and neither should import the other for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from stagedspec.models.draft import DraftModel

# A tiny floor on the student's "everything else" mass: keeps the loss finite
# when the student cannot put mass there (its support is inside the teacher's top-k).
OTHER_FLOOR = 1e-8
# Logits rows processed at once when the head is large (bounds the [rows, V] temporaries).
LOSS_CHUNK_ELEMENTS = 1 << 24


def bucket_kl(student_logits: Tensor, teacher_logp: Tensor, teacher_cols: Tensor) -> Tensor:
    """KL(teacher || student) per row over buckets: each teacher top-k token, and "everything else".

    `student_logits` [N, S] over the student's support; `teacher_logp` [N, k]
    the teacher's top-k log-probs; `teacher_cols` [N, k] their columns in the
    student's support (-1 when the student cannot propose the token: that
    mass joins "everything else").  Merging the tail into one bucket is the
    exact KL of the coarsened distributions: zero iff the student matches
    the teacher on the top-k, and never larger than the full KL.
    """
    lq = student_logits.float().log_softmax(-1)
    valid = teacher_cols >= 0
    cols = teacher_cols.clamp(min=0)
    p = teacher_logp.exp() * valid
    kl_top = (p * (teacher_logp - lq.gather(-1, cols))).sum(-1)
    p_other = (1.0 - p.sum(-1)).clamp(min=0.0)
    in_top = torch.zeros_like(lq).scatter_add_(-1, cols, valid.to(lq.dtype)) > 0
    lq_other = torch.logsumexp(lq.masked_fill(in_top, float("-inf")), dim=-1)
    lq_other = torch.logaddexp(lq_other, torch.full_like(lq_other, math.log(OTHER_FLOOR)))
    return kl_top + torch.xlogy(p_other, p_other) - p_other * lq_other


def autocast_bf16(device: torch.device, enabled: bool) -> Any:
    """bf16 autocast of the student's passes on `device` (a no-op context when not enabled)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def head_kl_backward(student: DraftModel, hidden: Tensor, t_logp: Tensor, t_cols: Tensor,
                     row_weight: Tensor | None, autocast: bool = False) -> float:
    """The student's head and the bucket KL over `hidden` [N, H] in chunks of rows, gradients accumulated into
    `hidden` (a detached leaf); returns the loss.

    Each row's KL is weighted by `row_weight` [N], or averaged over the N rows when None.  Chunking bounds the
    [rows, V] temporaries, which for a full 49k-token head would otherwise dominate memory.
    """
    n = hidden.shape[0]
    rows = max(1, LOSS_CHUNK_ELEMENTS // student.head_weight.shape[0])
    total = 0.0
    for r in range(0, n, rows):
        with autocast_bf16(hidden.device, autocast):
            logits = student.support_logits(hidden[r : r + rows])
        kl = bucket_kl(logits, t_logp[r : r + rows], t_cols[r : r + rows])
        loss = kl.sum() / n if row_weight is None else (kl * row_weight[r : r + rows]).sum()
        loss.backward()
        total += float(loss.item())
    return total
