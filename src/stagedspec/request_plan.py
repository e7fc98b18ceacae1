"""A validated request (`RequestPlan`), built by one function (`plan_request`) for the CLI, the library and the
server, with one error vocabulary (`PlanError`).

Why one builder: the same request used to be checked three ways (the CLI's flags, `Pipeline.generate`'s
arguments, the server's request body), each with its own wording, and one of them could let through what
another refused.  Now each front end turns its input into `plan_request`'s arguments and nothing else: the
CLI prints a `PlanError` as its one-line error, the library raises it, and the server answers 400 with its
message, `param` and `code`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stagedspec.constraints.processor import LogitControls, LogitsProcessor, build_processor, parse_logit_bias
from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams
from stagedspec.speculation import SpeculationConfig
from stagedspec.stops import checked_stops


class PlanError(StagedSpecError):
    """A request that cannot run.  `param`: the request field at fault, as the OpenAI API names it
    (`max_tokens`, `prompt`, `stop`, `temperature`, ...); `code`: the API's error code where it has one
    (`context_length_exceeded`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class RequestPlan:
    """What to run: the prompt's token ids, how many tokens at most, how to sample, where to stop, how to
    speculate.  Built only by `plan_request`, so every plan has passed the same checks."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    speculation: SpeculationConfig


def plan_request(prompt_ids: Sequence[int], *, max_new_tokens: int, context: int,
                 speculation: SpeculationConfig | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = ()) -> RequestPlan:
    """The plan of one request on a model whose context holds `context` tokens, or a `PlanError` saying
    what is wrong with it, in the same words whichever front end asked."""
    check_prompt(len(prompt_ids), context)  # first: a prompt that fills the context leaves no default length
    sampling, stops = check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, stop=stop)
    check_length(len(prompt_ids), max_new_tokens, context)
    return RequestPlan(tuple(prompt_ids), max_new_tokens, sampling, seed, stops,
                       speculation if speculation is not None else SpeculationConfig())


def check_options(*, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  stop: Sequence[str] = ()) -> tuple[SamplingParams, tuple[str, ...]]:
    """The checks that need no prompt (the CLI runs them before it loads a model): the sampling settings,
    the stop strings and the token count.  Returns the sampling and the stop strings."""
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    except StagedSpecError as e:
        raise PlanError(str(e), _sampling_param(str(e))) from None
    try:
        stops = tuple(checked_stops(stop))
    except StagedSpecError as e:
        raise PlanError(str(e), "stop") from None
    if max_new_tokens < 1:
        raise PlanError(f"max-new-tokens (max_tokens) must be >= 1, got {max_new_tokens}", "max_tokens")
    return sampling, stops


def check_prompt(prompt_len: int, context: int) -> None:
    """The prompt is not empty and leaves room in the model's context for a token."""
    if prompt_len < 1:
        raise PlanError("the prompt is empty: give at least one token", "prompt")
    if prompt_len >= context:
        raise PlanError(f"this model's context is {context} tokens; the prompt has {prompt_len}", "prompt",
                        "context_length_exceeded")


def check_length(prompt_len: int, max_new_tokens: int, context: int) -> None:
    """The prompt and the tokens asked for fit the model's context together."""
    if prompt_len + max_new_tokens > context:
        raise PlanError(f"this model's context is {context} tokens; the prompt ({prompt_len} tokens) plus "
                        f"max_tokens ({max_new_tokens}) is {prompt_len + max_new_tokens}", "max_tokens",
                        "context_length_exceeded")


def plan_constraints(controls: LogitControls | None, vocab_size: int,
                     compiler: Callable[[], Any]) -> LogitsProcessor | None:
    """A request's logit bias and grammar as its processor (None when it asks for neither), or a `PlanError`
    naming the field at fault: `logit_bias` (a token outside the vocabulary, a bias out of range) or
    `response_format` (a schema or grammar the grammar library refuses).  `compiler` returns the
    `GrammarCompiler` of the model's tokenizer, called only for a grammar.  The one builder of a request's
    constraints, for the CLI, the library and the server."""
    if controls is None or not controls.active:
        return None
    try:
        bias = parse_logit_bias(controls.logit_bias, vocab_size) if controls.logit_bias else {}
    except StagedSpecError as e:
        raise PlanError(str(e), "logit_bias") from None
    try:
        return build_processor(LogitControls(bias, controls.grammar), vocab_size, compiler)
    except StagedSpecError as e:
        raise PlanError(str(e), "response_format") from None


def _sampling_param(message: str) -> str | None:
    """The sampling field a `SamplingParams` error is about (its message names it)."""
    for name in ("temperature", "top_k", "top-k", "top_p", "top-p"):
        if name in message:
            return name.replace("-", "_")
    return None
