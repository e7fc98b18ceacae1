"""Building, locating and loading n-gram files for a given tokenizer.

The default n-gram of a tokenizer is built once from offline corpus text (the
CPython stdlib sources; HumanEval is never used) and cached next to the
default model, so `--ngram default` needs no download and no committed blob.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Sequence

from stagedspec.drafters.ngram import NgramModel, build_from_token_streams
from stagedspec.errors import StagedSpecError
from stagedspec.paths import cache_root
from stagedspec.tokenizer import vocab_fingerprint

DEFAULT_ORDER = 3


def stdlib_source_files(limit: int | None = None) -> list[Path]:
    """CPython stdlib `.py` files, tests and site-packages excluded, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "tests", "idlelib", "__pycache__"))
        files += [Path(dirpath) / n for n in sorted(names) if n.endswith(".py") and not n.startswith("test_")]
    return files[:limit] if limit else files


def token_streams_from_files(paths: Sequence[str | Path], tokenizer: Any, progress: bool = True) -> list[list[int]]:
    from tqdm import tqdm

    streams = []
    for p in tqdm(list(paths), desc="tokenising", unit="file", disable=not progress):
        path = Path(p)
        if not path.is_file():
            raise StagedSpecError(f"corpus file not found: {p}")
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise StagedSpecError(f"cannot read corpus file {p}: {e.strerror or e}") from None
        if text.strip():
            streams.append(tokenizer.encode(text))
    return streams


def build_ngram(streams: Iterable[Sequence[int]], tokenizer: Any, order: int = DEFAULT_ORDER,
                progress: bool = True) -> NgramModel:
    return build_from_token_streams(list(streams), order, tokenizer.vocab_size,
                                    vocab_fingerprint(tokenizer.get_vocab()), progress=progress)


def default_ngram_path(tokenizer: Any) -> Path:
    return cache_root() / "ngram" / f"stdlib-{DEFAULT_ORDER}gram-{vocab_fingerprint(tokenizer.get_vocab())[:12]}.npz"


def load_ngram(spec: str, tokenizer: Any) -> NgramModel:
    """`default` (built from the stdlib on first use, then cached) or a path to an n-gram file."""
    if spec == "default":
        path = default_ngram_path(tokenizer)
        if not path.exists():
            import sys

            print(f"building the default n-gram for this tokenizer into {path} (once)", file=sys.stderr)
            model = build_ngram(token_streams_from_files(stdlib_source_files(), tokenizer), tokenizer)
            path.parent.mkdir(parents=True, exist_ok=True)
            model.save(path)
            return model
        spec = str(path)
    return NgramModel.load(spec, expected_fingerprint=vocab_fingerprint(tokenizer.get_vocab()),
                           expected_vocab_size=tokenizer.vocab_size)
