"""`stagedspec distill` and `stagedspec eval-draft`: train a draft for an oracle, and measure it.

`add_commands(subparsers)` registers both subcommands on the main parser
(called from `stagedspec.cli.commands.build_parser`).

Training text (all offline, never HumanEval):

* plain files: `--corpus FILES...`, by default CPython's stdlib sources and
  the installed Python docs (`stagedspec.training.distill.default_corpus_files`);
* `--chat-wrap F`: for a fraction F of the Python files, every documented
  function becomes a chat exchange in the benchmark's style, the user asking
  to complete its signature + docstring and the assistant answering with the
  whole function in a ```python block, wrapped in the oracle's chat template;
* `--oracle-samples N`: the oracle's own greedy replies to N such requests
  (the text a draft has to predict at serving time), cached per request
  (`--samples-cache`, by default in the work folder) and repeated
  `--sample-repeat` times in the training mix.

The draft is trained on the oracle's next-token distributions over all of it
(see `stagedspec.training.distill`).  Checkpoints, metrics and the sample cache live in
`--work-dir` (default: the output folder), so the output folder can hold just
the draft (`draft_config.json` + `draft.safetensors`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Sequence

from stagedspec.cli.args import (add_draft_run_args, add_renamed_size_flags, add_static_passes_arg, int_at_least,
                                 pass_options_from, take_renamed_size_flags)
from stagedspec.drafters.model import GROWTHS
from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams

# Targets for a default draft, on 20 HumanEval prompts (greedy): top-1 and top-4 agreement, the
# draft's cost per token against the oracle's, and the mean accepted length of a budget-16 tree (in decoding and
# at every reply position; checked only when --tree-budget is 16).
TARGETS = {"top1": 0.60, "top4": 0.80, "draft_cost_ratio": 0.10, "tree_mean_accepted_length": 3.5,
           "tree_every_position": 3.5}
TREE_TARGET_BUDGET = 16
AT_MOST = ("draft_cost_ratio",)  # targets that are upper bounds; the others are lower bounds
# Default --sample-batch per device type: a CPU gains little from more rows, a GPU samples many at a time
# (docs/measurements.md, "Sample batch for distillation on an H100").
SAMPLE_BATCH = {"cpu": 16, "cuda": 256}
SAVE_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int8": "int8"}
SAMPLES_NAME = "oracle_samples.jsonl"  # per-request reply cache (stagedspec.training.reply_cache)
LEGACY_SAMPLES_NAME = "oracle_samples.json"  # the whole-list cache of older versions


# ---------------------------------------------------------------------- argument types
def _layer_list(text: str) -> list[int]:
    """'2,14' -> [2, 14] (argparse type: a malformed list is a usage error)."""
    try:
        out = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one layer number")
    return out


def _float_in(lo: float, hi: float, lo_open: bool = False):  # noqa: ANN202
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < value if lo_open else lo <= value) or not value <= hi or math.isnan(value):
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
        return value

    return parse


def add_commands(subparsers: Any) -> None:
    """Register `distill` and `eval-draft` on the main parser's subparsers."""
    d = subparsers.add_parser(
        "distill", help="train a small draft for an oracle (same tokenizer) by distillation",
        description="Train a draft that shares the oracle's tokenizer and embedding, on the oracle's "
                    "next-token distributions over offline text (never HumanEval).",
    )
    d.add_argument("--oracle", default="default", metavar="SPEC",
                   help="'default' (SmolLM2-135M-Instruct), an HF-format folder, or a .gguf file")
    d.add_argument("--out", required=True, metavar="DIR", help="folder for the draft (draft_config.json + draft.safetensors)")
    d.add_argument("--work-dir", default=None, metavar="DIR",
                   help="folder for checkpoint.pt, metrics.json and the oracle-sample cache (default: --out)")
    d.add_argument("--kind", default="independent", choices=["independent", "feature"],
                   help="independent: the draft reads tokens only; feature: EAGLE-style, it also reads the oracle's "
                        "hidden state at the previous position (see docs/draft.md, 'Feature draft')")
    d.add_argument("--layers", type=int_at_least(1), default=None, metavar="L",
                   help="draft layers, copied from the oracle's (default: 2 for independent, strided from layer 0; "
                        "1 for feature, the oracle's last layers); with --init-from, more layers than the saved "
                        "independent draft has grows it by no-op layers (copies with zeroed output projections); "
                        "default with --init-from: the saved draft's")
    d.add_argument("--ttt-steps", type=int_at_least(1), default=1, metavar="K",
                   help="feature drafts: unroll K steps on the draft's own predicted features when training "
                        "('training-time test'; 1 = off)")
    d.add_argument("--ttt-decay", type=_float_in(0.0, 1.0, lo_open=True), default=0.8, metavar="D",
                   help="loss weight of unrolled step j is D**j")
    d.add_argument("--feature-loss", type=_float_in(0.0, 100.0), default=0.1, metavar="W",
                   help="feature drafts: weight of the smooth-L1 loss between predicted and oracle features")
    d.add_argument("--fc-lr-scale", type=_float_in(0.0, 100.0), default=0.0, metavar="S",
                   help="feature drafts: fc's learning rate is S x --lr (default 0: 1 for a fresh feature draft; for "
                        "one converted from an independent draft, the embeddings' norm over the oracle features')")
    d.add_argument("--feature-taps", type=_layer_list, default=None, metavar="L1,L2",
                   help="feature drafts: also read the normalised inputs of these oracle layers (EAGLE-3's low and "
                        "mid features, e.g. 2,14 of 28), fused by a layer that starts at zero, so a draft grown "
                        "with --init-from computes what it did until trained (see docs/draft.md)")
    d.add_argument("--tap-lr-scale", type=_float_in(0.0, 1000.0, lo_open=True), default=1.0, metavar="S",
                   help="with --feature-taps: the taps' fc learns at S x fc's rate (it starts at zero)")
    d.add_argument("--vocab-top", type=int_at_least(0), default=8192, metavar="V",
                   help="draft head over the V most frequent corpus tokens (0 = the oracle's full head)")
    d.add_argument("--tokens", type=int_at_least(1), default=2_000_000, metavar="N",
                   help="training tokens in total (with --seq-len and --batch-size: the number of steps)")
    d.add_argument("--corpus", nargs="+", default=None, metavar="FILE",
                   help="training text files (default: CPython stdlib sources and installed Python docs)")
    d.add_argument("--resume", action="store_true", help="continue from the work folder's checkpoint")
    d.add_argument("--lr", type=_float_in(0.0, 1.0, lo_open=True), default=1e-3, help="peak learning rate")
    d.add_argument("--min-lr-ratio", type=_float_in(0.0, 1.0), default=0.1,
                   help="cosine decay ends at lr * this ratio on the last step")
    d.add_argument("--seq-len", type=int_at_least(2), default=256, metavar="T")
    d.add_argument("--batch-size", type=int_at_least(1), default=8, metavar="B")
    d.add_argument("--seed", type=int_at_least(0), default=0)
    d.add_argument("--threads", type=int_at_least(1), default=None, metavar="N", help="torch CPU threads")
    d.add_argument("--device", default="cpu", metavar="DEV",
                   help="cpu or cuda: where the oracle (teacher) and the draft train (default: cpu)")
    d.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="run the draft's forward and backward passes under bf16 autocast (weights, gradients and "
                        "optimizer state stay fp32). Default: on with CUDA, off on the CPU, where it pays only "
                        "with native bf16 matmuls (AVX-512 BF16 or AMX); --no-autocast keeps fp32 passes")
    d.add_argument("--max-minutes", type=_float_in(0.0, 1e7, lo_open=True), default=None, metavar="M",
                   help="time box for the training loop: stop after a checkpoint, save the draft so far "
                        "(--resume continues)")
    d.add_argument("--stop-after-steps", type=int_at_least(1), default=None, metavar="S",
                   help="end this call after step S (checkpointed, draft so far saved; the schedule is unchanged "
                        "and --resume continues): the reproducible form of a time-boxed run")
    d.add_argument("--chat-wrap", type=_float_in(0.0, 1.0), nargs="?", const=0.5, default=0.0, metavar="F",
                   help="fraction of the Python files whose documented functions become chat exchanges "
                        "in the oracle's chat template (bare flag: 0.5)")
    d.add_argument("--oracle-samples", type=int_at_least(0), default=0, metavar="N",
                   help="add the oracle's own greedy replies to N chat coding requests built from the documented "
                        "functions of the corpus's Python files (and of --sample-from)")
    d.add_argument("--chat-samples", type=int_at_least(0), default=0, metavar="N",
                   help="add the oracle's own greedy replies to N general prose and chat requests (stories, "
                        "explanations, advice; made offline, none of them a benchmark prompt: "
                        "stagedspec.training.chat_requests)")
    d.add_argument("--sample-from", nargs="+", default=None, metavar="PATH",
                   help="also build oracle requests from the documented functions of these Python files or "
                        "folders (their .py files, tests skipped), e.g. installed packages' source; they are "
                        "not added to the plain-text corpus")
    d.add_argument("--sample-tokens", type=int_at_least(1), default=160, metavar="N", help="reply length cap")
    d.add_argument("--sample-repeat", type=int_at_least(1), default=1, metavar="R",
                   help="copies of each oracle sample in the training mix")
    d.add_argument("--sample-batch", type=int_at_least(1), default=None, metavar="B",
                   help="oracle replies generated B at a time (greedy, batched; default: "
                        f"{SAMPLE_BATCH['cpu']} on the CPU, {SAMPLE_BATCH['cuda']} on CUDA)")
    d.add_argument("--samples-cache", default=None, metavar="FILE",
                   help="the oracle-reply cache, one reply per request, kept across runs (default: "
                        f"WORK_DIR/{SAMPLES_NAME}); share one file between rounds so that only new requests "
                        "are sent to the oracle")
    d.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="continue training a saved draft ('default' or a draft folder) instead of starting from oracle layers; "
                        "with --kind feature, an independent draft becomes a feature draft that computes what it "
                        "did until training teaches it to use the oracle's features")
    d.add_argument("--teacher-top-k", type=int_at_least(1), default=64, metavar="K")
    d.add_argument("--eval-every", type=int_at_least(1), default=50, metavar="S", help="held-out evaluation period (steps)")
    d.add_argument("--checkpoint-every", type=int_at_least(1), default=100, metavar="S")
    d.add_argument("--dtype", default="bf16", choices=["auto", "bf16", "fp32"],
                   help="oracle (teacher) dtype; the draft trains in fp32 either way")
    d.add_argument("--save-dtype", default="bf16", choices=list(SAVE_DTYPE_NAMES),
                   help="format of the saved draft's weights (int8: codes and a scale per group of 32, what the "
                        "CPU kernels run; a quarter of fp32's bytes)")
    d.add_argument("--mlp-width", type=int_at_least(1), default=None, metavar="W",
                   help="keep W of each copied layer's MLP channels (those carrying the most weight): a draft that "
                        "streams fewer bytes than an oracle layer (default: the oracle's width)")
    d.add_argument("--head-from-oracle", action="store_true",
                   help="the restricted head (--vocab-top) is the oracle's own rows, frozen, saved as token ids only "
                        "(EAGLE's shared head: the draft's features live in the oracle's feature space)")
    d.add_argument("--quant", default="none", metavar="Q",
                   help="the teacher's weights: none (dense, --dtype), or auto/mixed/int4/int8 as `generate` runs "
                        "them (a feature draft then learns the features of the oracle users decode with)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_distill)

    e = subparsers.add_parser(
        "eval-draft", help="quality report of a draft against its oracle (HumanEval prompts, chat-formatted)",
        description="Greedy top-1/top-k agreement with the oracle's own greedy continuations of held-out "
                    "HumanEval prompts (overall and by position in the reply), mean accepted length (chain "
                    "and tree) with how often each depth is reached, and cost per token; several drafts "
                    "are compared side by side on the same oracle replies.",
    )
    e.add_argument("--oracle", default="default", metavar="SPEC")
    e.add_argument("--draft", required=True, action="append", metavar="SPEC",
                   help="'default', a draft folder, an HF folder, .gguf or layers:N; repeat it or give a comma "
                        "list to compare drafts side by side (one column each)")
    e.add_argument("--prompts", default="humaneval", metavar="SOURCE",
                   help="'humaneval' (default; never trained on) or a prompt file (.jsonl or blank-line separated)")
    e.add_argument("--n-prompts", type=int_at_least(1), default=20, metavar="N", help="prompts for agreement")
    e.add_argument("--offset", type=int_at_least(0), default=0, metavar="I", help="first prompt")
    e.add_argument("--tokens", type=int_at_least(1), default=128, metavar="N", help="oracle continuation length")
    e.add_argument("--accept-prompts", type=int_at_least(0), default=4, metavar="N",
                   help="prompts decoded with chain and tree speculation for the mean accepted length")
    e.add_argument("--accept-tokens", type=int_at_least(1), default=128, metavar="N")
    e.add_argument("--chain-length", type=int_at_least(1), default=4, metavar="K",
                   help="draft tokens per step for chain speculation")
    e.add_argument("--tree-budget", type=int_at_least(1), default=16, metavar="N")
    e.add_argument("--tree-depth", type=int_at_least(1), default=6, metavar="D")
    e.add_argument("--tree-branching", type=int_at_least(1), default=None, metavar="B", help="(default 4)")
    add_renamed_size_flags(e)
    e.add_argument("--tree-growth", choices=GROWTHS, default="auto",
                   help="how the draft grows its trees, as in decoding: best-first on the host, or level by level "
                        "(EAGLE-2's, one draft pass per level; needs static passes: CUDA, or --static-passes); "
                        "auto (default): what `tree` decodes with on this device (levels on CUDA)")
    add_static_passes_arg(e)  # needed for --tree-growth levels on a CPU
    e.add_argument("--every-position", action=argparse.BooleanOptionalAction, default=True,
                   help="also grow the draft's tree after every prefix of the oracle's replies and report its "
                        "mean accepted length there: the same positions for every draft, far more trees "
                        "(default: on)")
    e.add_argument("--dtype", default="bf16", choices=["auto", "bf16", "fp32"])
    add_draft_run_args(e)  # a SPEC@native / SPEC@int8 suffix sets one draft's: compare both in one run
    e.add_argument("--threads", type=int_at_least(1), default=None, metavar="N")
    e.add_argument("--device", default="cpu", metavar="DEV", help="cpu or cuda (default: cpu)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval_draft)


# ---------------------------------------------------------------------- corpus
def _fraction_pick(key: str, seed: int, fraction: float) -> bool:
    """Deterministic Bernoulli(fraction) draw keyed by a string (stable across runs and machines)."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def documented_functions(source: str) -> list[tuple[str, str]]:
    """(request, full source) of each documented function/method: request = signature + docstring, dedented."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(node.body) < 2 or node.end_lineno is None or doc.end_lineno is None:
            continue  # docstring-only stubs teach nothing about code
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        request = textwrap.dedent("".join(lines[start:doc.end_lineno]))
        full = textwrap.dedent("".join(lines[start:node.end_lineno]))
        if len(full) > 6000:
            continue
        found.append((request, full))
    return found


def chat_instruction(code: str) -> str:
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.bench.prompts import chat_instruction as bench_instruction

    return bench_instruction(code)


def chat_streams(tokenizer: Any, functions: Sequence[tuple[str, str]]) -> list[list[int]]:
    """Chat exchanges "complete this function" -> the function in a ```python block, as token streams."""
    end = "<|im_end|>" if "<|im_end|>" in tokenizer.get_vocab() else ""
    out = []
    for request, full in functions:
        text = tokenizer.apply_chat_template(chat_instruction(request))
        out.append(tokenizer.encode(f"{text}```python\n{full.rstrip()}\n```{end}\n"))
    return out


def sample_requests(files: Sequence[Path], n: int, seed: int, chat: bool = True) -> list[str]:
    """`n` requests in the benchmark's style built from documented stdlib functions (seeded choice).

    `chat`: a chat request ("complete this function"), as the bench asks a chat model; otherwise the
    signature and docstring themselves, the raw prompt the bench gives a base model (no chat template).
    """
    pool: list[str] = []
    for p in files:
        if p.suffix != ".py":
            continue
        for request, full in documented_functions(p.read_text(encoding="utf-8", errors="replace")):
            if 3 <= request.count("\n") <= 30 and not request.lstrip().startswith("@"):
                pool.append(chat_instruction(request) if chat else request)
    random.Random(seed + 7919).shuffle(pool)
    return pool[:n]


def cached_oracle_samples(oracle: Any, tokenizer: Any, requests: Sequence[str], n_tokens: int, cache: Path,
                          fingerprint: str, progress: bool, batch_size: int = 1,
                          log: Any = None, legacy: Path | None = None) -> list[list[int]]:
    """The oracle's greedy replies to `requests` (prompt + reply streams), cached per request in `cache`.

    Only requests the cache has no reply for are sent to the oracle, and each
    finished batch is appended to the cache at once (`stagedspec.training.reply_cache`),
    so later rounds and interrupted runs reuse every reply made so far.  An
    older whole-list cache (`legacy`, by default `oracle_samples.json` beside
    `cache`) is imported when it was made for exactly these requests.
    """
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.training.distill import oracle_samples
    from stagedspec.training.reply_cache import ReplyCache, legacy_streams

    store = ReplyCache(cache, fingerprint, n_tokens, batched=batch_size > 1)
    legacy_inputs: list[Any] = [fingerprint, n_tokens, list(requests)] + ([batch_size] if batch_size > 1 else [])
    legacy_key = hashlib.sha256(json.dumps(legacy_inputs).encode()).hexdigest()[:16]
    if any(r not in store for r in requests):
        old = legacy_streams(legacy or cache.with_name(LEGACY_SAMPLES_NAME), legacy_key, len(requests))
        if old is not None:
            store.add((r, s) for r, s in zip(requests, old) if r not in store)
    missing = list(dict.fromkeys(r for r in requests if r not in store))  # each distinct request once
    if log is not None:
        log(f"oracle replies: {len(requests) - len(missing)} of {len(requests)} cached in {cache}, "
            f"{len(missing)} to generate")
    if missing:
        oracle_samples(oracle, tokenizer, missing, n_tokens, progress=progress, batch_size=batch_size,
                       on_batch=lambda idx, streams: store.add((missing[i], s) for i, s in zip(idx, streams)))
    return [store.get(r) for r in requests]  # type: ignore[misc]


def order_streams(unique: list[list[int]], repeats: dict[int, int], heldout_fraction: float, seed: int) -> list[list[int]]:
    """Shuffle the streams (so the held-out tail is a mix of every source) and add repeated copies up front.

    Copies of a stream are only added when the stream is not in the held-out
    tail, so the held-out metrics never see training text.
    """
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    total = sum(len(s) for s in unique) + sum((r - 1) * len(unique[i]) for i, r in repeats.items())
    tail, acc = set(), 0
    for i in reversed(order):  # a margin over the tail TokenData will cut, so no copy can straddle it
        if acc > 1.5 * heldout_fraction * total + 2048:
            break
        tail.add(i)
        acc += len(unique[i])
    extra = [unique[i] for i, r in sorted(repeats.items()) if i not in tail for _ in range(r - 1)]
    return extra + [unique[i] for i in order]


def request_files(paths: Sequence[str]) -> list[Path]:
    """The Python files of `--sample-from`: files as given, folders walked in sorted order without tests.

    Installed packages are a large offline source of documented functions
    beyond the stdlib's few thousand; their order is fixed so a seed picks
    the same requests on every machine with the same packages.
    """
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.training.distill import check_no_human_eval

    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [f for f in sorted(p.rglob("*.py"))
                    if not any(part in ("test", "tests", "testing") or part.startswith("test_")
                               for part in f.relative_to(p).parts)]
        else:
            raise StagedSpecError(f"--sample-from: no such file or folder: {raw}")
    if not out:
        raise StagedSpecError(f"--sample-from: no Python files in {' '.join(paths)}")
    check_no_human_eval(out)
    return out


def _check_files(paths: Sequence[str]) -> list[Path]:
    out = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.is_file():
            raise StagedSpecError(f"corpus file not found: {raw}")
        out.append(p)
    return out


# ---------------------------------------------------------------------- distill
def cmd_distill(args: argparse.Namespace) -> int:
    import torch

    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.training.chat_requests import general_requests
    from stagedspec.training.distill import (
        DistillConfig,
        check_no_human_eval,
        corpus_streams_from_files,
        default_corpus_files,
        distill,
    )
    from stagedspec.models.draft import save_draft
    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import check_device, resolve_dtype
    from stagedspec.tokenizer import tokenizer_fingerprint

    device = check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    files = _check_files(args.corpus) if args.corpus is not None else default_corpus_files()
    if not files:
        raise StagedSpecError("no corpus files: pass --corpus FILES (no default corpus was found)")
    check_no_human_eval(files)
    if args.sample_from and not args.oracle_samples:
        raise StagedSpecError("--sample-from only adds request sources: give --oracle-samples N too")
    extra_requests = request_files(args.sample_from) if args.sample_from else []  # checked before the slow load
    out = Path(args.out).expanduser()
    work = Path(args.work_dir).expanduser() if args.work_dir else out
    if out.exists() and not out.is_dir():
        raise StagedSpecError(f"--out {out} exists and is not a folder")
    samples_cache = Path(args.samples_cache).expanduser() if args.samples_cache else work / SAMPLES_NAME
    if samples_cache.is_dir():
        raise StagedSpecError(f"--samples-cache {samples_cache} is a folder; give a file path")
    if args.resume and not (work / "checkpoint.pt").is_file():
        raise StagedSpecError(f"nothing to resume: no checkpoint at {work / 'checkpoint.pt'}")

    oracle, tok = load_model(args.oracle, dtype=resolve_dtype(args.dtype, device)[0], device=device,
                             quant=args.quant)
    device_type = torch.device(device).type
    sample_batch = args.sample_batch or SAMPLE_BATCH[device_type]
    autocast = device_type == "cuda" if args.autocast is None else args.autocast
    n_layers = oracle.config.n_layers
    if args.layers is None:
        args.layers = _saved_layers(args.init_from) or (1 if args.kind == "feature" else 2)
    if args.kind != "feature" and args.ttt_steps > 1:
        raise StagedSpecError("--ttt-steps applies to --kind feature only")
    if args.kind != "feature" and args.feature_taps:
        raise StagedSpecError("--feature-taps applies to --kind feature only")
    if args.layers > n_layers:
        raise StagedSpecError(f"--layers {args.layers}: the oracle has only {n_layers} layers")
    if args.seq_len > oracle.config.max_position:
        raise StagedSpecError(f"--seq-len {args.seq_len} exceeds the oracle's context of {oracle.config.max_position}")
    fingerprint = tokenizer_fingerprint(tok)
    log = (lambda *a: None) if args.no_progress else (lambda *a: print(*a, file=sys.stderr, flush=True))

    t0 = time.perf_counter()
    chat = tok.chat_template is not None
    if args.chat_wrap and not chat:
        log("--chat-wrap ignored: the oracle has no chat template (a base model reads the corpus as it is)")
    wrap_fraction = args.chat_wrap if chat else 0.0
    wrap = [p for p in files if p.suffix == ".py" and _fraction_pick(str(p.name) + str(p.parent.name), args.seed, wrap_fraction)]
    wrap_set = set(wrap)
    plain = corpus_streams_from_files([p for p in files if p not in wrap_set], tok)
    functions = []
    for p in wrap:
        functions += documented_functions(p.read_text(encoding="utf-8", errors="replace"))
    chats = chat_streams(tok, functions)
    samples: list[list[int]] = []
    requests: list[str] = []
    if args.oracle_samples:
        requests = sample_requests(files + extra_requests, args.oracle_samples, args.seed, chat=chat)
        if not requests:
            raise StagedSpecError("--oracle-samples: the corpus has no documented Python functions to ask about")
    if args.chat_samples:
        if not chat:
            raise StagedSpecError("--chat-samples needs an oracle with a chat template")
        requests += general_requests(args.chat_samples, args.seed)
    if requests:
        samples = cached_oracle_samples(oracle, tok, requests, args.sample_tokens, samples_cache,
                                        fingerprint, progress=not args.no_progress, batch_size=sample_batch, log=log,
                                        legacy=work / LEGACY_SAMPLES_NAME)
    unique = plain + chats + samples
    repeats = {len(plain) + len(chats) + i: args.sample_repeat for i in range(len(samples))}
    cfg = DistillConfig(
        layers=args.layers, vocab_top=args.vocab_top, tokens=args.tokens, seq_len=args.seq_len,
        batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio, seed=args.seed,
        teacher_top_k=args.teacher_top_k, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        out=str(work), fingerprint=fingerprint, init_from=args.init_from, kind=args.kind, ttt_steps=args.ttt_steps,
        ttt_decay=args.ttt_decay, feature_loss=args.feature_loss, fc_lr_scale=args.fc_lr_scale,
        save_dtype=SAVE_DTYPE_NAMES[args.save_dtype], mlp_width=args.mlp_width or 0,
        head_from_oracle=args.head_from_oracle, feature_taps=args.feature_taps, tap_lr_scale=args.tap_lr_scale,
    )
    streams = order_streams(unique, repeats, cfg.heldout_fraction, args.seed)
    n_tok = [sum(map(len, s)) for s in (plain, chats, samples)]
    log(f"corpus: {len(files)} files ({len(wrap)} chat-wrapped into {len(chats)} exchanges), "
        f"{len(samples)} oracle samples x{args.sample_repeat}; tokens plain {n_tok[0]}, chat {n_tok[1]}, "
        f"samples {n_tok[2]} ({time.perf_counter() - t0:.0f} s)")
    log(f"training a {cfg.kind} draft ({cfg.layers} layers"
        + (f", {cfg.ttt_steps} unrolled steps" if cfg.ttt_steps > 1 else "") + ")"
        + f": {cfg.total_steps} steps of {cfg.tokens_per_step} tokens on {device}"
        + (" (bf16 autocast)" if autocast else "")
        + (f", time box {args.max_minutes:g} min" if args.max_minutes else ""))

    student = distill(oracle, tok, streams, cfg, resume=args.resume, progress=not args.no_progress,
                      stop_after_steps=args.stop_after_steps, max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
                      autocast=autocast)
    meta = dict(student.training_meta)
    meta["complete"] = meta.get("steps_done", 0) >= cfg.total_steps
    meta["corpus"] = {"files": len(files), "chat_wrap": args.chat_wrap, "chat_exchanges": len(chats),
                      "oracle_samples": len(samples), "chat_samples": args.chat_samples,
                      "sample_tokens": args.sample_tokens,
                      "sample_repeat": args.sample_repeat, "tokens_plain": n_tok[0], "tokens_chat": n_tok[1],
                      "tokens_samples": n_tok[2], "sample_from": list(args.sample_from or [])}
    meta["teacher_dtype"] = args.dtype
    meta["device"] = device
    meta["autocast"] = "bf16" if autocast else "off"
    meta["teacher_quant"] = args.quant
    save_draft(student, out, fingerprint, meta, dtype=cfg.save_dtype)
    last = meta.get("history", [{}])[-1] if meta.get("history") else {}
    state = "complete" if meta["complete"] else "stopped early; continue with --resume"
    print(f"draft saved to {out} ({meta.get('steps_done')}/{cfg.total_steps} steps, {state}); "
          f"held-out KL {last.get('heldout_kl', float('nan')):.4f}, top-1 {last.get('heldout_top1', float('nan')):.3f}")
    return 0


# ---------------------------------------------------------------------- eval-draft
def draft_specs(values: Sequence[str]) -> list[str]:
    """The drafts of `--draft A --draft B,C`: in order, comma lists split, repeats dropped."""
    out: list[str] = []
    for raw in values:
        for spec in raw.split(","):
            spec = spec.strip()
            if spec and spec not in out:
                out.append(spec)
    if not out:
        raise StagedSpecError("--draft: no draft given")
    return out


def cmd_eval_draft(args: argparse.Namespace) -> int:
    import torch

    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.bench.prompts import load_prompts
    from stagedspec.training.distill import decode_step_seconds, oracle_greedy_continuations
    from stagedspec.pipeline import Pipeline, SpeculationConfig, check_device, load_draft_model

    take_renamed_size_flags(args)
    if args.tree_branching is None:
        args.tree_branching = 4
    device = check_device(args.device)
    drafts = draft_specs(args.draft)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.n_prompts, args.offset)
    if not prompts:
        raise StagedSpecError(f"no prompts in {args.prompts} from offset {args.offset}")
    spec = dict(tree_budget=args.tree_budget, tree_depth=args.tree_depth, tree_branching=args.tree_branching,
                chain_length=args.chain_length, tree_growth=args.tree_growth)
    pipe = Pipeline.load(args.oracle, drafts[0], speculation=SpeculationConfig(method="chain", **spec),
                         dtype=args.dtype, device=device, draft_weights=args.draft_weights, draft_vocab=args.draft_vocab,
                         pass_options=pass_options_from(args))  # --static-passes: the drafts run as the oracle
    models = [pipe.draft_model] + [load_draft_model(d, pipe.model, pipe.tokenizer, pipe.dtype, pipe.device,
                                                    args.draft_weights, args.draft_vocab) for d in drafts[1:]]
    chat = pipe.tokenizer.chat_template is not None  # as the bench: base models get the raw prompt
    streams = [pipe.encode(chat_instruction(p) if chat else p, chat=chat) for p in prompts]
    # One set of oracle replies and one oracle timing for every draft: the columns differ only by the draft.
    continuations = oracle_greedy_continuations(pipe.model, streams, args.tokens)
    context = list(streams[0])[-32:] if streams and len(streams[0]) else [0]
    oracle_s = decode_step_seconds(pipe.model, context, torch.bfloat16)
    ar_speed = None
    reports = []
    for name, model in zip(drafts, models):
        pipe.draft_models, pipe.draft_model = [model], model
        report, ar_speed = _eval_one_draft(args, pipe, model, streams, continuations, oracle_s, spec, ar_speed)
        report.update(oracle=args.oracle, draft=name, prompts=args.prompts, n_prompts=len(streams),
                      tokens=args.tokens, offset=args.offset, device=device,
                      weights=model.runtime.weight_format,
                      weights_reason=model.runtime.weight_reason)
        reports.append(report)
    if args.json:
        out: Any = reports[0] if len(reports) == 1 else {"oracle": args.oracle, "drafts": reports}
        print(json.dumps(out, indent=1))
        return 0
    source = "HumanEval" if args.prompts == "humaneval" else args.prompts
    where = (f"{reports[0]['positions']} positions, {source} prompts {args.offset}..{args.offset + len(streams) - 1} "
             f"({'chat-formatted' if chat else 'raw text'}), oracle greedy continuations of {args.tokens} tokens")
    if len(reports) == 1:
        _print_one(args, reports[0], where)
    else:
        print(f"{len(reports)} drafts vs oracle {args.oracle}: {where}")
        print(_comparison_table(args, reports))
    return 0


def _eval_one_draft(args: argparse.Namespace, pipe: Any, model: Any, streams: list[list[int]],
                    continuations: list[list[int]], oracle_s: float, spec: dict[str, int],
                    ar_speed: float | None) -> tuple[dict[str, Any], float | None]:
    """One draft's report: agreement (overall and by reply position), accepted lengths per depth, speed, cost."""
    import torch

    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.training.distill import depth_reach, eval_draft
    from stagedspec.pipeline import SpeculationConfig

    with torch.inference_mode():
        report: dict[str, Any] = eval_draft(pipe.model, model, streams, args.tokens, timing_dtype=torch.bfloat16,
                                            continuations=continuations, oracle_seconds=oracle_s)
    if args.every_position:
        # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
        from stagedspec.tree_acceptance import tree_acceptance_everywhere

        everywhere = tree_acceptance_everywhere(model, streams, continuations, tree_budget=args.tree_budget,
                                                max_depth=args.tree_depth, branching=args.tree_branching,
                                                growth=args.tree_growth)
        if everywhere is not None:  # None: a feature draft (its trees need a decoding run's oracle features)
            report["tree_every_position"] = everywhere
    accept: dict[str, Any] = {}
    methods = ("chain", "tree") + (("ar",) if ar_speed is None else ())
    for method in (methods if args.accept_prompts else ()):
        pipe.speculation = SpeculationConfig(method=method, **spec)
        lengths: list[int] = []
        new, seconds = 0, 0.0
        for ids in streams[: args.accept_prompts]:
            st = pipe.generate(ids, max_new_tokens=args.accept_tokens, sampling=SamplingParams()).stats
            lengths += st.accepted_lengths
            new += st.new_tokens
            seconds += st.seconds
        steps = len(lengths)
        depth = {"chain": args.chain_length, "tree": args.tree_depth}.get(method, 0)
        accept[method] = {"mean_accepted_length": (sum(lengths) + steps) / steps if steps else 0.0,
                          "tokens_per_second": new / seconds if seconds else 0.0, "new_tokens": new,
                          "depth_reach": depth_reach(lengths, depth) if depth else []}
    if accept:
        ar_speed = accept.pop("ar")["tokens_per_second"] if "ar" in accept else ar_speed
        report["chain_mean_accepted_length"] = accept["chain"]["mean_accepted_length"]
        report["tree_mean_accepted_length"] = accept["tree"]["mean_accepted_length"]
        # depth_reach[d-1]: share of oracle steps whose accepted path reaches depth d (1 + their sum = the mean)
        report["chain_depth_reach"] = accept["chain"]["depth_reach"]
        report["tree_depth_reach"] = accept["tree"]["depth_reach"]
        report["speed"] = {"ar": ar_speed, **{m: v["tokens_per_second"] for m, v in accept.items()}}
        report["accept_prompts"] = min(args.accept_prompts, len(streams))
    report["targets"] = targets_met(report, args.tree_budget)
    return report, ar_speed


def targets_met(report: dict[str, Any], tree_budget: int) -> dict[str, dict[str, Any]]:
    """{figure: {"target", "value", "met"}} for each of `TARGETS` the report has (the tree's at budget 16 only)."""
    out = {}
    for key, target in TARGETS.items():
        if key not in report or (key.startswith("tree") and tree_budget != TREE_TARGET_BUDGET):
            continue
        value = report[key]["mean_accepted_length"] if key == "tree_every_position" else report[key]
        met = value <= target if key in AT_MOST else value >= target
        out[key] = {"target": target, "value": value, "met": met}
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _reach(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _print_one(args: argparse.Namespace, report: dict[str, Any], where: str) -> None:
    def ok(key: str) -> str:  # "   (target >= 60%: not met)" after a figure that has a target
        t = report["targets"].get(key)
        if t is None:
            return ""
        bound = f"{t['target']:.0%}" if key in ("top1", "top4") else f"{t['target']:g}"
        return f"   (target {'<=' if key in AT_MOST else '>='} {bound}: {'met' if t['met'] else 'not met'})"

    print(f"draft {report['draft']} vs oracle {args.oracle}: {where}")
    print(f"  top-1 agreement   {report['top1']:6.1%}{ok('top1')}")
    print(f"  top-2 coverage    {report['top2']:6.1%}")
    print(f"  top-4 coverage    {report['top4']:6.1%}{ok('top4')}")
    print(f"  top-8 coverage    {report['top8']:6.1%}")
    print("  by reply position " + "; ".join(
        f"{name} ({b['positions']}): top-1 {_pct(b['top1'])}, top-4 {_pct(b['top4'])}"
        for name, b in report["by_position"].items()))
    if "speed" in report:
        print(f"  mean accepted length (tokens per oracle step, greedy, {report['accept_prompts']} prompts x "
              f"{args.accept_tokens} tokens): chain k={args.chain_length} {report['chain_mean_accepted_length']:.2f}, "
              f"tree budget={args.tree_budget} {report['tree_mean_accepted_length']:.2f}"
              f"{ok('tree_mean_accepted_length')}")
        print(f"  depth reached (share of steps, depth 1..): chain {_reach(report['chain_depth_reach'])}; "
              f"tree {_reach(report['tree_depth_reach'])}")
        sp = report["speed"]
        print(f"  speed (tokens/s): ar {sp['ar']:.1f}, chain {sp['chain']:.1f}, tree {sp['tree']:.1f}")
    if "tree_every_position" in report:
        ev = report["tree_every_position"]
        print(f"  tree budget={args.tree_budget} ({ev['growth']}, depth {args.tree_depth}) after every reply prefix "
              f"({ev['trees']} trees, {ev['draft_passes_per_tree']:.1f} draft passes each): mean accepted length "
              f"{ev['mean_accepted_length']:.2f}; depth reached {_reach(ev['depth_reach'])}{ok('tree_every_position')}")
    print(f"  cost per token    draft {report['draft_ms_per_token']:.2f} ms / oracle {report['oracle_ms_per_token']:.2f} ms "
          f"= {report['draft_cost_ratio']:.3f} in {report['timing_dtype']}{ok('draft_cost_ratio')}")
    print(f"  draft weights     {report.get('weights', 'native')} ({report.get('weights_reason', '')})")


def _column_names(specs: list[str]) -> list[str]:
    """Short column headers: a folder's last part where that is unambiguous, else the spec as given."""
    short = [Path(s).name or s for s in specs]
    return short if len(set(short)) == len(short) else list(specs)


def _comparison_table(args: argparse.Namespace, reports: list[dict[str, Any]]) -> str:
    """One row per figure, one column per draft."""
    rows: list[tuple[str, list[str]]] = []
    col = lambda f: [f(r) for r in reports]  # noqa: E731
    for k in (1, 2, 4, 8):
        rows.append((f"top-{k}", col(lambda r, k=k: f"{r[f'top{k}']:.1%}")))
    for name in reports[0]["by_position"]:
        for k in (1, 4):
            label = f"top-{k} @ reply {name} ({reports[0]['by_position'][name]['positions']})"
            rows.append((label, col(lambda r, n=name, k=k: _pct(r["by_position"][n][f"top{k}"]))))
    if "speed" in reports[0]:
        rows.append((f"mean accepted, chain k={args.chain_length}",
                     col(lambda r: f"{r['chain_mean_accepted_length']:.2f}")))
        for d in range(len(reports[0]["chain_depth_reach"])):
            rows.append((f"  chain reaches depth {d + 1}", col(lambda r, d=d: _reach(r["chain_depth_reach"][d:d + 1]))))
        rows.append((f"mean accepted, tree {args.tree_budget}", col(lambda r: f"{r['tree_mean_accepted_length']:.2f}")))
        for d in range(len(reports[0]["tree_depth_reach"])):
            rows.append((f"  tree reaches depth {d + 1}", col(lambda r, d=d: _reach(r["tree_depth_reach"][d:d + 1]))))
        rows.append(("tok/s chain", col(lambda r: f"{r['speed']['chain']:.1f}")))
        rows.append(("tok/s tree", col(lambda r: f"{r['speed']['tree']:.1f}")))
        rows.append(("tok/s ar (oracle alone)", col(lambda r: f"{r['speed']['ar']:.1f}")))
    if all("tree_every_position" in r for r in reports):
        trees = reports[0]["tree_every_position"]["trees"]
        growth = reports[0]["tree_every_position"]["growth"]
        rows.append((f"mean accepted, tree {args.tree_budget}, every position ({trees} trees, {growth}, "
                     f"depth {args.tree_depth})",
                     col(lambda r: f"{r['tree_every_position']['mean_accepted_length']:.2f}")))
    rows.append((f"cost ({reports[0]['timing_dtype']}, draft/oracle)", col(lambda r: f"{r['draft_cost_ratio']:.3f}")))
    rows.append(("draft ms/token", col(lambda r: f"{r['draft_ms_per_token']:.2f}")))
    rows.append(("draft weights", col(lambda r: r.get("weights", "native"))))
    rows.append(("draft targets met", col(lambda r: f"{sum(t['met'] for t in r['targets'].values())}"
                                                        f"/{len(r['targets'])}")))
    headers = _column_names([r["draft"] for r in reports])
    width0 = max(len(label) for label, _ in rows)
    widths = [max(len(h), *(len(vals[i]) for _, vals in rows)) for i, h in enumerate(headers)]
    lines = ["  " + " " * width0 + "".join(f"  {h:>{w}}" for h, w in zip(headers, widths))]
    lines += ["  " + f"{label:<{width0}}" + "".join(f"  {v:>{w}}" for v, w in zip(vals, widths)) for label, vals in rows]
    return "\n".join(lines)


def _saved_layers(init_from: str | None) -> int | None:
    """How many layers the `--init-from` draft has (None without one, or when its folder is unreadable: the
    distillation's own checks then name the problem)."""
    if not init_from:
        return None
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.models.draft import default_draft_dir, read_draft_config

    try:
        folder = default_draft_dir() if init_from == "default" else Path(init_from).expanduser()
        return len(read_draft_config(folder)["oracle_layers"])
    except Exception:  # noqa: BLE001 - reported by the distillation with its own message
        return None
