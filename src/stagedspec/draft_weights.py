"""Which weight format a draft model runs on: its own dtype, or int8, whichever this machine runs faster.

Why: a draft's pass at batch 1 streams its weights once, so on a CPU its
cost is mostly bytes.  On an AVX-512 BF16 + AMX CPU, int8 layers and head
(PyTorch's `_weight_int8pack_mm`) made the default SmolLM2 draft and a
3-layer draft much cheaper than in bf16
(docs/measurements.md, "int8 draft weights on an AMX Xeon").  What the draft proposes moves a
little with its rounding, but exactness never depends on the draft: the
oracle's weights, and so the output, are untouched.

Whether int8 pays is a property of the machine (its kernels, its bf16
support) and of the pass's row count: the int8 kernel is not blocked for
many rows, and on the same CPU a pass of many rows costs more than bf16's
(docs/measurements.md, "int8 against bf16 weights by row count on an AMX Xeon").  So
`--draft-weights auto` times both formats at 1-16 rows, once per draft and
machine (cached next to the cost profiles), and runs int8 for the passes of
up to as many rows as it was faster at, the dense weights for bigger ones
(`models.quant.RowSwitchLinear`; a draft's prompt pass is a whole prompt).  A quantised oracle keeps the earlier rule (its draft
runs on int8, measured then: same acceptance, `staged` 1.29x instead of 1.22x
int4 `ar`), unless the draft is itself a quantised GGUF: then its own formats
(`--quant mixed`: Q5_0, Q4_K, Q6_K and Q8_0 kept exactly) and int8 are timed
once, and the faster at 1-4 rows runs.  Qwen2.5-Coder-0.5B's file streams
about 400 MB a pass in its own formats against 525 MB as int8.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from stagedspec import hardware, measured_cache
from stagedspec.errors import StagedSpecError
from stagedspec.kernels.native import native_kernels
from stagedspec.models.matmul_plan import plan_matmuls
from stagedspec.models.quant import Int8Linear, RowSwitchLinear, quantize_draft, swap_layers
from stagedspec.models.transformer import Transformer
from stagedspec.paths import learned_store

DRAFT_WEIGHTS = ("auto", "native", "int8", "mixed")
MIXED_ROWS = (1, 2, 4)  # the passes a draft runs most (a chain's tokens, a tree's levels): mixed vs int8 by these
MEASURED_ROWS = (1, 2, 4, 8, 16)  # a draft decodes one token, or checks a chain / tree level of a few
INT8_MARGIN = 0.9  # int8 must be at least 10% faster than the native format at a row count (timing noise)


def split_weights_suffix(spec: str) -> tuple[str, str | None]:
    """`DRAFT@int8` -> ("DRAFT", "int8"): a draft spec may name its own weight format (`--draft`, `--stages`,
    `eval-draft --draft a,a@int8` compares both in one run).  No suffix: (spec, None)."""
    base, sep, fmt = spec.rpartition("@")
    if sep and base and fmt in DRAFT_WEIGHTS:
        return base, fmt
    return spec, None


def check_draft_weights(weights: str, dtype: torch.dtype, device: str) -> None:
    """A clear error for a --draft-weights value the kernels cannot run."""
    if weights not in DRAFT_WEIGHTS:
        raise StagedSpecError(f"unknown --draft-weights {weights!r}: use one of {', '.join(DRAFT_WEIGHTS)}")
    if weights == "mixed" and not str(device).startswith("cpu"):
        raise StagedSpecError(f"--draft-weights mixed runs on the native CPU kernels only; on {device} use native")
    if weights != "int8":
        return
    if not str(device).startswith("cpu"):
        raise StagedSpecError(f"--draft-weights int8 runs on PyTorch's CPU kernels only; on {device} use native")
    if dtype != torch.bfloat16 and native_kernels(quiet=True) is None:  # the native kernels take fp32 too
        raise StagedSpecError("--draft-weights int8 computes in bf16 without the native kernels; use --dtype bf16 "
                              "(fp32 is for reference runs)")


def shares_oracle_layers(draft: Transformer, oracle: Transformer) -> bool:
    """A `layers:N` draft runs the oracle's own layer modules: quantising them would change the oracle."""
    mine = {id(m) for m in oracle.layers}
    return any(id(layer) in mine for layer in draft.layers)


def to_int8(draft: Transformer, oracle: Transformer, max_rows: int | None = None) -> Transformer:
    """`draft` with int8 layers and head, in place (`models.quant.quantize_draft`, plus a head of its own).

    `max_rows`: int8 only for passes of at most that many rows, the dense
    weights above (`models.quant.RowSwitchLinear`); None: int8 always.  A
    draft whose head is a full vocabulary head of its own (an HF or GGUF
    model) gets an int8 copy of it too; a head shared with a bf16 oracle
    stays the oracle's.
    """
    if max_rows is None:
        quantize_draft(draft, oracle)
        if draft.head_q is None and draft.head_weight is not oracle.head_weight:
            draft.head_q = Int8Linear(draft.head_weight.detach(), None)
        return draft
    for layer in draft.layers:
        swap_layers(layer, nn.Linear, lambda lin: RowSwitchLinear(lin.weight.detach(), lin.bias, max_rows))
    fc = getattr(draft, "fc", None)
    if isinstance(fc, nn.Linear):  # a feature draft's fusing layer
        draft.fc = RowSwitchLinear(fc.weight.detach(), fc.bias, max_rows)
    tap_fc = getattr(draft, "tap_fc", None)
    if isinstance(tap_fc, nn.Linear):  # and its taps' (`FeatureDraftModel.feature_taps`)
        draft.tap_fc = RowSwitchLinear(tap_fc.weight.detach(), None, max_rows)
    own_head = getattr(draft, "head", None)
    head = own_head.weight if own_head is not None else draft.head_weight
    if own_head is not None or head is not oracle.head_weight:
        draft.head_q = RowSwitchLinear(head.detach(), None, max_rows)
    return draft


def int8_max_rows(native: dict[int, float], int8: dict[int, float]) -> int:
    """The most rows up to which int8 passes were measured at least `INT8_MARGIN` faster at every row count
    (0: not even one row)."""
    best = 0
    for rows in sorted(native):
        if not int8[rows] < INT8_MARGIN * native[rows]:
            break
        best = rows
    return best


def choose_draft_weights(
    load: Callable[[], Transformer],
    oracle: Transformer,
    weights: str,
    *,
    measure: Callable[[Transformer], dict[int, float]] | None = None,
    cache_file: Path | None = None,
    quiet: bool = False,
    load_mixed: Callable[[], Transformer] | None = None,
) -> Transformer:
    """The draft from `load()`, on the weights `weights` asks for ("auto": the faster on this machine).

    `load_mixed`: the draft in its quantised GGUF's own formats (None: its
    source is not a quantised GGUF).  The chosen format and why are left on
    the draft as `runtime.weight_format` ("native", "int8" or "mixed") and `weight_reason`.  `measure` times a draft's
    passes by row count (default: `profiling.forward_cost_curve` at
    `MEASURED_ROWS`); `cache_file` keeps auto's measured choices (default:
    under the cost-profile folder).
    """
    # deferred: the CLI's parser loads this module (DRAFT_WEIGHTS); feature_draft loads when a draft is chosen
    from stagedspec.models.feature_draft import is_feature_draft

    if weights == "mixed":
        if load_mixed is None:
            raise StagedSpecError("--draft-weights mixed needs a draft GGUF with quantised weights")
        draft = load_mixed()
        check_draft_weights(weights, draft.embed.weight.dtype, str(draft.embed.weight.device))
        return _mark(draft, "mixed", "asked for")
    draft = load()
    dtype, device = draft.embed.weight.dtype, str(draft.embed.weight.device)
    check_draft_weights(weights, dtype, device)
    if weights == "auto" and oracle.quantised and load_mixed is not None and not shares_oracle_layers(draft, oracle):
        return _mixed_or_int8(draft, load_mixed, oracle, measure or _default_measure, cache_file or _cache_file(),
                              quiet)
    if weights == "int8" or (weights == "auto" and oracle.quantised):
        if shares_oracle_layers(draft, oracle) and not oracle.quantised:  # only when int8 is asked for
            raise StagedSpecError("a layers:N draft runs the oracle's own layers: int8 draft weights would "
                                  "change the oracle; use --draft-weights native or --quant int8")
        why = "asked for" if weights == "int8" else "the oracle is quantised"
        return _mark(to_int8(draft, oracle), "int8", why)
    if weights == "native":  # under a quantised oracle its fp32 kernels are not timed yet (`pipeline._load_draft`)
        return _mark(plan_matmuls(draft), "native", "asked for")
    # auto on an unquantised oracle: int8 needs a bf16 CPU pass and a draft of its own layers
    if not device.startswith("cpu") or dtype != torch.bfloat16:
        return _mark(draft, "native", f"{dtype_label(dtype)} on {device}: no int8 kernel applies")
    # a feature draft's timed passes would lack its features; a layers:N draft's layers are the oracle's
    if is_feature_draft(draft) or shares_oracle_layers(draft, oracle):
        return _mark(draft, "native", "a feature or layers:N draft keeps its dtype")
    return _measured_choice(draft, load, oracle, measure or _default_measure, cache_file or _cache_file(), quiet)


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


def _mark(draft: Transformer, fmt: str, reason: str) -> Transformer:
    draft.runtime.weight_format, draft.runtime.weight_reason = fmt, reason
    return draft


def _default_measure(model: Transformer) -> dict[int, float]:
    # deferred: the CLI's parser loads this module (DRAFT_WEIGHTS); profiling loads only to time a draft
    from stagedspec.profiling import forward_cost_curve

    return forward_cost_curve(model, sizes=MEASURED_ROWS, context=256, repeats=7, fixed_width=False)


def _cache_file() -> Path:
    return learned_store() / "draft-weights.json"


def _cache_key(draft: Transformer) -> str:
    # deferred: the CLI's parser loads this module (DRAFT_WEIGHTS); profiling loads only to time a draft
    from stagedspec.profiling import model_fingerprint

    return f"{model_fingerprint(draft)}|{hardware.fingerprint('cpu')}"


def forget_measured_choices(cache_file: Path | None = None) -> None:
    """Drop auto's cached choices (`stagedspec tune` re-measures everything)."""
    measured_cache.forget(cache_file or _cache_file())



def _mixed_or_int8(draft: Transformer, load_mixed: Callable[[], Transformer], oracle: Transformer,
                   measure: Callable[[Transformer], dict[int, float]], cache_file: Path, quiet: bool) -> Transformer:
    """A quantised GGUF draft under a quantised oracle: its own formats or int8, whichever passes of `MIXED_ROWS`
    rows take less time in all on this machine (timed once per draft and machine; cached)."""
    key = _cache_key(draft) + "|mixed"
    entry = measured_cache.read(cache_file).get(key)
    if not isinstance(entry, dict) or entry.get("choice") not in ("mixed", "int8"):
        if not quiet:
            print("stagedspec: timing the draft's own GGUF formats and int8 on this machine (once; cached)...",
                  file=sys.stderr, flush=True)
        mixed = measure(load_mixed())
        int8 = measure(to_int8(draft, oracle))
        rows = [r for r in MIXED_ROWS if r in mixed and r in int8]
        choice = "mixed" if sum(mixed[r] for r in rows) <= sum(int8[r] for r in rows) else "int8"
        entry = {"choice": choice, "mixed_ms": {str(r): round(1e3 * t, 4) for r, t in sorted(mixed.items())},
                 "int8_ms": {str(r): round(1e3 * t, 4) for r, t in sorted(int8.items())}}
        data = measured_cache.read(cache_file)
        data[key] = entry
        measured_cache.write(cache_file, data)
    timings = "; ".join(f"{r} rows {entry['mixed_ms'][r]:.2f} ms GGUF formats, {entry['int8_ms'][r]:.2f} ms int8"
                        for r in map(str, MIXED_ROWS) if r in entry["mixed_ms"] and r in entry["int8_ms"])
    if entry["choice"] == "mixed":
        return _mark(load_mixed(), "mixed", f"the GGUF's own formats, faster here than int8 ({timings})")
    if draft.head_q is None:  # not the copy timed above
        draft = to_int8(draft, oracle)
    return _mark(draft, "int8", f"int8, faster here than the GGUF's own formats ({timings})")


def _measured_choice(draft: Transformer, load: Callable[[], Transformer], oracle: Transformer,
                     measure: Callable[[Transformer], dict[int, float]], cache_file: Path,
                     quiet: bool) -> Transformer:
    """Time the native and int8 drafts by row count (once per draft and machine; cached) and run int8 for
    the passes of up to as many rows as it is faster at (`int8_max_rows`), the native weights above."""
    key = _cache_key(draft)
    entry = measured_cache.read(cache_file).get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("int8_max_rows"), int):
        if not quiet:
            print("stagedspec: timing the draft's bf16 and int8 weights on this machine (once; cached)...",
                  file=sys.stderr, flush=True)
        native = measure(draft)
        int8 = measure(to_int8(draft, oracle))
        entry = {"int8_max_rows": int8_max_rows(native, int8),
                 "native_ms": {str(r): round(1e3 * t, 4) for r, t in sorted(native.items())},
                 "int8_ms": {str(r): round(1e3 * t, 4) for r, t in sorted(int8.items())}}
        data = measured_cache.read(cache_file)
        data[key] = entry
        measured_cache.write(cache_file, data)
        draft = load()  # the timed copy was quantised in place, without its dense weights
    rows = entry["int8_max_rows"]
    timings = "; ".join(f"{r} rows {entry['native_ms'][r]:.2f} ms bf16, {entry['int8_ms'][r]:.2f} ms int8"
                        for r in entry.get("native_ms", {}) if r in entry.get("int8_ms", {}))
    if rows < 1:
        return _mark(draft, "native", f"int8 is not faster on this machine ({timings})")
    return _mark(to_int8(draft, oracle, max_rows=rows), "int8",
                 f"int8 for passes of up to {rows} rows, bf16 above, as measured here ({timings})")
