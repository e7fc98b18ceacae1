"""Grammar constraints (JSON schema, any JSON object, Lark / GBNF) through llguidance.

Why llguidance: it forks a matcher in microseconds (`deep_copy`, about 6 us
on the default model's 49k vocabulary), which is what speculation needs (a
matcher state per tree node), computes a token mask in about 40-50 us once
warm, takes JSON schemas, Lark and GBNF, and is a 3 MB wheel with no
dependencies (xgrammar masks faster, 10-16 us, but declares torch,
transformers and triton as dependencies).  It is an optional extra
(`pip install stagedspec[grammar]`); nothing here is imported without a
grammar.

A `GrammarState` is the matcher after one sequence of generated tokens.
States form a trie: `child(token)` forks the matcher once per distinct
path and keeps it, so a node's state is computed once whether the draft
asks for it first or the oracle does, and `allowed()` computes its mask
once.  States never change after they are made; the per-request
`LogitsProcessor` drops the trie above the committed text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError, first_line

KINDS = ("json_schema", "json_object", "grammar")
# JSON is written as `json.dumps` writes it, ", " and ": " with no other whitespace: with free whitespace a
# small model can pad a reply with newlines until it runs out of tokens.  A schema's own "x-guidance" options
# take precedence.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarState(Protocol):
    """Where a grammar stands after a path: what may come next, and the state after one more token."""

    def allowed(self) -> Tensor:
        """bool [V]: the tokens the grammar accepts next (the stop tokens alone once it is complete)."""
        ...

    def child(self, token: int) -> "GrammarState":
        """The state after `token` (a dead state, allowing only the stop tokens, if the grammar rejects it)."""
        ...


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; `kind` is one of `KINDS`.

    - json_schema: `text` is a JSON schema (as JSON text);
    - json_object: any JSON object (OpenAI's `response_format: json_object`); `text` is unused;
    - grammar: a Lark grammar, or a GBNF one (llama.cpp's EBNF dialect); llguidance tells them apart.
    """

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StagedSpecError(f"unknown grammar kind {self.kind!r}: use one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: Any) -> "GrammarSpec":
        """From a schema object (a dict, or a bool as JSON Schema allows) or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StagedSpecError(f"the JSON schema is not valid JSON: {first_line(e)}") from None
        if not isinstance(schema, (dict, bool)):
            raise StagedSpecError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object")


def grammar_available() -> bool:
    """Whether the grammar library (llguidance) is installed."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise StagedSpecError("grammar constraints need llguidance: pip install 'stagedspec[grammar]' "
                              "(or pip install llguidance)") from None
    return llguidance


class GrammarCompiler:
    """The model's vocabulary as llguidance sees it, built once (about a second for 49k tokens) and reused.

    Held by whoever serves many requests on one tokenizer (a `Pipeline`, the
    server's `Engine`); `compile` is cheap (a few ms) and is done per request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: a stagedspec `Tokenizer` (its `inner` is a `tokenizers.Tokenizer`); `vocab_size`: the
        model's logit width (ids past the tokenizer's vocabulary are never allowed)."""
        llg = _llguidance()
        inner = getattr(tokenizer, "inner", tokenizer)
        stops = list(getattr(tokenizer, "eos_token_ids", ()))
        if not stops:
            raise StagedSpecError("grammar constraints need a tokenizer with a stop token")
        try:
            self.ll_tokenizer = llg.LLTokenizer(inner.to_str(), n_vocab=vocab_size, eos_token=stops)
        except Exception as e:  # noqa: BLE001 - the Rust side's errors have no importable type
            raise StagedSpecError(f"llguidance cannot read this tokenizer: {first_line(e)}") from None
        self.vocab_size = vocab_size
        self.stop_ids = stops

    def compile(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text for `spec`, checked against this vocabulary; a one-line error if it is bad."""
        llg = _llguidance()
        try:
            if spec.kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
            elif spec.kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_LAYOUT)
            else:
                grammar = llg.grammar_from("grammar", spec.text)
        except Exception as e:  # noqa: BLE001 - ValueError, or the Rust side's own
            raise StagedSpecError(f"bad {_label(spec)}: {first_line(e)}") from None
        problem = llg.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if problem:
            raise StagedSpecError(f"bad {_label(spec)}: {first_line(problem)}")
        return grammar

    def initial_state(self, grammar: str) -> "MatcherState":
        """The state before any generated token, for a grammar from `compile`."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StagedSpecError(f"bad grammar: {first_line(matcher.get_error())}")
        return MatcherState(matcher, self)


def _label(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON grammar", "grammar": "grammar"}[spec.kind]


class MatcherState:
    """One llguidance matcher, forked per child token and never advanced in place (see the module docstring)."""

    __slots__ = ("matcher", "compiler", "children", "_allowed")

    def __init__(self, matcher: Any, compiler: GrammarCompiler) -> None:
        self.matcher, self.compiler = matcher, compiler
        self.children: dict[int, MatcherState] = {}
        self._allowed: Tensor | None = None

    def child(self, token: int) -> "MatcherState":
        state = self.children.get(token)
        if state is None:
            matcher = self.matcher.deep_copy()
            matcher.consume_token(token)  # a rejected token leaves it in its error state: a dead path
            state = self.children[token] = MatcherState(matcher, self.compiler)
        return state

    def allowed(self) -> Tensor:
        if self._allowed is None:
            vocab = self.compiler.vocab_size
            if self.matcher.is_error():
                mask = torch.zeros(vocab, dtype=torch.bool)
                mask[self.compiler.stop_ids] = True
            else:
                bias = self.matcher.compute_logit_bias()  # one byte per token: 0 (banned) or 200 (allowed)
                mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[:vocab] > 0
                if not bool(mask.any()):  # nothing can follow: end the reply rather than emit a NaN row
                    mask[self.compiler.stop_ids] = True
            self._allowed = mask
        return self._allowed


def walk(state: GrammarState, tokens: Sequence[int]) -> GrammarState:
    """The state after `tokens`."""
    for token in tokens:
        state = state.child(token)
    return state
