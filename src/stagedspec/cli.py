"""`stagedspec` command line.

Every user-caused problem surfaces as a one-line `stagedspec: error: ...`
and exit code 2; a traceback means a bug in stagedspec.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from stagedspec.errors import StagedSpecError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--oracle", default="default", metavar="SPEC",
                   help="'default' (SmolLM2-135M-Instruct), an HF-format folder, or a .gguf file")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights/activations dtype")
    p.add_argument("--device", default="cpu", help="cpu or cuda")


def _add_speculation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, metavar="SPEC",
                   help="draft model: a distilled draft folder, an HF folder, a .gguf, or layers:N "
                        "(the oracle's first N layers)")
    p.add_argument("--method", default=None, choices=["ar", "chain", "tree"],
                   help="ar (plain decoding), chain (k draft tokens), tree (best-first token tree); "
                        "default: tree when --draft is given, else ar")
    p.add_argument("--tree-budget", type=_positive_int, default=16, metavar="N", help="tree nodes per step")
    p.add_argument("--tree-depth", type=_positive_int, default=6, metavar="D", help="maximum tree depth")
    p.add_argument("--branching", type=_positive_int, default=4, metavar="B", help="children considered per node")
    p.add_argument("--draft-k", type=_positive_int, default=4, metavar="K", help="chain length for --method chain")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=_positive_int, default=0, metavar="K", help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1]")
    p.add_argument("--seed", type=_positive_int, default=None, metavar="S")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagedspec", description="Exact staged speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="prompt text ('-' reads stdin)")
    _add_model_args(gen)
    _add_speculation_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench-engine", help="autoregressive speed vs transformers and the bandwidth roofline")
    _add_model_args(bench)
    bench.add_argument("--dtypes", default="bf16,fp32", help="comma-separated dtypes to measure")
    bench.add_argument("--n-prompts", type=_positive_int, default=3)
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128)
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    bench.set_defaults(func=cmd_bench_engine)
    return parser


def _sampling_from(args: argparse.Namespace):  # noqa: ANN202
    from stagedspec.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def cmd_generate(args: argparse.Namespace) -> int:
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    if args.max_new_tokens < 1:
        raise StagedSpecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = _sampling_from(args)
    method = args.method or ("tree" if args.draft else "ar")
    spec = SpeculationConfig(method=method, tree_budget=args.tree_budget, tree_depth=args.tree_depth,
                             branching=args.branching, draft_k=args.draft_k)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    pipe = Pipeline(args.oracle, args.draft, speculation=spec, dtype=args.dtype, device=args.device)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = pipe.generate(prompt, chat=args.chat, max_new_tokens=args.max_new_tokens, sampling=sampling,
                           seed=args.seed, stop_strings=args.stop, on_text=None if args.json else stream)
    st = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "method": method,
                          "stats": st.to_dict()}))
    else:
        sys.stdout.write("\n")
        line = f"[{st.new_tokens} tokens in {st.seconds:.2f} s: {st.tokens_per_second:.1f} tokens/s, method {method}"
        if method != "ar":
            line += f", mean accepted length {st.mean_accepted_length:.2f}"
        print(line + "]", file=sys.stderr)
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from stagedspec.bench.engine import run_engine_bench

    run_engine_bench(oracle=args.oracle, dtypes=args.dtypes.split(","), device=args.device,
                     n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens,
                     with_transformers=not args.no_transformers)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
