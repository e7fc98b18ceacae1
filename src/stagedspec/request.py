"""One request's decoding state, built one way for a solo run and a served one (`start_request`).

Why one builder: `Pipeline.generate` and the server's scheduler each used to put a request together (its oracle,
constrained by the request's logit bias or grammar, its drafter, the loop's steps, the stop-string stream),
and the scheduler's copy carried a comment promising it matched.  Two copies of one rule drift; a served
request's output must be its solo run's.  Now both call `start_request` and step the `Request` it returns.

Data flows one way: a pipeline (the loaded models and the speculation settings) -> `start_request` -> a
`Request` that steps, streams its text through the one stop-string rule (`stagedspec.stops`) and reports its
stats.  Its runners go back with `RequestPasses.release`, called by whoever made the passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from stagedspec.constraints.processor import ConstrainedOracle, LogitsProcessor
from stagedspec.drafters.base import Drafter
from stagedspec.generation import GenerationResult, GenerationStats, NoDrafter, iter_steps, speculative_generate
from stagedspec.models.transformer import Transformer
from stagedspec.oracle import Oracle
from stagedspec.request_plan import RequestPlan, check_length
from stagedspec.runner import ModelOracle, RequestPasses
from stagedspec.sampling import SamplingParams
from stagedspec.stops import StopTextStream

if TYPE_CHECKING:
    from stagedspec.tokenizer import Tokenizer


class Models(Protocol):
    """What a request is started from (a `Pipeline`): the oracle, its tokenizer, whether its passes are
    bit-exact, and a drafter per request."""

    model: Transformer
    tokenizer: Tokenizer
    bit_exact: bool

    def drafter(self, max_len: int, reproducible: bool = False, processor: LogitsProcessor | None = None,
                passes: RequestPasses | None = None) -> Drafter: ...


class Request:
    """A request in flight: `step` runs one oracle step, `text` turns its tokens into text cut at the earliest
    stop string, `finish_stats` fills in the figures of the run so far.

    `drafter` is what the pipeline built (its `auto` policy, its stages); `stepper` is what the loop calls,
    the drafter itself or a wrapper around it (the server's tree cap under memory pressure)."""

    def __init__(self, oracle: Oracle, drafter: Drafter, stepper: Drafter, prompt_ids: Sequence[int], *,
                 max_new_tokens: int, sampling: SamplingParams, seed: int | None, stop_token_ids: Sequence[int],
                 text: StopTextStream) -> None:
        self.oracle, self.drafter, self.stepper = oracle, drafter, stepper
        self.max_new_tokens = max_new_tokens
        self.stats = GenerationStats()
        self.steps = iter_steps(oracle, stepper, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                seed=seed, stop_token_ids=stop_token_ids, stats=self.stats)
        self.text = text
        self.token_ids: list[int] = []
        self.seconds = 0.0  # in `step`: the prompt's prefill and every step
        self.first_token_seconds: float | None = None
        self.t_start = time.perf_counter()

    def step(self) -> list[int] | None:
        """The tokens of one more oracle step (at least one), or None when the loop is over."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                tokens = next(self.steps)
        except StopIteration:
            return None
        finally:
            self.seconds += time.perf_counter() - t0
        if self.first_token_seconds is None:
            self.first_token_seconds = time.perf_counter() - self.t_start
        self.token_ids.extend(tokens)
        return tokens

    @property
    def over(self) -> bool:
        """Whether the request needs no more steps: a stop string or token was met, or its tokens are all out."""
        return (self.text.stopped or self.stats.finish_reason == "stop"
                or len(self.token_ids) >= self.max_new_tokens)

    def close(self) -> None:
        """Drop the oracle, the drafter and the loop, and with them their KV caches; the text, tokens and
        stats stay readable."""
        del self.oracle, self.drafter, self.stepper, self.steps

    def finish_stats(self) -> GenerationStats:
        """The run's stats, with its time, token count and passes so far (the stages table is the caller's:
        `pipeline.stage_report`)."""
        st = self.stats
        st.seconds, st.new_tokens = self.seconds, len(self.token_ids)
        st.tokens_per_second = st.new_tokens / st.seconds if st.seconds > 0 else 0.0
        st.oracle_forward_passes = self.oracle.forward_passes
        st.draft_forward_passes = self.drafter.forward_passes
        return st


def start_request(pipe: Models, plan: RequestPlan, max_len: int, *, processor: LogitsProcessor | None,
                  passes: RequestPasses, wrap: Callable[[Drafter], Drafter] | None = None) -> Request:
    """The request `plan` over `pipe`'s models with a cache of `max_len` slots.

    Its oracle is `pipe`'s model (bit-exact as `pipe.bit_exact` says), constrained by `processor` (the request's
    logit bias and grammar, which shapes every draft row too); its drafter is `pipe.drafter`'s, which gives a
    seeded sampled request choices its seed reproduces; `wrap` wraps the drafter the loop steps (None: as
    built).  `passes`: where its passes go and the runners they lease; the caller releases them."""
    oracle: Oracle = ModelOracle(pipe.model, max_len, bit_exact=pipe.bit_exact, passes=passes)
    if processor is not None:  # rows biased and masked by their path, the drafts' as the oracle's
        oracle = ConstrainedOracle(oracle, processor, settles=True)
    drafter = pipe.drafter(max_len, reproducible=plan.seed is not None and not plan.sampling.greedy,
                           processor=processor, passes=passes)
    return Request(oracle, drafter, wrap(drafter) if wrap is not None else drafter, plan.prompt_ids,
                   max_new_tokens=plan.max_new_tokens, sampling=plan.sampling, seed=plan.seed,
                   stop_token_ids=pipe.tokenizer.eos_token_ids, text=StopTextStream(pipe.tokenizer, plan.stop))


def generate_ar(
    model: Transformer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    seed: int | None = None,
    stop_token_ids: Iterable[int] = (),
    on_tokens: Callable[[list[int]], bool | None] | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding with our engine (the baseline every method must reproduce)."""
    oracle = ModelOracle(model, context_budget(model, len(prompt_ids), max_new_tokens, 0))
    return speculative_generate(
        oracle, NoDrafter(), prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
        stop_token_ids=stop_token_ids, on_tokens=on_tokens,
    )


def context_budget(model: Transformer, prompt_len: int, max_new_tokens: int, max_tree_budget: int) -> int:
    """Cache slots for a request, after checking it fits the model's context window.

    The size depends on the method only through trees of over `TREE_SLACK`
    nodes: the oracle attends over the whole cache (`ModelOracle`), so two
    methods with the same cache size compute bit-identical logits.
    """
    check_length(prompt_len, max_new_tokens, model.config.max_position)  # the request plan's words
    used = prompt_len + max_new_tokens + 1
    slack = TREE_SLACK * max(1, -(-max_tree_budget // TREE_SLACK))
    return -(-used // TREE_SLACK) * TREE_SLACK + slack


TREE_SLACK = 64  # cache slots past the generation for tree nodes (rounded, see `context_budget`)


def stage_report(stats, drafter: Drafter) -> list[dict]:  # noqa: ANN001 - GenerationStats
    """Forward passes and seconds per stage, oracle first (the oracle gets the time not spent drafting)."""
    telemetry = drafter.stage_telemetry()
    if telemetry is None:  # one stage with no figures of its own: the loop timed its proposals
        rows = [{"stage": drafter.name, "forward_passes": drafter.forward_passes, "seconds": stats.draft_seconds}]
    else:  # one row per stage (none for `NoDrafter`)
        rows = [{"stage": t.name, "forward_passes": t.forward_passes, "seconds": t.seconds,
                 # tokens this stage emitted per inner step (accepted from the stage below + its own)
                 "mean_accepted_length": (sum(t.accepted_lengths) + len(t.accepted_lengths))
                 / len(t.accepted_lengths) if t.accepted_lengths else None}
                for t in telemetry]
    drafting = sum(r["seconds"] for r in rows)
    oracle = {"stage": "oracle", "forward_passes": stats.oracle_forward_passes,
              "seconds": max(0.0, stats.seconds - drafting), "mean_accepted_length": stats.mean_accepted_length}
    return [oracle, *rows]
