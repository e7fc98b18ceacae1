"""The drafter contract: one base class that every drafter subclasses.

The loop (`stagedspec.generation.iter_steps`) needs two things of a drafter:
`begin` once per request and `propose` once per step.  Everything else the
engine may ask of one is an optional hook, and every hook is declared here
with a no-op default, so callers call it on any drafter instead of probing
for it: a drafter overrides the hooks that mean something to it (a feature
draft reads the oracle's hidden states, `auto` learns what verifying cost,
a stage chain reports its stages).  A drafter made of drafters (a stage
chain, a merged tree, `auto`'s arms) passes the hooks on to those it holds.

Nothing here imports the engine, so the loop, the stages and every drafter
can depend on this module without a cycle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree

if TYPE_CHECKING:
    from stagedspec.oracle import Oracle


@dataclass
class StageTelemetry:
    """One stage's figures for a request's stats (`stage_report`): a row of the stages table."""

    name: str
    forward_passes: int = 0
    seconds: float = 0.0  # time spent in this stage's own work (stages below excluded)
    proposals: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per inner step, from the stage below


class Drafter(ABC):
    """Anything that proposes token trees: a draft model, an n-gram, a stage chain, `auto`'s arms.

    `begin` and `propose` are the contract; the other members are hooks the
    engine calls on every drafter, with defaults that do nothing, so that a
    drafter states what it takes part in by overriding them.
    """

    name: str = "draft"
    """The label of this drafter's row in the stages table (`stage_report`), and of its proposals."""

    forward_passes: int = 0
    """Draft-model forward passes run so far (the stats' `draft_forward_passes`); 0 for a model-free drafter."""

    request_choices: Mapping[str, int] = MappingProxyType({})
    """Steps run per `auto` arm during the current request (the stats' `auto_choices`); empty when the
    drafter does not choose between arms."""

    tree_budget_cap: int | None = None
    """Most nodes a tree may have (None: any), set by the server under memory pressure before each step
    (`stagedspec.server.pressure`).  A drafter that chooses its tree's size (`auto`) picks one that fits
    rather than have it cut; any other ignores it, and the server cuts its tree to the cap."""

    @abstractmethod
    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new request: forget the last one's state (after the oracle's prefill of `prompt_ids`)."""

    @abstractmethod
    def propose(
        self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None, max_tokens: int
    ) -> TokenTree:
        """A tree rooted at `context[-1]`; paths longer than `max_tokens` are wasted work."""

    def attach_oracle(self, oracle: Oracle) -> None:
        """The loop's oracle, handed over once per request after its prefill and before `begin` (`iter_steps`).

        Why: a feature draft reads the oracle's hidden states of the committed
        tokens (`stagedspec.drafters.feature`); a drafter made of drafters passes
        it on.  `oracle` is whatever the loop verifies with (a `ModelOracle`, a
        constrained one, a test's toy), so a reader asks it for what it needs."""

    def verified(self, seconds: float, first_accept: float | None = None) -> None:
        """How long the oracle took to score, verify and commit this drafter's last tree, reported by the loop
        after every step (`iter_steps`), and in sampled decoding the probability its root's first child was
        accepted (`VerifyResult.first_accept`).  Why: a drafter that prices its proposals (`auto`) learns the
        step's cost and its draft's acceptance from them."""

    def stage_telemetry(self) -> list[StageTelemetry] | None:
        """This drafter's rows of the stages table, top stage first, or None (the default): it is one stage
        with no figures of its own, and whoever called it reports it as one row with the time it measured
        (`stage_report`; a `StageDrafter` or `MergedDrafter` for the drafters they hold).  A drafter made of
        stages (`StageDrafter`, `MergedDrafter`) returns one row per stage."""
        return None

    def resize(self, *, chain_length: int | None = None, tree_budget: int | None = None,
               max_depth: int | None = None, branching: int | None = None) -> None:
        """Change this drafter's size between steps; None leaves a knob as it is.

        `--method auto` shares one drafter between the arms of one kind (so a
        draft's cache is caught up once, not once per arm size) and sizes it
        for the arm it runs before each step.  The knobs are the drafters' own:
        `chain_length` (a lookup's chains, a stage's decoded tokens, a chain
        draft's length), `tree_budget`, `max_depth` and `branching` (a tree
        draft's nodes, depth and children per node).  A drafter accepts the knobs it has and refuses the others, so
        a wrong sizing fails loudly instead of being ignored."""
        refuse_knobs(self, chain_length=chain_length, tree_budget=tree_budget, max_depth=max_depth,
                     branching=branching)


def refuse_knobs(drafter: Drafter, **knobs: int | None) -> None:
    """Refuse `resize` knobs `drafter` does not have (those given a value)."""
    given = [k for k, v in knobs.items() if v is not None]
    if given:
        raise StagedSpecError(f"{type(drafter).__name__} cannot be resized by {', '.join(given)}")


def check_size(label: str, value: int | None) -> None:
    """A size knob must be >= 1 (None: not being changed)."""
    if value is not None and value < 1:
        raise StagedSpecError(f"{label} must be >= 1, got {value}")
