"""The decoding loop: one loop for autoregressive and speculative decoding.

Every step, a drafter proposes a `TokenTree` rooted at the last committed
token; the oracle scores all its nodes in one forward pass; `verify` picks
the accepted path and the oracle's own next token; the oracle keeps the KV
entries of the root and the accepted path.  Autoregressive decoding is the
same loop with a drafter that proposes nothing (a root-only tree), so the
baseline and every speculative method share their stopping, sampling and
bookkeeping code — which is what makes "identical to `ar`" a meaningful test.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from stagedspec.drafters.base import Drafter, StageTelemetry
from stagedspec.errors import StagedSpecError
from stagedspec.oracle import Oracle
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree
from stagedspec.verification import VerifyResult, verify


class NoDrafter(Drafter):
    """Proposes nothing: the loop then decodes autoregressively."""

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        return TokenTree([context[-1]], [-1])

    def stage_telemetry(self) -> list[StageTelemetry]:
        """No stage: nothing is drafted, so the stages table has no row for it."""
        return []


@dataclass
class GenerationStats:
    new_tokens: int = 0
    seconds: float = 0.0
    # Time to the first token: the call's start to the end of its first step, which runs the prompt (in front of the
    # first tree, or before it where a feature draft reads the prompt's hidden states).  The same span for every
    # method: measured only up to the first step, it had left the prompt's pass out of `ar`'s and in a feature
    # draft's, so `seconds - prefill_seconds` favoured a feature draft by a prompt pass a request
    # (docs/measurements.md, "Prefill seconds that differed by method").
    prefill_seconds: float = 0.0
    tokens_per_second: float = 0.0
    oracle_forward_passes: int = 0
    draft_forward_passes: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # draft tokens accepted per oracle step
    tree_sizes: list[int] = field(default_factory=list)  # proposed nodes (root excluded) per step
    tree_depths: list[int] = field(default_factory=list)  # longest proposed path per step
    token_origins: list[str] = field(default_factory=list)  # who proposed each emitted token
    draft_seconds: float = 0.0  # time spent in the drafter's proposals
    stages: list[dict] = field(default_factory=list)  # per-stage passes and seconds (filled by the pipeline)
    finish_reason: str = "length"
    dtype: str = ""  # the oracle's compute dtype (filled by the pipeline; `--dtype auto` chooses it)
    weights: str = ""  # the oracle's weight format and kernel, e.g. "mixed on stagedspec-native (AVX2)" (pipeline)
    auto_choices: dict[str, int] = field(default_factory=dict)  # `--method auto`: steps run per arm

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per oracle step (accepted draft tokens + the oracle's own token)."""
        steps = len(self.accepted_lengths)
        return (sum(self.accepted_lengths) + steps) / steps if steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_accepted_length"] = self.mean_accepted_length
        d["mean_tree_size"] = sum(self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else 0.0
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats
    text: str = ""


Verifier = Callable[..., Any]


def iter_steps(
    oracle: Oracle,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    seed: int | None = None,
    stop_token_ids: Iterable[int] = (),
    verifier: Verifier | None = None,
    stats: GenerationStats | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens emitted by each oracle step (at least one per step).

    Stops after `max_new_tokens` tokens or right after a stop token; tokens a
    step accepted beyond either limit are not emitted, so the output is a
    prefix-exact match of autoregressive decoding.  A caller that nests
    loops (a stage drafting for the stage above) passes its own `generator`
    so one seed drives every random draw.
    """
    if max_new_tokens < 1:
        raise StagedSpecError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise StagedSpecError("the prompt is empty: give at least one token")
    verifier = verifier or verify
    stats = stats if stats is not None else GenerationStats()
    stops = set(stop_token_ids)
    if generator is None and not sampling.greedy:
        generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    context = list(prompt_ids)
    t0 = time.perf_counter()
    oracle.prefill(context)
    drafter.attach_oracle(oracle)  # a feature draft reads the oracle's hidden states (`stagedspec.drafters.feature`)
    drafter.begin(context)
    emitted = 0
    while emitted < max_new_tokens:
        remaining = max_new_tokens - emitted
        t_draft = time.perf_counter()
        tree = drafter.propose(context, sampling, generator, remaining)
        t_verify = time.perf_counter()
        stats.draft_seconds += t_verify - t_draft
        result = verifier(tree, oracle.score(tree), sampling, generator)
        if sampling.greedy and oracle.bit_exact:
            result = keep_slot_aligned(tree, result)
        oracle.commit(result.accepted)
        if emitted == 0:
            stats.prefill_seconds = time.perf_counter() - t0
        # a drafter that prices its proposals learns the cost, and at T > 0 its first token's acceptance probability
        drafter.verified(time.perf_counter() - t_verify, first_accept=result.first_accept)
        stats.accepted_lengths.append(len(result.accepted))
        stats.tree_sizes.append(len(tree) - 1)
        stats.tree_depths.append(tree.depth)
        step = [tree.tokens[i] for i in result.accepted] + [result.next_token]
        origins = [tree.proposer[i] for i in result.accepted] + ["oracle"]
        step, origins = step[:remaining], origins[:remaining]
        for j, tok in enumerate(step):
            if tok in stops:
                step, origins = step[: j + 1], origins[: j + 1]
                stats.finish_reason = "stop"
                break
        context.extend(step)
        emitted += len(step)
        stats.token_origins.extend(origins)
        yield step
        if stats.finish_reason == "stop":
            return


def keep_slot_aligned(tree: TokenTree, result: VerifyResult) -> VerifyResult:
    """Cut a greedy step at its first accepted node outside the tree's first-child chain.

    Nodes 1..k of a pre-order tree whose parents are 0..k-1 sit in the KV
    slots their positions would have in one-token decoding, so their logits
    are bit-identical to it (see `ModelOracle`); any other node's may differ
    in the last bit.  If the accepted path leaves that chain at node c, the
    decision that chose c was still made on an aligned row (c's parent's):
    keep the aligned part and emit c's token as the step's own token.  The
    step is then exactly what one-token decoding would emit, a little
    shorter than the tree allowed.
    """
    for j, node in enumerate(result.accepted):
        if node != j + 1 or tree.parents[node] != j:
            return VerifyResult(result.accepted[:j], tree.tokens[node])
    return result


def speculative_generate(
    oracle: Oracle,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    seed: int | None = None,
    stop_token_ids: Iterable[int] = (),
    verifier: Verifier | None = None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
) -> GenerationResult:
    """Run the loop to the end; `on_tokens` sees each step's tokens and may return True to stop early."""
    stats = GenerationStats()
    out: list[int] = []
    t0 = time.perf_counter()
    steps = iter_steps(
        oracle, drafter, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
        stop_token_ids=stop_token_ids, verifier=verifier, stats=stats,
    )
    with torch.inference_mode():
        for step in steps:
            out.extend(step)
            if on_tokens is not None and on_tokens(step):
                stats.finish_reason = "stop"
                break
    stats.seconds = time.perf_counter() - t0
    stats.new_tokens = len(out)
    stats.tokens_per_second = len(out) / stats.seconds if stats.seconds > 0 else 0.0
    stats.oracle_forward_passes = oracle.forward_passes
    stats.draft_forward_passes = drafter.forward_passes
    return GenerationResult(out, stats)
