"""Distilling a feature draft (`stagedspec distill --kind feature`): its loss and held-out figures.

The loop, data, schedule, checkpoints and teacher targets are `stagedspec.training.distill`'s; what differs:

- Inputs.  The teacher pass also returns the oracle's final hidden states
  f [B, T, H] (`teacher_topk(..., with_hidden=True)`, the same single
  no-grad pass per batch); the draft reads f_{t-1} with token x_t.  A draft
  with `feature_taps` gets the taps' features after f ([B, T, H * (1 + taps)]):
  step 0 reads them, the unrolled steps (predicted features) do not.
- Loss.  The bucket KL to the oracle's next-token distribution, as for an
  independent draft, per unrolled step ("training-time test", EAGLE-3): step
  j >= 1 runs on the draft's own step j-1 features and stands for tree depth
  j, weighted `ttt_decay ** j`; `--ttt-steps 1` is plain EAGLE-1/2 training.
  Plus `feature_loss` times a smooth-L1 between the draft's output features
  and the oracle's (EAGLE-1 regresses the features): deeper levels read
  these outputs, so they should stay close to the oracle's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stagedspec.training.losses import autocast_bf16, bucket_kl, head_kl_backward


def shift_features(features: Tensor) -> Tensor:
    """Row t of the result is features' row t-1 (zeros at t = 0): the draft's input at t is f_{t-1}."""
    return F.pad(features[:, :-1], (0, 0, 1, 0))


def step_weights(steps: int, decay: float) -> list[float]:
    """Normalised loss weights of the unrolled steps: decay ** j, summing to 1."""
    raw = [decay ** j for j in range(steps)]
    return [w / sum(raw) for w in raw]


def feature_loss_backward(student: Any, tokens: Tensor, oracle_features: Tensor, t_logp: Tensor, t_cols: Tensor,
                          cfg: Any, autocast: bool = False) -> float:
    """The weighted loss of a batch over `cfg.ttt_steps` unrolled steps, gradients accumulated into the student.

    `t_logp`, `t_cols` are flattened [B * T, k] like `_train_loss_backward`'s.
    As there, the trunk runs once with autograd and the head + KL run in
    chunks on a detached copy of its outputs, whose gradient is pushed back
    through the trunk in one backward.  Step j's rows t < j have no real tree
    root (see `FeatureDraftModel.unrolled_hidden`) and get no weight.
    """
    B, T = tokens.shape
    steps = cfg.ttt_steps
    with autocast_bf16(tokens.device, autocast):
        outs = student.unrolled_hidden(tokens, shift_features(oracle_features), steps)
    h = torch.stack(outs)  # [steps, B, T, H]
    hd = h.detach().requires_grad_(True)
    weights = step_weights(steps, cfg.ttt_decay)
    position = torch.arange(T, device=tokens.device).repeat(B)  # position of each flattened row
    total = 0.0
    for j, w in enumerate(weights):
        valid = (position >= j).float()
        total += head_kl_backward(student, hd[j].flatten(0, 1), t_logp, t_cols, valid * (w / float(valid.sum())),
                                  autocast)
        if cfg.feature_loss > 0:
            target = oracle_features[:, j:, :hd.shape[-1]].to(hd.dtype)  # the final features (not the taps')
            reg = F.smooth_l1_loss(hd[j][:, j:].float(), target.float()) * (cfg.feature_loss * w)
            reg.backward()
            total += float(reg.item())
    h.backward(hd.grad)
    return total


@torch.no_grad()
def feature_heldout_metrics(student: Any, windows: Tensor, t_logp: Tensor, t_ids: Tensor, t_cols: Tensor,
                            t_hidden: Tensor, depths: int = 3) -> dict[str, float]:
    """Held-out KL and top-1 of the root prediction (oracle features in), and top-1 at tree depths 2..`depths`
    (`heldout_top1_d2`...: the draft's own features in, as at those depths of a tree)."""
    was_training = student.training
    student.eval()
    device = student.embed.weight.device
    support = student.support
    kl_sum, n = 0.0, 0
    agree = [0] * depths
    counted = [0] * depths
    for i in range(windows.shape[0]):
        tokens = windows[i : i + 1].to(device)
        feats = t_hidden[i : i + 1].to(device)
        outs = student.unrolled_hidden(tokens, shift_features(feats), depths)
        target = t_ids[i, :, 0].to(device)
        for j, h in enumerate(outs):
            logits = student.support_logits(h[0])
            if j == 0:
                kl_sum += float(bucket_kl(logits, t_logp[i].to(device), t_cols[i].to(device)).sum())
                n += h.shape[1]
            hit = support[logits.argmax(-1)] == target
            agree[j] += int(hit[j:].sum())
            counted[j] += max(0, h.shape[1] - j)
    student.train(was_training)
    out = {"heldout_kl": kl_sum / n, "heldout_top1": agree[0] / counted[0]}
    out.update({f"heldout_top1_d{j + 1}": agree[j] / counted[j] for j in range(1, depths) if counted[j]})
    return out
