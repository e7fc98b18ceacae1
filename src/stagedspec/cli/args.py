"""Command-line arguments shared by several commands, declared once (generate, tune, serve, check, bench).

Here rather than in `cli/commands.py`, so that the commands kept in modules of their own (`cli.serve`,
`cli.distill`, `bench.run`, `check`) take them without importing `cli.commands`, which imports those modules to
build its parser."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from stagedspec.draft_weights import DRAFT_WEIGHTS
from stagedspec.drafters.model import GROWTHS
from stagedspec.methods import METHODS
from stagedspec.models.quant import QUANT_CHOICES, resolve_quant
from stagedspec.pass_options import PassOptions
from stagedspec.speculation import (QUANTISED_DEFAULTS, RENAMED_SIZES, SIZINGS, SpeculationConfig, choose_sizing,
                                    renamed_size_notice)


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `lo`, else argparse's one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)  # counts: tokens, nodes, requests, threads
non_negative_int = int_at_least(0)  # where 0 means something: --top-k 0 (off), --seed 0


def add_quant_arg(p: argparse.ArgumentParser) -> None:
    """`--quant`: the oracle's weight format."""
    p.add_argument("--quant", default="auto", choices=QUANT_CHOICES,
                   help="oracle weights: auto (default: a quantised GGUF source runs on its own 4-bit codes, int8 "
                        "for its 5- to 8-bit layers, on a CPU; anything else unquantised), mixed (that, forced), "
                        "int4 or int8 (every layer; groups of 32), or none (dequantised). The output head runs "
                        "int8 whenever the layers are quantised")


def threads_value(text: str) -> str | int:
    """`--threads`: "auto" or a positive count."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}") from None


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """`--threads`: how many CPU threads decode."""
    p.add_argument("--threads", type=threads_value, default="auto",
                   help="CPU threads: auto (default: PyTorch's count, the CPUs this process may use; for models "
                        "on the native kernels, whose results do not depend on it, fewer while other processes "
                        "keep some busy, re-read every 0.25 s) or a fixed count")


def add_oracle_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--oracle", default="default", metavar="SPEC",
                   help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma-3-270m, Q4_K_M), "
                        "'qwen2.5-coder-1.5b' / 'qwen2.5-coder-0.5b' (installed part packages), an HF-format folder, "
                        "or a .gguf file")


def add_device_dtype_args(p: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help=dtype_help or "weights/activations dtype; auto (default): bf16 where the hardware computes "
                                      "it natively (AVX-512 BF16 or AMX CPUs, CUDA GPUs with bf16), else fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_oracle_arg(p)
    add_device_dtype_args(p)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: replay each static-shape pass as a CUDA graph (default on; --no-cuda-graphs "
                        "launches the same passes eagerly)")
    p.add_argument("--compile", action="store_true",
                   help="static-shape passes (CUDA, or --static-passes on a CPU) through torch.compile: fewer, fused "
                        "kernels; tens of seconds of compiling per pass shape the first time (cached on disk)")
    add_static_passes_arg(p)


def add_static_passes_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--static-passes", action="store_true",
                   help="CPU: run the static-shape pass path (fixed row buckets, the whole cache as keys), as on CUDA")


def pass_options_from(args: argparse.Namespace) -> PassOptions:
    """The one `PassOptions` a command loads its models with: the environment's defaults
    (`PassOptions.from_environment`) under its `--no-cuda-graphs`, `--static-passes` and `--compile`."""
    env = PassOptions.from_environment()
    return dataclasses.replace(
        env,
        cuda_graphs=env.cuda_graphs and getattr(args, "cuda_graphs", True) is not False,
        static_on_cpu=env.static_on_cpu or bool(getattr(args, "static_passes", False)),
        compile=env.compile or bool(getattr(args, "compile", False)),
    )


def add_draft_run_args(p: argparse.ArgumentParser) -> None:
    """How draft models run: their weight format and the vocabulary their head computes."""
    p.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                   help="draft model weights: native (the --dtype), int8 (CPU, bf16), mixed (a quantised GGUF "
                        "draft's own formats, CPU), or auto (default): with --quant, int8, or for a quantised GGUF "
                        "draft whichever of mixed and int8 this machine runs faster; with a bf16 oracle on a CPU "
                        "whichever of native and int8 runs faster; timed once and cached (serve: native, since its "
                        "batched passes run many rows); the output never depends on it")
    p.add_argument("--draft-vocab", default="auto", metavar="auto|full|FILE",
                   help="the tokens a GGUF, HF or layers:N draft's head computes: auto (default; the frequency-"
                        "ranked subset bundled for the oracle's tokenizer, where there is one: 24,576 of "
                        "Qwen2.5's 151,936 tokens), full, or a file of token ids (a JSON list or one per line); "
                        "a SPEC@full suffix sets one draft's; the output never depends on it")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    d = SpeculationConfig()  # one source of defaults for the CLI, the bench and the library
    q = QUANTISED_DEFAULTS
    p.add_argument("--draft", default=None, metavar="SPEC",
                   help="draft model: a distilled draft folder, an HF folder, a .gguf, or layers:N "
                        "(the oracle's first N layers)")
    add_draft_run_args(p)
    p.add_argument("--method", default=None, choices=["auto", "ar", "chain", "tree", "lookup", "staged"],
                   help="auto (each step, whichever of the others this machine's measured costs and the "
                        "acceptance so far make fastest; never knowingly slower than ar), ar (plain decoding), "
                        "chain (k draft tokens), tree (best-first token tree), lookup (prompt lookup / n-gram "
                        "drafts, no draft model), staged (oracle <- draft <- lookup); tree, lookup and staged pick "
                        "their sizes each step unless one is given (--sizing); default: staged with "
                        "--stages, else auto (with the shipped draft for the default oracle)")
    p.add_argument("--ngram", default=None, metavar="SPEC",
                   help="n-gram for lookup/staged/auto: 'default' (built once from the Python stdlib; what "
                        "staged and auto use) or a file")
    p.add_argument("--stages", default=None, metavar="LIST",
                   help="comma-separated chain, oracle first: e.g. default,DRAFT,context+ngram "
                        "(bottom: ngram, ngram:FILE, context, or a '+' mix)")
    p.add_argument("--no-context", action="store_true", help="no prompt lookup at the bottom stage")
    p.add_argument("--lookup-length", type=positive_int, default=None, metavar="K",
                   help=f"tokens per lookup chain (default {d.lookup_length}; "
                        f"{q['lookup_length']} with --quant, 1 for lookup)")
    p.add_argument("--stage-length", type=positive_int, default=None, metavar="K",
                   help=f"tokens each model stage decodes per proposal, staged (default {d.stage_length}; "
                        f"{q['stage_length']} with --quant)")
    p.add_argument("--stage-branching", type=positive_int, default=None, metavar="B",
                   help=f"alternatives per position in a stage's proposal, spine included (staged; default "
                        f"{d.stage_branching})")
    p.add_argument("--oracle-lookup-length", type=positive_int, default=None, metavar="K",
                   help="staged: tokens of the prompt-lookup chain merged into the oracle's tree (default: "
                        "--lookup-length; 8 in bf16 on a CPU with native bf16, where rows are nearly free)")
    p.add_argument("--no-oracle-lookup", action="store_true",
                   help="staged: do not merge the prompt-lookup chain into the oracle's tree (the paper's pure chain)")
    p.add_argument("--bit-exact", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy output bit-identical to plain decoding with the same flag, for every method, in "
                        "bf16: only tokens verified on slot-aligned rows are kept, and on a CPU attention runs one "
                        "token at a time (costs 10-20%% of plain decoding), on CUDA every pass runs 64 rows "
                        "(0.91x plain decoding on an H200, faster speculation). Default: on for a bf16/fp16 oracle "
                        "on CUDA, off elsewhere (the native kernels are row-exact anyway)")
    p.add_argument("--adaptive-budget", action="store_true",
                   help="tree: each step verify only the best nodes that pay for themselves, priced by a "
                        "measured cost curve of this machine (--tree-budget is then the most)")
    p.add_argument("--tree-growth", choices=GROWTHS, default=d.tree_growth,
                   help="tree: grow best-first on the host, or level by level on the device with one copy back "
                        "(needs static passes); auto: levels on CUDA, best-first on a CPU")
    p.add_argument("--tree-budget", type=positive_int, default=None, metavar="N",
                   help=f"tree nodes per step (default {d.tree_budget}; {q['tree_budget']} with --quant)")
    p.add_argument("--tree-depth", type=positive_int, default=None, metavar="D",
                   help=f"maximum tree depth (default {d.tree_depth}; {q['tree_depth']} with --quant)")
    p.add_argument("--tree-branching", type=positive_int, default=None, metavar="B",
                   help=f"children considered per node (tree; default {d.tree_branching})")
    p.add_argument("--sizing", choices=SIZINGS, default=None,
                   help="tree, lookup, staged: 'measured' (the default when no size flag of the method is given) "
                        "chooses each step plain decoding or one of the method's sizes by this machine's measured "
                        "costs and the acceptance so far, so the method is never knowingly slower than ar; "
                        "'fixed' runs the sizes the flags give (their defaults if none), every step")
    p.add_argument("--chain-length", type=positive_int, default=None, metavar="K",
                   help=f"draft tokens per step for --method chain (default {d.chain_length}; "
                        f"{q['chain_length']} with --quant)")
    add_renamed_size_flags(p)


def add_renamed_size_flags(p: argparse.ArgumentParser) -> None:
    """The sizes' old flag names (`RENAMED_SIZES`), hidden; `take_renamed_size_flags` moves what they give to
    the new names."""
    for old in RENAMED_SIZES:
        p.add_argument("--" + old.replace("_", "-"), dest="renamed_" + old, type=positive_int, default=None,
                       help=argparse.SUPPRESS)


def take_renamed_size_flags(args: argparse.Namespace) -> None:
    """Each old size flag given: a one-line notice on stderr, and its value under the new name (the new flag
    wins when both are given)."""
    import sys

    for old, new in RENAMED_SIZES.items():
        value = getattr(args, "renamed_" + old, None)
        if value is not None:
            print(f"stagedspec: {renamed_size_notice(old, flags=True)}", file=sys.stderr)
            if getattr(args, new, None) is None:
                setattr(args, new, value)


def speculation_from(args: argparse.Namespace):  # noqa: ANN201
    """(oracle spec, draft specs, SpeculationConfig) from the shared speculation flags."""
    take_renamed_size_flags(args)
    # deferred: model_set loads the model loaders and tokenizers; building the parser needs neither
    from stagedspec.model_set import check_draft_choices, parse_stages

    oracle, drafts, ngram, context = args.oracle, [args.draft] if args.draft else [], args.ngram, not args.no_context
    if args.stages:
        oracle, drafts, stage_ngram, stage_context = parse_stages(args.stages.split(","))
        ngram, context = stage_ngram or ngram, stage_context and context
        method = args.method or "staged"
    else:
        method = args.method or "auto"
        if method in METHODS and METHODS[method].default_ngram and ngram is None and not args.no_context:
            ngram = "default"
    sizes = dict(tree_budget=args.tree_budget, tree_depth=args.tree_depth, tree_branching=args.tree_branching,
                 chain_length=args.chain_length, lookup_length=args.lookup_length,
                 stage_length=args.stage_length, stage_branching=args.stage_branching,
                 oracle_lookup_length=args.oracle_lookup_length,
                 # flags that are off unless given: None when not given, so they name no size
                 oracle_lookup=False if args.no_oracle_lookup else None,
                 adaptive_budget=True if args.adaptive_budget else None)
    sizing = choose_sizing(method, args.sizing, sizes)
    check_draft_choices(method, drafts, getattr(args, "draft_vocab", "auto"))  # before resolve_quant reads the oracle
    args.quant = resolve_quant(args.quant, oracle, getattr(args, "device", "cpu"))
    spec = SpeculationConfig.tuned(method, args.quant, getattr(args, "device", "cpu"), ngram=ngram, context=context,
                                   dtype=getattr(args, "dtype", None), tree_growth=args.tree_growth, sizing=sizing,
                                   **sizes)
    return oracle, drafts, spec
