"""`stagedspec export`: write a draft in another engine's format (transformers / vLLM), for scaling out.

Kept apart from `stagedspec.cli.commands` so the main parser only registers it; the work is in
`stagedspec.export`.  See docs/scale-out.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from stagedspec.cli.args import positive_int
from stagedspec.export import FORMATS


def add_commands(subparsers: Any) -> None:
    """Register `export` on the main parser's subparsers."""
    e = subparsers.add_parser(
        "export", help="write a draft for transformers (hf) or vLLM (eagle, speculators)",
        description="Write a stagedspec draft in another engine's format: hf (an independent draft as a "
                    "self-contained transformers causal LM), eagle or speculators (a feature draft in vLLM's "
                    "EAGLE layouts). See docs/scale-out.md.",
    )
    e.add_argument("draft", metavar="DRAFT", help="draft spec: 'default' (the shipped draft) or a draft folder")
    e.add_argument("--oracle", default="default", metavar="SPEC",
                   help="the oracle the draft belongs to (default: 'default', SmolLM2-135M-Instruct)")
    e.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    e.add_argument("--out", required=True, metavar="DIR", help="new or empty folder to write")
    e.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="weights on disk (default bf16, the shipped draft's own format)")
    e.add_argument("--approximate", action="store_true",
                   help="eagle/speculators: write the nearest layout even though it does not compute exactly "
                        "what the feature draft computes (the engine's output stays exact; acceptance differs)")
    e.add_argument("--verifier", default=None, metavar="NAME",
                   help="speculators: the verifier's hub id or path to record (default: the oracle's HF folder)")
    e.add_argument("--speculative-tokens", type=positive_int, default=4, metavar="K",
                   help="speculators: draft tokens per step to record (default 4)")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.export.common import load_for_export, prepare_out, require_kind

    oracle, _, draft = load_for_export(args.draft, args.oracle)
    feature = args.fmt != "hf"
    require_kind(draft, args.fmt, feature)
    if feature:
        # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
        from stagedspec.export.eagle import check_exportable, export_feature

        check_exportable(draft, args.fmt, args.approximate)  # refuse before creating the folder
        out = prepare_out(args.out)
        files = export_feature(draft, args.fmt, args.oracle, out, args.dtype, approximate=args.approximate,
                               verifier=args.verifier, speculative_tokens=args.speculative_tokens)
    else:
        # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
        from stagedspec.export.hf import export_hf

        out = prepare_out(args.out)
        files = export_hf(draft, args.oracle, out, args.dtype)
    print(f"wrote {args.fmt} export of draft {args.draft} to {out}: {', '.join(files)}")
    return 0
