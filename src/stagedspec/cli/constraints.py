"""`stagedspec generate`'s structured-output flags: --json-schema, --json-object, --grammar, --logit-bias.

Kept apart from `stagedspec.cli.commands` so the flags and their checks live in one place; the command line only
adds them and hands `controls_from(args)` to `Pipeline.generate`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stagedspec.constraints import GrammarSpec, LogitControls
from stagedspec.errors import StagedSpecError, first_line


def add_constraint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (exact with every method; needs llguidance for grammars)")
    which = group.add_mutually_exclusive_group()
    which.add_argument("--json-schema", metavar="FILE", help="constrain the reply to this JSON schema")
    which.add_argument("--json-object", action="store_true", help="constrain the reply to a JSON object")
    which.add_argument("--grammar", metavar="FILE", help="constrain the reply to a Lark or GBNF grammar")
    group.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                       help="add BIAS (in [-100, 100]) to token ID's logit before sampling (repeatable)")


def controls_from(args: argparse.Namespace) -> LogitControls | None:
    """The request's logit controls from the flags (None when none is given); one-line errors."""
    grammar = None
    if getattr(args, "json_schema", None):
        grammar = GrammarSpec.json_schema(_read(args.json_schema, "--json-schema"))
    elif getattr(args, "json_object", False):
        grammar = GrammarSpec.json_object()
    elif getattr(args, "grammar", None):
        grammar = GrammarSpec("grammar", _read(args.grammar, "--grammar"))
    bias: dict[int, float] = {}
    for item in getattr(args, "logit_bias", None) or []:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise StagedSpecError(f"--logit-bias takes ID=BIAS, e.g. 42=-100; got {item!r}") from None
        if not sep:
            raise StagedSpecError(f"--logit-bias takes ID=BIAS, e.g. 42=-100; got {item!r}")
    controls = LogitControls(logit_bias=bias, grammar=grammar)
    return controls if controls.active else None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StagedSpecError(f"{flag}: cannot read {path}: {first_line(e)}") from None
