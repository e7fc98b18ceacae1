"""`AutoDrafter`: the drafter that runs, each step, the arm its `AutoPolicy` expects to be fastest, and
learns from how each step went."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from stagedspec.auto.acceptance import AcceptanceStats, expected_tokens
from stagedspec.auto.arms import Arm, context_series, lookup_horizon
from stagedspec.auto.policy import AR_PROBE_EVERY, AR_PROBE_MIN_STEPS, AutoPolicy
from stagedspec.auto.pricing import contenders
from stagedspec.auto.step_costs import SharedLoad, catch_up_seconds, predicted_draft_seconds, solo_step_seconds
from stagedspec.drafters.base import Drafter
from stagedspec.realized_rates import RealizedRates
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree

if TYPE_CHECKING:
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.oracle import Oracle

EXPLORE_EVERY = 8  # every this many priced steps, run the arm with the highest optimistic rate ...
EXPLORE_MAX_GAP = 64  # ... a gap doubled, up to this, each time `ar` wins the priced step after an exploration
# ... that arm's calibration raised (`stagedspec.auto.pricing.EXPLORE_WIDTH`), twice in a row (the first step
# may catch its draft up, and its drafting time is then not learned)
# Each draft family (`Arm.family`: tree, staged, staged with a long lookup chain) is run early in a request
# whatever its price (in every request while its explorations beat `ar`, in fewer once they lose:
# `auto.policy.FAMILY_MAX_GAP`), and again every `FAMILY_REVISIT` priced steps: a price is a model, and a model that is
# wrong about an arm never lets it run to show otherwise: `auto` had run `ar` on every step of a prompt where a
# fixed chain of the draft was faster (docs/measurements.md, "A draft family its price never chose on an AMX Xeon").
# Such an exploration runs the family's best-priced arm twice (its second step warm, timed), a
# family at a time, `FAMILY_EXPLORE_AFTER` priced steps apart; all of a request's explorations together may cost
# at most `FAMILY_EXPLORE_SHARE` of its plain decoding time (the bounded cost): the drafts' catch-ups on the
# context, and the two steps' priced time beyond two `ar` steps (the tokens they may bring are not counted: what
# is bounded is the loss where the family does not pay); an exploration that would pass it is skipped.  With the
# catch-ups alone bounded, SmolLM2's `auto` explored three families a 64-token prose request and ran at 0.93x `ar`
# with 1.02 tokens a step on an AMX Xeon (docs/measurements.md, "Exploration steps outside the budget on an AMX
# Xeon").  Bounded per family, three families each
# caught the 0.5B draft up on a 64-token request and `auto` ran prose at 0.82-0.99x `ar` on a Zen 5 EPYC
# (docs/draft.md, "The 512-bit kernels and the Qwen feature draft at 306 k tokens").
FAMILY_EXPLORE_AFTER = 2
FAMILY_REVISIT = 64  # (a family that ran on its price since the last round is not explored again)
FAMILY_EXPLORE_SHARE = 0.05
FULL_PRICE_EVERY = 8  # priced steps between two that price every arm; the others price `ar`, the lookup arms
# and the draft arms that came close at the last full pricing (`stagedspec.auto.pricing.contenders`): pricing every
# arm is a visible share of a small model's CPU step (docs/measurements.md, "Pricing every arm on a Zen 4 EPYC")
PLAIN_STREAK = 4  # after this many `ar` steps in a row, a step is quiet (below) except a probe ...
LOOKUP_PROBE_EVERY = 4  # ... every this many steps at first, the gap doubled each time a probe chooses `ar` again ...
PROBE_MAX_GAP = 16  # ... up to this many steps, and back to `LOOKUP_PROBE_EVERY` when one chooses to speculate
# A quiet step runs `ar` and learns nothing of its own: no chains are looked at, no arm is priced, its time is
# not observed (the probes' and the speculative steps' are), so it costs a few microseconds.  With bookkeeping
# on every step, `auto` had run prose slower than `ar` while choosing `ar` on most steps
# (docs/measurements.md, "Bookkeeping on every step on a Zen 4 EPYC").
# Observations per series of the shared statistics a request starts from (`AutoDrafter.begin`): how often a
# draft or the prompt's own text is right depends on the request (code that restates its prompt, prose that
# does not), so a request's choices follow its own record after a dozen or two steps.  A synthetic request
# whose prompt is never copied, priced from a machine that saw it always copied, left lookup after 23 steps
# with 8 and ran lookup still after 60 with all 200 (`tests/test_auto.py`).  Priced from all of the machine's
# observations, `auto` ran prose slower than `ar` after a run of code prompts had taught it that the prompt is
# copied (docs/measurements.md, "Shared statistics taught by code prompts on an AVX2 EPYC").
REQUEST_PRIOR = 8.0


Resize = Callable[[], None]  # sizes one drafter for an arm (a bound `Drafter.resize`), called before it proposes


@dataclass(frozen=True)
class StepTrace:
    """One finished step as `AutoPolicy.step_observer` sees it (a diagnostic: `scripts/auto/trace_steps.py`):
    its arm and rows, its wall seconds and the price it was chosen at (the policy's before this step taught
    it), the tokens it emitted and the tokens the request's own statistics expected of it."""

    arm: str
    rows: int
    wall: float
    price: float
    tokens: int
    expected: float


@dataclass
class _Step:
    """What the last step proposed, kept until the next `propose` learns how it went."""

    context_len: int
    arm: Arm
    tree: TokenTree
    predicted_tokens: float
    rows: int
    draft_seconds: float
    verify_seconds: float | None = None  # the oracle's pass and verification, reported by the loop
    sampled: bool = False
    warm: bool = True  # its drafter also ran the step before (else its time includes catching up)
    ended: float = 0.0  # when `propose` returned (perf_counter): verification started then
    alone: bool = True  # priced alone (no batched round shared): the time until the next step is its own
    started: float = 0.0  # when `propose` began (perf_counter): the whole step runs from here to the next
    lookup_lengths: Mapping[str, int] = field(default_factory=dict)  # the chains it was priced with
    priced_tokens: float = 1.0  # what it was chosen for: tokens (calibrated) and whole seconds, catch-up included
    priced_seconds: float = 0.0
    family_trial: str | None = None  # the family whose exploration's second, warm step this was (it is judged)
    first_accept: float | None = None  # sampled: P(its draft's first token accepted), reported by the loop


def spine(tree: TokenTree) -> list[int]:
    """The tokens of the tree's first-child chain: the draft's favourite path (trees are in pre-order)."""
    kids = tree.children_lists()
    node, out = 0, []
    while kids[node]:
        node = kids[node][0]
        if node in tree.fixed:
            break
        out.append(tree.tokens[node])
    return out


def matched_prefix(chain: Sequence[int], emitted: Sequence[int]) -> int:
    n = 0
    while n < len(chain) and n < len(emitted) and chain[n] == emitted[n]:
        n += 1
    return n


class AutoDrafter(Drafter):
    """A drafter that runs, each step, the arm its `AutoPolicy` expects to be fastest.

    `arms` maps each arm to the drafter that proposes for it and the
    `Drafter.resize` calls that size it for the arm (drafters are shared
    between arms of the same kind, so a draft's cache is not caught up once
    per arm size).
    `lookup`, when given, is asked for its chains every step to learn the
    model-free proposers' acceptance and to tell the policy what exists now.
    """

    name = "auto"

    def __init__(self, policy: AutoPolicy, arms: Mapping[Arm, tuple[Drafter, Sequence[Resize]]],
                 lookup: LookupDrafter | None = None) -> None:
        self.policy, self.arms, self.lookup = policy, dict(arms), lookup
        missing = [a.name for a in policy.arms if a not in self.arms]
        if missing:
            raise ValueError(f"no drafter for arms {missing}")
        self._drafters = list({id(d): d for d, _ in self.arms.values()}.values())
        self._horizon = lookup_horizon(policy.arms)  # how far this step's lookup chains are scored
        self._last: _Step | None = None
        self._first_step = True  # its times include the prompt's prefill: not a step's cost
        self._plain_streak = 0  # consecutive steps that ran `ar`
        self._since_plain = 0  # steps since `ar` last ran (its step time last measured)
        self._probe_gap = LOOKUP_PROBE_EVERY  # steps between lookup probes in a plain run
        self._until_probe = LOOKUP_PROBE_EVERY
        self._quiet_steps = 0  # quiet `ar` steps not yet counted in the statistics (`_learn` adds them)
        self._until_explore = EXPLORE_EVERY  # priced steps until the next exploration
        self._explore_gap = EXPLORE_EVERY  # priced steps between explorations (doubled while they fail)
        self._explored = False  # an exploration ran since the last priced step
        self._exploring: Arm | None = None  # the arm an exploration runs again next step
        self._exploring_family: str | None = None  # ... when a family's exploration chose it (`_family_exploration`)
        self._contenders: frozenset[Arm] | None = None  # draft arms priced between full pricings (None: price all)
        self._until_full = 0  # priced steps until the next full pricing
        self._families_due: list[str] = []  # draft families not yet explored in this round (`FAMILY_REVISIT`)
        self._until_family = FAMILY_EXPLORE_AFTER  # priced steps until the next family is explored
        self._families_ran: set[str] = set()  # draft families that ran since the last round was planned
        self._explore_spent = 0.0  # priced seconds of this request's family explorations so far (beyond `ar`)
        self._last_drafter: Drafter | None = None  # the drafter of the last step
        self._synced: dict[int, int] = {}  # id(drafter) -> context length when it last proposed
        self.request_choices: dict[str, int] = {}  # `Drafter.request_choices`
        self._pending: list[tuple[int, str, list[int]]] = []  # (context length, proposer, chain) to score
        self._sampling = SamplingParams()
        # This request's own acceptance statistics by sampling kind (greedy?), started from the policy's at
        # `REQUEST_PRIOR` observations and updated with it: the arms are priced by these.
        self._own: dict[bool, AcceptanceStats] = {}
        # This request's realized / priced rate per arm kind (`stagedspec.realized_rates`): it scales the
        # prices, so an arm that loses to its price is dropped within a few steps whatever part of it was wrong.
        self._realized = RealizedRates()
        # Most nodes a tree may have (None: any arm), set by the server under memory pressure
        # (`stagedspec.server.pressure`): arms that could exceed it are not picked, rather than cut.
        self.tree_budget_cap: int | None = None
        # The batched round this request's next step shares, set by the server's scheduler between rounds
        # (never for a seeded sampled request, whose choices must not depend on its neighbours): see
        # `SharedLoad`.  None: priced alone.
        self.shared_load: SharedLoad | None = None

    @property
    def forward_passes(self) -> int:
        return sum(d.forward_passes for d in self._drafters)

    def attach_oracle(self, oracle: Oracle) -> None:
        """Pass the loop's oracle on to the arms that read its hidden states (a feature draft)."""
        for d in self._drafters:
            d.attach_oracle(oracle)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        for d in self._drafters:
            d.begin(prompt_ids)
        if self.lookup is not None and self.lookup not in self._drafters:
            self.lookup.begin(prompt_ids)
        self._last, self._pending, self._first_step = None, [], True
        self._exploring, self._exploring_family, self._last_drafter = None, None, None
        self._plain_streak, self._probe_gap, self._until_probe, self._quiet_steps = 0, LOOKUP_PROBE_EVERY, 0, 0
        self._contenders, self._until_full = None, 0
        # the families this request explores: those whose turn it is (`AutoPolicy.family_turn`)
        self._families_due = [f for f in self._draft_families() if self.policy.family_turn(f)]
        self._until_family = FAMILY_EXPLORE_AFTER
        self._families_ran = set()
        self._explore_spent = 0.0
        self._synced = {}
        self._own = {}
        self._realized = RealizedRates()
        self.request_choices = {}

    def propose(
        self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None, max_tokens: int
    ) -> TokenTree:
        t0 = time.perf_counter()
        due = self._lookup_due()
        if not due and self._exploring is None and self._last is None:
            # a quiet step (`PLAIN_STREAK`); after a full step, its lesson is learned first, below
            return self._run_quiet(context, sampling, generator, max_tokens)
        self._learn(context, t0)
        self._sampling = sampling
        lengths: dict[str, int] = {}
        if self.lookup is not None and due:
            self.lookup.resize(chain_length=self._horizon)
            for proposer, chain in self.lookup.chains(context, self._horizon):
                if proposer == "context":  # learned and priced by how long a suffix it matched
                    proposer = context_series(self.lookup.context_match())
                if proposer not in lengths:  # the proposer's best chain only
                    lengths[proposer] = len(chain)
                    self._pending.append((len(context), proposer, chain))
        # `ar` too little measured (`AR_PROBE_MIN_STEPS`) is probed every `EXPLORE_EVERY` steps, else every
        # `AR_PROBE_EVERY`: a wrong first price is then corrected within tens of steps, not hundreds
        probe = (self.policy.learn_times and self.shared_load is None and not self._first_step
                 and self._since_plain >= EXPLORE_EVERY)
        if probe and self._since_plain < AR_PROBE_EVERY:  # the statistics are read only when it matters
            with self.policy.lock:
                probe = self.policy.stats_for(sampling).arm_steps.get(Arm("ar"), 0) < AR_PROBE_MIN_STEPS
        again, self._exploring = self._exploring, None
        trial, self._exploring_family = self._exploring_family, None
        family_trial = None  # set when this step is the second of a family's exploration
        family_arm = None if again is not None or not due else self._family_exploration(context, sampling, lengths,
                                                                                         max_tokens)
        if again is not None and (self.tree_budget_cap is None or again.max_tree_budget <= self.tree_budget_cap):
            arm = self.policy.choose_again(again)  # an exploration's second step: its time is measured warm
            family_trial = trial
        elif family_arm is not None:
            arm = self._exploring = family_arm  # run twice: this step may catch its draft up
            self._exploring_family = family_arm.family
        elif not due:
            # Deep in a run of `ar` steps, between lookup probes: nothing new to weigh (no chains looked at,
            # no draft ran, so no statistic but `ar`'s own time moved), so `ar` again without pricing every
            # arm.  On a GPU that pricing is a few percent of a 3 ms step.  Decided by the history alone.  In a
            # batched round too: the shared round changes between probes, but each lane's pricing runs under
            # the one interpreter lock, one lane after another, and pricing every step slowed a round of SmolLM2
            # streams below `ar` (docs/measurements.md, "Pricing every step in a batched round on a Zen 4 EPYC");
            # a change of the round is seen at the next probe, a few steps later.
            return self._run_quiet(context, sampling, generator, max_tokens)
        else:
            self._until_explore -= 1
            # A policy that prices by the profile alone (a seeded sampled request's, `Pipeline.drafter`) starts
            # from the priors every request and cannot carry what an exploration teaches to the next one, so
            # it does not explore: exploring, seeded T=1 requests tried many arms each and ran slower than `ar`
            # (docs/measurements.md, "Exploration in seeded sampled requests on an AVX2 EPYC").
            explore = self._until_explore <= 0 and self.policy.learn_times
            backlog = {a.kind: len(context) - self._synced.get(id(self.arms[a][0]), 0)
                       for a in self.policy.arms if a.kind in ("tree", "staged")}
            # Every arm is priced every `FULL_PRICE_EVERY` priced steps and when exploring; in between only the
            # draft arms that came close then.  Which arms are priced is decided by the history alone.
            full = explore or self._contenders is None or self._until_full <= 0
            rates: dict[Arm, float] | None = {} if full else None
            arm = self.policy.choose(sampling, lengths, self.tree_budget_cap, self.shared_load, probe_plain=probe,
                                     explore=explore, backlog=backlog, remaining=max_tokens,
                                     stats=self._own_stats(sampling), realized=self._realized_now(),
                                     only=None if full else self._contenders, rates_out=rates)
            if rates is not None:
                self._contenders, self._until_full = contenders(rates), FULL_PRICE_EVERY
            self._until_full -= 1
            self._pace_exploration(arm, explore)
            self._pace_probes(arm)
            if explore and arm.kind != "ar":
                self._exploring = arm
        self.request_choices[arm.name] = self.request_choices.get(arm.name, 0) + 1
        self._families_ran.add(arm.family)
        self._plain_streak = self._plain_streak + 1 if arm.kind == "ar" else 0
        self._since_plain = 0 if arm.kind == "ar" else self._since_plain + 1
        drafter, resizes = self.arms[arm]
        behind = len(context) - self._synced.get(id(drafter), 0)
        for resize in resizes:
            resize()
        tree = drafter.propose(context, sampling, generator, max_tokens)
        self._synced[id(drafter)] = len(context)
        with self.policy.lock:
            priced_seconds = solo_step_seconds(arm, self.policy.profile, self.policy.costs, lengths,
                                               not sampling.greedy)
            if arm.kind == "ar":  # one token, no draft to catch up: the pricing's constants
                predicted = priced_tokens = 1.0
            else:
                own = self._own_stats(sampling)
                predicted = expected_tokens(arm, own, lengths, calibrated=False)
                priced_tokens = expected_tokens(arm, own, lengths)
                priced_seconds += catch_up_seconds(arm, self.policy.profile, behind)
        ended = time.perf_counter()
        self._last = _Step(len(context), arm, tree, predicted, len(tree), ended - t0,
                           sampled=not sampling.greedy, warm=drafter is self._last_drafter, ended=ended,
                           alone=self.shared_load is None, started=t0, lookup_lengths=lengths,
                           priced_tokens=priced_tokens, priced_seconds=priced_seconds,
                           family_trial=family_trial)
        self._last_drafter = drafter
        return tree

    def _run_quiet(self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None,
                   max_tokens: int) -> TokenTree:
        """`ar` without pricing, its time not learned: counted as a choice and, at the next `_learn`, in the
        statistics."""
        arm = self.policy.choose_plain()
        self.request_choices[arm.name] = self.request_choices.get(arm.name, 0) + 1
        self._plain_streak += 1
        self._since_plain = 0
        self._quiet_steps += 1
        drafter, _ = self.arms[arm]
        tree = drafter.propose(context, sampling, generator, max_tokens)
        self._synced[id(drafter)] = len(context)
        self._last_drafter = drafter
        return tree

    def _draft_families(self) -> list[str]:
        """The draft families a request explores (`FAMILY_REVISIT`), in the arms' order; none for a policy that
        does not learn times (a seeded sampled request's choices follow its own history and the profile only)."""
        if not self.policy.learn_times:
            return []
        return list(dict.fromkeys(a.family for a in self.policy.arms if a.kind in ("tree", "staged")))

    def _family_exploration(self, context: Sequence[int], sampling: SamplingParams, lengths: Mapping[str, int],
                            max_tokens: int) -> Arm | None:
        """The arm of the next draft family due for exploration, if one is due at this priced step and its
        cost fits the budget (`FAMILY_EXPLORE_SHARE`); None otherwise.  Decided by the history alone.

        Not in a batched round (the server's shared rounds price their own steps) nor on the first step (its
        time includes the prompt's prefill)."""
        if self._first_step or self.shared_load is not None or not self.policy.learn_times:
            return None
        self._until_family -= 1
        if self._until_family > 0:
            return None
        if not self._families_due:  # every family explored: the next round in `FAMILY_REVISIT` priced steps, of
            # the families that have not run on their own price by then
            self._families_due, self._until_family = self._draft_families(), FAMILY_REVISIT
            self._families_ran = set()
            return None
        self._families_due = [f for f in self._families_due if f not in self._families_ran]
        if not self._families_due:
            return None
        self._until_family = FAMILY_EXPLORE_AFTER
        family = self._families_due.pop(0)
        arm = self.policy.best_in_family(family, sampling, lengths, self._own_stats(sampling), self.tree_budget_cap,
                                         self._realized_now())
        if arm is None:
            return None
        behind = len(context) - self._synced.get(id(self.arms[arm][0]), 0)
        plain_seconds = max_tokens * self.policy.profile.step_seconds(1, not sampling.greedy)
        sampled = not sampling.greedy
        with self.policy.lock:  # two steps of the arm, beyond two of `ar`
            excess = 2 * max(0.0, solo_step_seconds(arm, self.policy.profile, self.policy.costs, lengths, sampled)
                             - solo_step_seconds(Arm("ar"), self.policy.profile, self.policy.costs, lengths, sampled))
        cost = catch_up_seconds(arm, self.policy.profile, behind) + excess
        if self._explore_spent + cost > FAMILY_EXPLORE_SHARE * plain_seconds:
            return None
        self._explore_spent += cost
        return arm

    def _pace_probes(self, arm: Arm) -> None:
        """After a priced step deep in a plain run (a probe): the next probe in twice the gap if it chose `ar`
        again (up to `PROBE_MAX_GAP`), else back to `LOOKUP_PROBE_EVERY`.  Decided by the history alone."""
        if arm.kind != "ar":
            self._probe_gap = LOOKUP_PROBE_EVERY
        elif self._plain_streak >= PLAIN_STREAK:
            self._probe_gap = min(PROBE_MAX_GAP, 2 * self._probe_gap)
        self._until_probe = self._probe_gap

    def _realized_now(self) -> RealizedRates | None:
        """This request's realized / priced rates, where its steps are timed alone by a policy that learns
        times (not in a batched round, nor for a seeded sampled request priced by the profile alone)."""
        return self._realized if self.policy.learn_times and self.shared_load is None else None

    def _own_stats(self, sampling: SamplingParams) -> AcceptanceStats:
        """This request's acceptance statistics for `sampling`'s kind (made at its first use, under the lock)."""
        own = self._own.get(sampling.greedy)
        if own is None:
            with self.policy.lock:
                own = self._own[sampling.greedy] = self.policy.stats_for(sampling).scaled(REQUEST_PRIOR)
        return own

    def _pace_exploration(self, arm: Arm, explore: bool) -> None:
        """Count down to the next exploration: the gap doubles when `ar` wins the first priced step after an
        exploration of another arm, and returns to `EXPLORE_EVERY` when a priced step chooses to speculate.
        Decided by the history of choices alone."""
        if explore:
            self._until_explore = self._explore_gap
            self._explored = arm.kind != "ar"
            return
        if arm.kind != "ar":
            self._explore_gap = EXPLORE_EVERY
            self._until_explore = min(self._until_explore, self._explore_gap)
        elif self._explored:
            self._explore_gap = min(EXPLORE_MAX_GAP, 2 * self._explore_gap)
            self._until_explore = self._explore_gap
        self._explored = False

    def verified(self, seconds: float, first_accept: float | None = None) -> None:
        """The loop's report of how long the oracle took to score and verify this drafter's last tree, and in
        sampled decoding the probability that the tree's first child was accepted (`VerifyResult.first_accept`).

        Why the probability: at T > 0 whether the draft's token was accepted is one draw, right about half the
        time for the Qwen feature draft, so a request's own record of it (`REQUEST_PRIOR`) and of its arms'
        yield (`realized_rates`) swung on a few unlucky steps and left `auto` running `ar` on most of a
        request where the draft paid (docs/measurements.md, "The draft's acceptance probability at T=1 on a
        Zen 4 EPYC").  Learning the probability instead of the draw keeps the same expectation with less
        noise."""
        if self._last is not None:
            self._last.verify_seconds = seconds
            self._last.first_accept = first_accept

    def _lookup_due(self) -> bool:
        """Whether this step is a full one: its lookup chains computed, its arms priced, its time learned.

        While plain decoding keeps winning (`PLAIN_STREAK`), only every
        `_probe_gap`-th step is (`_pace_probes`), so a fast pass (a GPU graph
        replay, a 5 ms CPU step) does not pay for the bookkeeping every step;
        a run of copyable context is still noticed within a few tokens, and
        within `PROBE_MAX_GAP` deep in prose.  Which steps look is decided by
        the history of choices alone.
        """
        if self._plain_streak < PLAIN_STREAK:
            return True
        self._until_probe -= 1
        return self._until_probe <= 0

    def _learn(self, context: Sequence[int], now: float) -> None:
        """Score the last step and the pending lookup chains against the tokens emitted since (`now`: when
        this step began)."""
        with self.policy.lock:
            self._learn_locked(context, now)

    def _learn_locked(self, context: Sequence[int], now: float) -> None:
        # (proposer, matched, length, P(first accepted) or None) of each chain decided now
        scored: list[tuple[str, int, int, float | None]] = []
        still = []
        for start, proposer, chain in self._pending:
            emitted = context[start:]
            matched = matched_prefix(chain, emitted)
            if matched < len(chain) and matched == len(emitted):
                still.append((start, proposer, chain))  # undecided: the next token is not known yet
            else:
                scored.append((proposer, matched, len(chain), None))
        self._pending = still
        if self._quiet_steps:  # quiet `ar` steps since the last full one: counted, their times not learned
            for stats in (self.policy.stats_for(self._sampling), self._own_stats(self._sampling)):
                stats.observe_arm(Arm("ar"), 1.0, 1, steps=self._quiet_steps)
            self.policy.costs.advance(self._quiet_steps)  # the scales' clock counts them (`StepCosts.seen`)
            self._quiet_steps = 0
        last, self._last = self._last, None
        stepped = last is not None and len(context) > last.context_len
        emitted = context[last.context_len:] if stepped else []
        tokens: float = len(emitted)  # what the step yielded, its first draft token's draw replaced by its odds
        if stepped and last.arm.kind in ("tree", "staged"):
            chain = spine(last.tree)
            if chain:
                matched = matched_prefix(chain, emitted)
                first = last.first_accept
                scored.append(("draft", matched, len(chain), first))
                if first is not None:
                    tokens += first - (matched > 0)
        if (stepped and self.policy.step_observer is not None and last.verify_seconds is not None
                and not self._first_step):
            self.policy.step_observer(StepTrace(
                last.arm.name, last.rows, now - last.started,
                solo_step_seconds(last.arm, self.policy.profile, self.policy.costs, last.lookup_lengths,
                                  last.sampled),
                len(emitted), expected_tokens(last.arm, self._own_stats(self._sampling), last.lookup_lengths)))
        arm = last.arm if stepped else None
        predicted = last.predicted_tokens if stepped else 0.0
        # the machine's statistics (what the next requests start from) and this request's own (its prices)
        self.policy.stats_for(self._sampling).observe(arm, predicted, tokens, scored)
        self._own_stats(self._sampling).observe(arm, predicted, tokens, scored)
        if not stepped:
            return
        if self._first_step or last.verify_seconds is None or not self.policy.learn_times:
            self._first_step = False
            return
        predicted_verify = self.policy.profile.step_seconds(last.rows, last.sampled)
        # What the step cost after drafting is the time until this step began: the loop's report (scoring,
        # verifying, committing) plus its bookkeeping and the caller's handling of the tokens, which grow
        # with the tree (on an AVX-512 CPU, 1.3 ms for `ar`, 3.7 ms for a 16-node tree).  Capped
        # at 1.5x the report, so a caller that paused between steps does not teach a price.  In a batched
        # round (the server) the time until the next step is the round's, so there the report alone counts.
        verify_seconds = last.verify_seconds
        costs = self.policy.costs
        if last.alone:
            verify_seconds = min(max(verify_seconds, now - last.ended), 1.5 * verify_seconds)
        costs.observe(last.arm, last.draft_seconds if last.warm else None, verify_seconds, predicted_verify,
                      predicted_draft_seconds(last.arm, self.policy.profile, last.sampled), sampled=last.sampled,
                      rows=last.rows)
        if last.alone:  # a batched round's wall time is the round's, not this step's
            # the whole step against its parts' price after their lesson, so what they explain is not counted
            # twice (a slow first `ar` step once priced `ar` at 2.7x its time and locked it out)
            wall = min(now - last.started, last.draft_seconds + 1.5 * last.verify_seconds)  # not a caller's pause
            costs.observe_step(last.arm, wall,
                               solo_step_seconds(last.arm, self.policy.profile, costs, last.lookup_lengths,
                                                 last.sampled, whole=False), last.sampled)
            self._realized.observe(last.arm.kind, tokens, wall, last.priced_tokens, last.priced_seconds)
            if last.family_trial is not None:  # a family's exploration, warm: did it beat plain decoding?
                plain = solo_step_seconds(Arm("ar"), self.policy.profile, costs, {}, last.sampled)
                self.policy.family_result(last.family_trial, tokens * plain >= wall)
