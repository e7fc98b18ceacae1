"""`stagedspec` command line (the console script is `stagedspec.cli:main`).

The modules: `commands` builds the parser and runs `generate`, `ngram build`, `tune` and `bench-engine`;
`args` declares the flags several commands share; `constraints` the structured-output flags; `distill`
(`distill`, `eval-draft`), `export` and `serve` (`serve`, `bench-serve`) register and run their commands.
`bench` and `check` register theirs from their own modules.
"""

from stagedspec.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
