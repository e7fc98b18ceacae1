"""`stagedspec check`: its arguments and the command, over `stagedspec.check`'s tests."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from stagedspec.check import FULL, QUICK, CheckConfig, run_check
from stagedspec.cli.args import add_device_dtype_args, add_oracle_arg, add_quant_arg, int_at_least, non_negative_int
from stagedspec.models.quant import resolve_quant
from stagedspec.sampling import SamplingParams

MIN_SAMPLES = 100  # fewer samples give a chi-square test too weak to flag the negative control


def add_check_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `stagedspec check` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "check", help="exactness self-test on your oracle/draft pair: greedy and sampling tests, speed per method",
        description="Greedy: every method's tokens equal ar's (fp32, and the serving dtype with --bit-exact). "
                    "Sampling: chi-square test of the first speculative token against the oracle's exact "
                    "distribution, with a negative control that must be flagged. Speed: tok/s per method. "
                    "Exits 1 on any FAIL.")
    add_oracle_arg(p)
    p.add_argument("--draft", default=None, metavar="SPEC",
                   help="draft model (distilled folder, HF folder, .gguf, layers:N); default: the shipped draft "
                        "for the default oracle, else none (chain/tree/staged rows are then skipped)")
    p.add_argument("--ngram", default="default", metavar="SPEC",
                   help="n-gram for lookup/staged/auto: 'default' (as `generate` uses for staged and auto), a file, "
                        "or 'none'")
    add_quant_arg(p)
    add_device_dtype_args(p, dtype_help="the serving dtype to check besides fp32 (auto: what the hardware "
                                        "computes natively)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="sampling row 2 (default 1)")
    p.add_argument("--top-k", type=non_negative_int, default=50, metavar="K", help="sampling row 2 (default 50; 0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="sampling row 2 (default 1 = off)")
    p.add_argument("--samples", type=int_at_least(MIN_SAMPLES), default=None, metavar="N",
                   help=f"samples per sampling row (default {FULL.samples}; {QUICK.samples} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"fewer prompts ({QUICK.prompts}), tokens ({QUICK.new_tokens}) and samples ({QUICK.samples}): "
                        "lower power, stated in the table")
    p.set_defaults(func=cmd_check)
    return p


def cmd_check(args: argparse.Namespace) -> int:
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    budget = dataclasses.replace(QUICK if args.quick else FULL)
    if args.samples is not None:
        budget.samples = args.samples
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.models.draft import ORACLES_WITH_DRAFTS

    draft = args.draft if args.draft is not None else ("default" if args.oracle in ORACLES_WITH_DRAFTS else None)
    ngram = None if args.ngram in ("none", "") else args.ngram
    quant = resolve_quant(args.quant, args.oracle, args.device)
    cfg = CheckConfig(oracle=args.oracle, draft=draft, ngram=ngram, quant=quant, device=args.device,
                      dtype=args.dtype, quick=args.quick, user_sampling=sampling, budget=budget)
    report = run_check(cfg, out=lambda s: print(s, flush=True))
    print()
    print(report.table())
    for note in report.notes:
        print(note)
    print("\nresult: " + ("FAIL" if report.failed else "PASS"))
    return 1 if report.failed else 0
