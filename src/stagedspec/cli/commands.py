"""`stagedspec` command line.

Every user-caused problem surfaces as a one-line `stagedspec: error: ...`
and exit code 2; a traceback means a bug in stagedspec.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn, Sequence

from stagedspec.cli.args import (add_draft_run_args, add_model_args, add_quant_arg, add_speculation_args,
                                 add_threads_arg, non_negative_int, pass_options_from, positive_int,
                                 speculation_from)
from stagedspec.cli.check import add_check_command
from stagedspec.cli.constraints import add_constraint_args, controls_from
from stagedspec.cli.distill import add_commands as add_distill_commands
from stagedspec.cli.export import add_commands as add_export_commands
from stagedspec.cli.serve import add_commands as add_serve_commands
from stagedspec.draft_weights import forget_measured_choices
from stagedspec.errors import StagedSpecError
from stagedspec.hardware import AMX_ISA_CAP, cap_isa_for_bit_exact
from stagedspec.methods import METHODS
from stagedspec.kernels.pair_rows import forget_measured_pair_rows
from stagedspec.kernels.prefetch import forget_measured_distance
from stagedspec.kernels.tile_rows import forget_measured_tile_rows
from stagedspec.models.matmul_plan import describe, forget_measured_plans
from stagedspec.models.quant import resolve_quant
from stagedspec.sampling import SamplingParams


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments are one line on stderr (exit status 2), not argparse's usage block; `--help` has the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1]")
    p.add_argument("--seed", type=non_negative_int, default=None, metavar="S")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="stagedspec", description="Exact staged speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="prompt text ('-' reads stdin)")
    add_model_args(gen)
    add_quant_arg(gen)
    add_threads_arg(gen)
    add_speculation_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stop", action="append", default=[], metavar="STR",
                     help="stop string (repeatable): the text is cut where the earliest one begins")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--show-stages", action="store_true",
                     help="after generating, show the text coloured by the stage that proposed each token")
    add_constraint_args(gen)
    gen.set_defaults(func=cmd_generate)

    ngram = sub.add_parser("ngram", help="n-gram drafters: build")
    ngram_sub = ngram.add_subparsers(dest="ngram_command", required=True)
    build = ngram_sub.add_parser("build", help="build a Katz-backoff n-gram file for a tokenizer")
    build.add_argument("--tokenizer", default="default", metavar="SPEC",
                       help="model whose tokenizer the n-gram is for (default, HF folder or .gguf)")
    src = build.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-text", nargs="+", metavar="FILE", help="corpus text files")
    src.add_argument("--from-stdlib", action="store_true", help="the CPython stdlib sources on this machine")
    src.add_argument("--from-samples", metavar="SPEC",
                     help="text sampled from this model (a draft or oracle spec; the paper's recipe)")
    build.add_argument("--tokens", type=positive_int, default=200_000, help="tokens to sample with --from-samples")
    build.add_argument("--temperature", type=float, default=1.5, help="sampling temperature for --from-samples")
    build.add_argument("--order", type=positive_int, default=3, help="n-gram order (2..5)")
    build.add_argument("--out", required=True, metavar="FILE")
    build.set_defaults(func=cmd_ngram_build)

    bench = sub.add_parser("bench-engine", help="autoregressive speed vs transformers and the bandwidth roofline")
    add_model_args(bench)
    bench.add_argument("--dtypes", default="bf16,fp32,int4", help="comma-separated weight formats to measure: bf16, "
                       "fp32, int8, int4 (quantised weights with bf16 compute; transformers runs bf16 for those)")
    bench.add_argument("--n-prompts", type=positive_int, default=3)
    bench.add_argument("--max-new-tokens", type=positive_int, default=128)
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--tree-cost", action="store_true",
                       help="also print the cost of one oracle forward vs the number of tree nodes (1..64)")
    bench.set_defaults(func=cmd_bench_engine)

    tune = sub.add_parser("tune", help="measure this machine's pass costs for --method auto (cached; "
                                       "measured anyway at first use)")
    add_model_args(tune)
    tune.add_argument("--draft", default="default", metavar="SPEC",
                      help="draft model(s) to measure too, comma-separated ('none' for none; default: the shipped "
                           "draft, for the default oracle)")
    add_quant_arg(tune)
    add_threads_arg(tune)
    add_draft_run_args(tune)
    tune.add_argument("--reset", action="store_true",
                      help="first forget everything this machine learned, for every model (cost profiles, "
                           "auto's learned state, matmul plans, draft weight formats), then measure again")
    tune.set_defaults(func=cmd_tune)

    # deferred: a cycle through stagedspec.cli's __init__ (bench.run imports cli.args at its top)
    from stagedspec.bench.run import add_bench_command

    add_bench_command(sub)
    add_check_command(sub)
    add_distill_commands(sub)
    add_export_commands(sub)
    add_serve_commands(sub)
    return parser


ORIGIN_COLOURS = {"oracle": "", "draft": "\033[32m", "draft1": "\033[32m", "draft2": "\033[36m",
                  "ngram": "\033[34m", "context": "\033[33m"}


def show_stages(tokenizer, token_ids: list[int], origins: list[str]) -> str:  # noqa: ANN001
    """The generated text with each token coloured by the stage that proposed it (ANSI colours)."""
    reset, other = "\033[0m", "\033[35m"

    def paint(text: str, origin: str) -> str:
        colour = ORIGIN_COLOURS.get(origin, other)
        return f"{colour}{text}{reset}" if colour else text

    body = "".join(paint(tokenizer.decode([t], skip_special_tokens=True), o) for t, o in zip(token_ids, origins))
    legend = " ".join(paint(o, o) for o in dict.fromkeys(origins))
    return body + f"\n[proposed by: {legend}]"


def cmd_generate(args: argparse.Namespace) -> int:
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.exactness import greedy_note
    from stagedspec.pipeline import Pipeline, dtype_name
    from stagedspec.request_plan import check_options

    # the request's checks that need no prompt, before the model loads (the library and server run them too)
    sampling, _ = check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, stop=args.stop)
    oracle, drafts, spec = speculation_from(args)
    method = spec.method
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    pipe = Pipeline.load(oracle, drafts, speculation=spec, dtype=args.dtype, device=args.device, quant=args.quant,
                         draft_weights=args.draft_weights, draft_vocab=args.draft_vocab,
                         pass_options=pass_options_from(args))
    if args.bit_exact is not None:
        pipe.bit_exact = args.bit_exact
    pipe.threads = args.threads
    if METHODS[method].speculates and sampling.greedy:
        note = greedy_note(pipe.model, pipe.bit_exact)
        if note:
            print(note, file=sys.stderr)
    if args.dtype == "auto":
        print(f"stagedspec: dtype {dtype_name(pipe.dtype)} ({pipe.dtype_reason}); weights: {pipe.weights_description}",
              file=sys.stderr)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    quiet = args.json or args.show_stages
    result = pipe.generate(prompt, chat=args.chat, max_new_tokens=args.max_new_tokens, sampling=sampling,
                           seed=args.seed, stop_strings=args.stop, on_text=None if quiet else stream,
                           controls=controls_from(args))
    st = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "method": method,
                          "stats": st.to_dict()}))
        return 0
    if args.show_stages:
        sys.stdout.write(show_stages(pipe.tokenizer, result.token_ids, st.token_origins))
    sys.stdout.write("\n")
    line = f"[{st.new_tokens} tokens in {st.seconds:.2f} s: {st.tokens_per_second:.1f} tokens/s, method {method}"
    if METHODS[method].speculates:
        line += f", mean accepted length {st.mean_accepted_length:.2f}"
    if st.auto_choices:
        line += ", steps by configuration " + " ".join(f"{k}={v}" for k, v in sorted(st.auto_choices.items()))
    print(line + "]", file=sys.stderr)
    return 0


def cmd_ngram_build(args: argparse.Namespace) -> int:
    import time

    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.drafters.ngram_files import build_ngram, stdlib_source_files, token_streams_from_files
    from stagedspec.models.loading import load_model

    model, tok = load_model(args.tokenizer)
    t0 = time.perf_counter()
    if args.from_samples:
        streams = sample_streams(args.from_samples, model, tok, args.tokens, args.temperature)
    else:
        files = stdlib_source_files() if args.from_stdlib else args.from_text
        streams = token_streams_from_files(files, tok)
    ngram = build_ngram(streams, tok, order=args.order)
    ngram.save(args.out)
    print(f"{ngram.summary()}; built from {sum(len(s) for s in streams):,} tokens in "
          f"{time.perf_counter() - t0:.1f} s -> {args.out}")
    return 0


def sample_streams(spec: str, oracle, tokenizer, n_tokens: int, temperature: float) -> list[list[int]]:  # noqa: ANN001
    """Token streams sampled from a model (the paper built its trigram from draft samples at T=1.5).

    Each stream starts from a chat-formatted prompt derived offline from the stdlib.
    """
    from tqdm import tqdm

    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.request import generate_ar
    from stagedspec.pipeline import load_draft_model

    model = oracle if spec == "oracle" else load_draft_model(spec, oracle, tokenizer, oracle.embed.weight.dtype,
                                                             str(oracle.embed.weight.device))
    try:
        # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
        from stagedspec.training.distill import stdlib_prompts

        prompts = stdlib_prompts(256, seed=0)
    except Exception:  # noqa: BLE001 - any failure: fall back to a generic prompt
        prompts = ["Write a Python function."]
    streams, total, i = [], 0, 0
    bar = tqdm(total=n_tokens, desc="sampling", unit="tok")
    while total < n_tokens:
        ids = tokenizer.encode(tokenizer.apply_chat_template(prompts[i % len(prompts)]))
        out = generate_ar(model, ids, max_new_tokens=min(256, n_tokens - total),
                          sampling=SamplingParams(temperature=temperature), seed=i).token_ids
        streams.append(out)
        total += len(out)
        bar.update(len(out))
        i += 1
    bar.close()
    return streams


def cmd_tune(args: argparse.Namespace) -> int:
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.costs import profile_path
    from stagedspec.learned_state import forget_everything, learned_store
    from stagedspec.models.draft import ORACLES_WITH_DRAFTS
    from stagedspec.models.named import paired_draft
    from stagedspec.profiling import print_cost_curve
    from stagedspec.pipeline import Pipeline, SpeculationConfig, dtype_name

    drafts = [] if args.draft in ("none", "") else args.draft.split(",")
    if args.oracle not in ORACLES_WITH_DRAFTS and args.draft == "default":
        pair = paired_draft(args.oracle)  # drafts ship for the named oracles only; a named pair is installed
        drafts = [pair] if pair else []
    if args.reset:
        print(f"forgot {len(forget_everything())} learned files in {learned_store()}")
    # `auto` keeps the drafts it is given (`ar` would drop them); nothing is generated here.
    forget_measured_choices()  # re-time the drafts' weight formats too
    forget_measured_plans()  # and the fp32 matmul kernels
    forget_measured_tile_rows()  # and the row count from which AMX tiles run
    forget_measured_distance()  # and how far ahead the tiles prefetch
    forget_measured_pair_rows()  # and from how many rows the 512-bit tiles pair up
    args.quant = resolve_quant(args.quant, args.oracle, args.device)
    pipe = Pipeline.load(args.oracle, drafts, speculation=SpeculationConfig(method="auto" if drafts else "ar"),
                         dtype=args.dtype, device=args.device, quant=args.quant, draft_weights=args.draft_weights,
                         draft_vocab=args.draft_vocab,
                         pass_options=pass_options_from(args))
    if args.threads != "auto":
        import torch

        torch.set_num_threads(args.threads)
    profile = pipe.cost_profile(remeasure=True)
    quant = f", {args.quant} weights ({pipe.weights_description})" if args.quant != "none" else ""
    print(f"{profile.machine}; oracle {args.oracle} in {dtype_name(pipe.dtype)} ({pipe.dtype_reason}){quant}; "
          f"measured in {profile.measured_seconds:.1f} s")
    print("\noracle pass:")
    print_cost_curve(profile.oracle)
    _print_kernel_plan(pipe.model)
    for spec, curve, model in zip(drafts, profile.drafts, pipe.draft_models):
        print(f"\ndraft {spec} pass:")
        print(f"{model.runtime.weight_format} weights ({model.runtime.weight_reason})")
        print_cost_curve(curve)
        _print_kernel_plan(model)
    path = profile_path(profile.key)
    if path.is_file():
        print(f"\ncached in {path}")
    else:  # `profiling.load_or_measure` keeps no profile measured beside a busy process
        print("\nnot cached: other processes kept a CPU busy while it was measured; run tune again on an idle machine")
    return 0


def _print_kernel_plan(model) -> None:  # noqa: ANN001 - a Transformer
    """fp32 on the CPU: the kernel and padded row count each weight shape runs per row count (`models.matmul_plan`)."""
    lines = describe(model)
    if lines:
        print("fp32 matmul kernels per row count, as timed here (W: (W x^T)^T, L: x W^T; n:K8: padded to 8 rows):")
        for line in lines:
            print(f"  {line}")


def cmd_bench_engine(args: argparse.Namespace) -> int:
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.bench.engine import run_engine_bench

    run_engine_bench(oracle=args.oracle, dtypes=args.dtypes.split(","), device=args.device,
                     n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens,
                     with_transformers=not args.no_transformers, pass_options=pass_options_from(args))
    if args.tree_cost:
        # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
        from stagedspec.bench.tree_cost import forward_cost_curve, print_cost_curve
        from stagedspec.models.loading import load_model
        from stagedspec.pipeline import parse_weights

        for name in args.dtypes.split(","):
            dtype, quant = parse_weights(name)
            model, _ = load_model(args.oracle, dtype=dtype, device=args.device, quant=quant,
                                  pass_options=pass_options_from(args))
            print(f"\ntree verification cost, {name}:")
            print_cost_curve(forward_cost_curve(model))
    return 0


def _cap_isa_for_bit_exact(args: argparse.Namespace) -> None:
    """`--bit-exact` on an AMX CPU: cap oneDNN below AMX before anything runs (`hardware.cap_isa_for_bit_exact`).

    The one process-wide setting a flag makes; how passes run is given to the models a command loads
    (`cli.args.pass_options_from`)."""
    if getattr(args, "bit_exact", False) and getattr(args, "device", "cpu") == "cpu":
        if cap_isa_for_bit_exact():
            print(f"stagedspec: --bit-exact on an AMX CPU: oneDNN capped at {AMX_ISA_CAP} for this run "
                  "(AMX kernels round a row differently by the pass's row count)", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0) or a bad argument (2, one line already printed)
        return int(done.code or 0)
    _cap_isa_for_bit_exact(args)
    try:
        return args.func(args)
    except StagedSpecError as e:
        print(f"stagedspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stagedspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
