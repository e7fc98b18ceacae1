"""`AutoPolicy`: the learned state of `--method auto`, shared by the requests of one pipeline, and its
choice of an arm for a step."""

from __future__ import annotations

import threading
from typing import Any, Callable, Collection, Mapping, Sequence

from stagedspec.auto.acceptance import AcceptanceStats
from stagedspec.auto.arms import Arm
from stagedspec.auto.pricing import choose_arm, expected_rates
from stagedspec.auto.step_costs import SharedLoad, StepCosts, catch_up_seconds
from stagedspec.costs import CostProfile
from stagedspec.realized_rates import RealizedRates
from stagedspec.sampling import SamplingParams

AR_PROBE_EVERY = 32  # a step runs `ar` when its time was last measured this many steps ago ...
AR_PROBE_BELOW = 1.5  # ... and the best arm promises less than this many times `ar`'s rate, or `ar` ran ...
AR_PROBE_MIN_STEPS = 8  # ... fewer steps than this (its price is then too little measured to trust)
STATE_CAP = 200.0  # observations per series kept when the learned state is saved for the next process
# A draft family whose exploration (`auto.drafter`, `FAMILY_EXPLORE_AFTER`) ran slower than `ar` is explored
# again only every 2nd request, then every 4th, ... up to every `FAMILY_MAX_GAP`-th; one that beat `ar` is
# explored in every request.  Explored in every request whatever they taught, the families cost SmolLM2's
# `auto` about 9% of `ar`'s speed on prose and chat, where no draft pays (docs/measurements.md, "Family
# explorations in every request on a Zen 5 EPYC").
FAMILY_MAX_GAP = 8


class AutoPolicy:
    """The learned state of `--method auto`, kept across the requests of one pipeline.

    Statistics are kept apart for greedy and sampled decoding (acceptance
    differs), the measured times are shared.  A seeded sampled request gets
    a policy of its own that ignores measured times (`Pipeline.drafter`):
    its tree shapes then depend only on its own history and the machine's
    cached cost profile, so the seed reproduces its output on this machine.
    (Starting it from the state an earlier process saved priced it better,
    but then a seeded request's tokens changed whenever an unseeded one saved
    a new state: a seeded stream under load differed from the same request
    alone.)
    """

    def __init__(self, arms: Sequence[Arm], profile: CostProfile, learn_times: bool = True) -> None:
        """`learn_times=False`: price arms by the cost profile alone, never by measured step times, so
        the choices (and with them a seeded sampled run's random draws) are reproducible."""
        self.arms, self.profile, self.learn_times = list(arms), profile, learn_times
        self.greedy_stats, self.sampled_stats = AcceptanceStats(), AcceptanceStats()
        self.costs = StepCosts()
        self.choices: dict[str, int] = {}
        # The server's batched scheduler runs requests' steps on threads of their own, all learning into
        # one policy: reads and updates of the statistics take this lock (uncontended: ~0.1 us).
        self.lock = threading.RLock()
        # Per draft family: requests between its explorations (doubled after each that lost to `ar`), and
        # requests still to skip before the next (`family_turn`, `family_result`).
        self.family_gaps: dict[str, int] = {}
        self.family_wait: dict[str, int] = {}
        # Called with each timed step's `auto.drafter.StepTrace` before the step teaches anything (a
        # diagnostic's hook, `scripts/auto/trace_steps.py`; None: not traced).
        self.step_observer: Callable[[Any], None] | None = None

    def state(self, cap: float = STATE_CAP) -> dict[str, Any]:
        """What was learned, as JSON-able data, counts scaled down to at most `cap` observations per series
        so that a restored policy still adapts to new text."""
        def part(stats: AcceptanceStats) -> dict[str, Any]:
            kept = stats.scaled(cap)
            return {"chains": {name: {"hits": c.hits, "tries": c.tries} for name, c in kept.chains.items()},
                    "arms": {arm.name: [steps, kept.arm_tokens.get(arm, 0.0), kept.arm_predicted.get(arm, 0.0)]
                             for arm, steps in kept.arm_steps.items()}}

        with self.lock:
            return {"version": 1, "greedy": part(self.greedy_stats), "sampled": part(self.sampled_stats),
                    "draft_seconds": {a.name: v for a, v in self.costs.draft_seconds.items()},
                    "verify_scale": self.costs.verify_scale, "verify_scales": dict(self.costs.verify_scales),
                    "draft_scale": dict(self.costs.draft_scale), "step_scales": dict(self.costs.step_scales),
                    "family_gaps": dict(self.family_gaps), "family_wait": dict(self.family_wait)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Start from what an earlier process learned on this machine (see `state`); unknown arms are ignored."""
        if state.get("version") != 1:
            return
        by_name = {a.name: a for a in self.arms}
        for key, stats in (("greedy", self.greedy_stats), ("sampled", self.sampled_stats)):
            part = state.get(key, {})
            for name, c in part.get("chains", {}).items():
                if name in stats.chains:
                    stats.chains[name].set_counts([float(x) for x in c["hits"]], [float(x) for x in c["tries"]])
            for name, (steps, tokens, predicted) in part.get("arms", {}).items():
                if name in by_name:
                    arm = by_name[name]
                    stats.arm_steps[arm], stats.arm_tokens[arm], stats.arm_predicted[arm] = steps, tokens, predicted
            stats.families.clear()
        for name, seconds in state.get("draft_seconds", {}).items():
            if name in by_name:
                self.costs.draft_seconds[by_name[name]] = float(seconds)
        self.costs.verify_scale = float(state.get("verify_scale", 1.0))
        self.costs.verify_scales = {str(k): float(v) for k, v in state.get("verify_scales", {}).items()}
        self.costs.verify_counts = {k: 10 for k in self.costs.verify_scales}  # restored: a moving average
        self.costs.draft_scale = {str(k): float(v) for k, v in state.get("draft_scale", {}).items()}
        self.costs.step_scales = {str(k): float(v) for k, v in state.get("step_scales", {}).items()}
        # scales learned in another process count from now, as if learned at this step: stale once it has run a while
        now = self.costs.steps
        self.costs.seen = {k: now for k in self.costs.verify_scales} | {f"step:{k}": now for k in self.costs.step_scales}
        self.family_gaps = {str(k): max(1, min(FAMILY_MAX_GAP, int(v))) for k, v in state.get("family_gaps", {}).items()}
        self.family_wait = {str(k): max(0, min(FAMILY_MAX_GAP, int(v))) for k, v in state.get("family_wait", {}).items()}

    def family_turn(self, family: str) -> bool:
        """Whether a request starting now explores `family`: a family that lost its last exploration waits out
        its gap (`FAMILY_MAX_GAP`).  Each call is one request's turn."""
        with self.lock:
            wait = self.family_wait.get(family, 0)
            if wait > 0:
                self.family_wait[family] = wait - 1
                return False
            return True

    def family_result(self, family: str, paid: bool) -> None:
        """An exploration of `family` ran: beside `ar` it `paid` (every request explores it again) or lost
        (the gap between requests that explore it doubles, up to `FAMILY_MAX_GAP`)."""
        with self.lock:
            gap = 1 if paid else min(FAMILY_MAX_GAP, 2 * self.family_gaps.get(family, 1))
            self.family_gaps[family] = gap
            self.family_wait[family] = gap - 1

    def stats_for(self, sampling: SamplingParams) -> AcceptanceStats:
        return self.greedy_stats if sampling.greedy else self.sampled_stats

    def choose(self, sampling: SamplingParams, lookup_lengths: Mapping[str, int],
               max_tree_budget: int | None = None, load: SharedLoad | None = None, probe_plain: bool = False,
               explore: bool = False, backlog: Mapping[str, int] | None = None, remaining: int = 0,
               stats: AcceptanceStats | None = None, realized: RealizedRates | None = None,
               only: Collection[Arm] | None = None, rates_out: dict[Arm, float] | None = None) -> Arm:
        """The arm to run; `max_tree_budget`: only arms whose trees fit that many nodes (`ar` always does);
        `load`: the batched round the step shares (priced alone when None); `explore`: an exploring step
        (`choose_arm`).

        `backlog`: context tokens each arm kind's draft has not run yet (`AutoDrafter`), `remaining`: tokens
        left to generate.  Catching up is charged whole by a policy that does not learn times, and to an
        exploring step (half a step, as it runs twice), which then likely hands back to `ar` (explorations
        slow a run of `ar` steps: docs/measurements.md, "Explorations within a run of `ar` steps on an AVX2 EPYC"),
        and to any other step as its share of the remaining tokens, about two a step, since an arm that pays keeps
        its draft warm from then on.

        `stats`: the acceptance statistics to price with (default: the policy's own for `sampling`; a request
        passes its own, `AutoDrafter`).  `realized`: the request's realized / priced rate per arm kind
        (`stagedspec.realized_rates`), which scales each arm's solo price.

        `only`: the draft arms (`tree`, `staged`) to price, None: all (`ar`, `lookup` and `copy` arms are always
        priced: their prices move with this step's chains); `rates_out`: filled with the rates priced
        (`pricing.contenders`).

        `probe_plain`: `ar`'s step time has not been measured for a while (`AutoDrafter`): run `ar` now
        if the best arm's promise over it is small enough that `ar`'s true price could change the choice
        (`AR_PROBE_BELOW`).  The other arms' times are measured whenever they run; without probes, `ar`
        would be priced by a scale the others taught once it stopped running.
        """
        arms = self.arms if max_tree_budget is None else [a for a in self.arms if a.max_tree_budget <= max_tree_budget]
        if only is not None:
            arms = [a for a in arms if a.kind in ("ar", "lookup", "copy") or a in only]
        plain = Arm("ar")
        # A policy that does not learn times (a seeded sampled request's, priced by the profile and the priors)
        # charges a cold draft its whole catch-up: it can neither see that its first draft steps lost nor explore,
        # and on SmolLM2 prose at T=1 every such request had opened with a `staged` step that the prior priced
        # far above its yield, and ran slower than `ar` in all
        # (docs/measurements.md, "A seeded sampled request's first `staged` step on a Zen 4 EPYC").
        share = 0.5 if explore else 1.0 if not self.learn_times else min(1.0, 2.0 / max(1, remaining))
        catch_up = {kind: share * catch_up_seconds(Arm(kind), self.profile, n) for kind, n in (backlog or {}).items()}
        with self.lock:
            stats = stats if stats is not None else self.stats_for(sampling)
            arm = choose_arm(arms or [plain], self.profile, stats, self.costs,
                             lookup_lengths, not sampling.greedy, load, explore, catch_up, realized, rates_out)
            if probe_plain and not explore and arm != plain and plain in arms:
                rates = expected_rates([arm, plain], self.profile, stats, self.costs, lookup_lengths,
                                       not sampling.greedy, load, realized=realized)
                # `ar` timed on too few steps is probed whatever its price says: one slow early step (a cold
                # kernel) can price it far above its time, and it would never run again to show otherwise
                timed = self.stats_for(sampling).arm_steps.get(plain, 0)  # the shared steps: times are shared
                if rates[arm] < AR_PROBE_BELOW * rates[plain] or timed < AR_PROBE_MIN_STEPS:
                    arm = plain
            self.choices[arm.name] = self.choices.get(arm.name, 0) + 1
        return arm

    def best_in_family(self, family: str, sampling: SamplingParams, lookup_lengths: Mapping[str, int],
                       stats: AcceptanceStats | None = None, max_tree_budget: int | None = None,
                       realized: RealizedRates | None = None) -> Arm | None:
        """The best-priced arm of one family (`Arm.family`), whatever `ar` promises: what an exploration of
        that family runs (`AutoDrafter`).  None: the family has no arm that fits `max_tree_budget`."""
        arms = [a for a in self.arms if a.family == family
                and (max_tree_budget is None or a.max_tree_budget <= max_tree_budget)]
        if not arms:
            return None
        with self.lock:
            stats = stats if stats is not None else self.stats_for(sampling)
            rates = expected_rates(arms, self.profile, stats, self.costs, lookup_lengths, not sampling.greedy,
                                   realized=realized)
            arm = max(rates, key=lambda a: rates[a])
            self.choices[arm.name] = self.choices.get(arm.name, 0) + 1
        return arm

    def choose_plain(self) -> Arm:
        """`ar`, counted like a choice (`AutoDrafter` skips the pricing when nothing new could change it)."""
        return self.choose_again(Arm("ar"))

    def choose_again(self, arm: Arm) -> Arm:
        """`arm` once more without pricing (a plain run, an exploration's second step), counted as a choice."""
        with self.lock:
            self.choices[arm.name] = self.choices.get(arm.name, 0) + 1
        return arm
