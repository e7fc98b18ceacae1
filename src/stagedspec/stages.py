"""Staged speculation: a drafter that is itself decoded speculatively by the stage below.

A model stage proposes for the stage above by *decoding* k tokens of its own
— greedily, or by sampling from its own distribution — and that decoding is
the ordinary loop (`iter_steps`) with the stage as oracle and the next stage
down as drafter.  So the chain oracle <- draft <- ... <- n-gram uses the same
verification code at every level, and each level's output is exactly what
that stage would decode alone:

- greedy: the stage's proposals are its own greedy tokens;
- sampling: each proposed token is an exact draw from the stage's processed
  distribution q (temperature/top-k/top-p as for the oracle), and the q it
  was drawn from is passed up in `child_q`, which is what the verifier above
  needs.

The tree handed up is the stage's decoded chain (the spine) plus, at every
spine node, `branching - 1` alternative leaves: the stage's next most likely
tokens when greedy, or further draws *without replacement* from q when
sampling.  The shape is fixed by (k, branching) alone, never by the draws,
which keeps sampled verification exact.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor

from stagedspec.drafters.base import Drafter, StageTelemetry, check_size
from stagedspec.errors import StagedSpecError
from stagedspec.generation import GenerationStats, iter_steps
from stagedspec.oracle import Oracle
from stagedspec.sampling import SamplingParams, probs_from_logits
from stagedspec.tree import TokenTree


class _RecordingOracle:
    """Passes calls through to a stage and remembers the logits row behind every emitted token.

    After a step that accepted nodes a_1..a_m, the emitted tokens were drawn
    at rows 0, a_1, ..., a_m (the root, then each accepted node): exactly one
    row per emitted token, in order.
    """

    bit_exact = False  # a stage's oracle: the loop above keeps its own rows

    def __init__(self, inner: Oracle) -> None:
        self.inner = inner
        self.rows: list[Tensor] = []
        self._logits: Tensor | None = None

    @property
    def forward_passes(self) -> int:
        return self.inner.forward_passes

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.inner.prefill(prompt_ids)

    def score(self, tree: TokenTree) -> Tensor:
        self._logits = self.inner.score(tree)
        return self._logits

    def commit(self, accepted: Sequence[int]) -> None:
        self.inner.commit(accepted)
        assert self._logits is not None
        self.rows.extend(self._logits[[0, *accepted]].unbind(0))


class _TimedDrafter(Drafter):
    """A drafter wrapper that adds up the seconds spent in its proposals.

    Its hooks stay the base's no-ops: the drafter below a stage is not handed
    the stage as an oracle (only the top stage may read hidden states, the
    oracle's) and is not told what verifying cost (only `auto` prices steps,
    and it drafts for the oracle)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.seconds = inner, 0.0

    @property
    def forward_passes(self) -> int:
        return self.inner.forward_passes

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.inner.begin(prompt_ids)

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        t0 = time.perf_counter()
        try:
            return self.inner.propose(context, sampling, generator, max_tokens)
        finally:
            self.seconds += time.perf_counter() - t0


class StageDrafter(Drafter):
    """A stage (any `Oracle`, usually a `ModelOracle` around a draft model) decoded with `below` as its drafter."""

    def __init__(self, stage: Oracle, below: Drafter, *, name: str = "draft", chain_length: int = 6,
                 branching: int = 2) -> None:
        if chain_length < 1 or branching < 1:
            raise StagedSpecError(f"stage chain length and branching must be >= 1, got {chain_length}, {branching}")
        self.stage, self.below, self.name = stage, below, name
        self.chain_length, self.branching = chain_length, branching
        self.telemetry = StageTelemetry(name)
        self._timed_below = _TimedDrafter(below)  # its time is subtracted from this stage's own

    @property
    def forward_passes(self) -> int:
        return self.stage.forward_passes

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass  # the stage's cache follows the context lazily in `prefill`

    def attach_oracle(self, oracle: Oracle) -> None:
        """A feature-draft stage (`FeatureStage`) reads the hidden states of the oracle above it."""
        # `stage` is an oracle, not a drafter: only a feature stage (perhaps inside a `ConstrainedOracle`,
        # which forwards what it lacks) has this hook
        if hasattr(self.stage, "attach_oracle"):
            self.stage.attach_oracle(oracle)

    def resize(self, *, chain_length: int | None = None, tree_budget: int | None = None,
               max_depth: int | None = None, branching: int | None = None) -> None:
        """`chain_length`: the tokens this stage decodes per proposal (`--method auto`'s `staged:k` arms)."""
        # a stage has no tree knobs: refused
        super().resize(tree_budget=tree_budget, max_depth=max_depth, branching=branching)
        check_size("stage chain length", chain_length)
        if chain_length is not None:
            self.chain_length = chain_length

    def stage_telemetry(self) -> list[StageTelemetry]:
        """This stage's figures followed by those of every stage below it."""
        self.telemetry.forward_passes = self.stage.forward_passes
        below = self.below.stage_telemetry()
        if below is None:  # one stage with no figures of its own: timed here
            below = [StageTelemetry(self.below.name, self.below.forward_passes, self._timed_below.seconds)]
        return [self.telemetry, *below]

    def propose(
        self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None, max_tokens: int
    ) -> TokenTree:
        t0, below_before = time.perf_counter(), self._timed_below.seconds
        length = max(1, min(self.chain_length, max_tokens))
        recorder = _RecordingOracle(self.stage)
        inner = GenerationStats()
        spine: list[int] = []
        for step in iter_steps(recorder, self._timed_below, context, max_new_tokens=length, sampling=sampling,
                               generator=generator, stats=inner):
            spine.extend(step)
        origins = [self.name if o == "oracle" else o for o in inner.token_origins[:length]]
        rows = torch.stack(recorder.rows[: len(spine)])
        tree = self._tree_from_spine(context[-1], spine, origins, rows, sampling, generator)
        self.telemetry.proposals += 1
        self.telemetry.accepted_lengths.extend(inner.accepted_lengths)
        self.telemetry.seconds += time.perf_counter() - t0 - (self._timed_below.seconds - below_before)
        return tree

    def _tree_from_spine(self, root: int, spine: list[int], origins: list[str], rows: Tensor,
                         sampling: SamplingParams, generator: torch.Generator | None) -> TokenTree:
        tree = TokenTree([root], [-1], sampled=not sampling.greedy)
        extra = self.branching - 1
        if sampling.greedy:
            alternatives = None
            if extra:  # a token the stage rules out (-inf: a grammar mask) is never worth a node
                top = rows.topk(min(extra + 1, rows.shape[-1]), dim=-1)
                alternatives = torch.where(top.values.isfinite(), top.indices, -1).tolist()
        else:
            q = probs_from_logits(rows, sampling)
        parent = 0
        for i, tok in enumerate(spine):
            spine_node = tree.add(parent, tok, origins[i])
            if sampling.greedy:
                if alternatives is not None:
                    for alt in [a for a in alternatives[i] if a != tok and a >= 0][:extra]:
                        tree.add(parent, alt, self.name)
            else:
                tree.child_q[parent] = q[i]
                if extra:
                    for alt in _draws_without(q[i], tok, extra, generator):
                        tree.add(parent, alt, self.name)
            parent = spine_node
        return tree


def _draws_without(q: Tensor, first: int, n: int, generator: torch.Generator | None) -> list[int]:
    """n further draws without replacement from q after `first` was drawn (Gumbel-top-k on the rest)."""
    rest = q.clone()
    rest[first] = 0.0
    support = int((rest > 0).sum())
    n = min(n, support)
    if n == 0:
        return []
    device = generator.device if generator is not None else rest.device
    noise = torch.empty(rest.shape, dtype=torch.float32, device=device).exponential_(generator=generator)
    keys = rest.log() - noise.clamp_min_(torch.finfo(torch.float32).tiny).to(rest.device).log()
    return keys.topk(n).indices.tolist()
