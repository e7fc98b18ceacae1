"""What a step of an arm costs: the measured times (`StepCosts`), a step's seconds priced alone or in a
batched round (`SharedLoad`), its drafting and a draft's catching up."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from stagedspec.auto.arms import Arm, verify_rows
from stagedspec.costs import CostProfile

LOOKUP_SECONDS = 2e-4  # prior for a lookup proposal's cost, before it is measured
# A row count's own verification scale (`StepCosts.verify_scale_for`) starts from its kind's, worth this many steps
ROW_PRIOR_STEPS = 2.0
# A scale that has not learned for this many steps (of any arm) keeps half its weight against the next step's time,
# at most: the machine's speed drifts (`StepCosts.seen`).
STALE_HALF_LIFE = 32
STALE_KEEP = 0.5  # the least share of its weight a stale scale keeps (one noisy step cannot set the price alone)
STAGE_INNER_ACCEPT = 1.5  # prior tokens per draft pass when the draft is itself sped up by lookup


@dataclass
class StepCosts:
    """What the policy has measured about time: drafting per arm, and how real steps compare to the curve."""

    draft_seconds: dict[Arm, float] = field(default_factory=dict)  # running mean per arm
    verify_scale: float = 1.0  # measured verification time / the cost curve's prediction, all steps
    # The same per arm kind and decoding mode ("tree/sampled"): verifying a tree costs host work that
    # the cost curve (a pass) does not show, and `ar`'s step has the least.  One scale for all would
    # charge `ar` the trees' extra work (docs/measurements.md, "Verification time against the cost curve on an H100").
    verify_scales: dict[str, float] = field(default_factory=dict)
    # Per arm kind, measured drafting time / the cost curves' prediction: an arm not run yet is priced
    # by what its siblings taught (a GPU draft pass costs far more than its graph replay once the tree
    # building around it is counted), so every size need not be tried to learn that.
    draft_scale: dict[str, float] = field(default_factory=dict)
    # What whole steps cost against their calibrated price, per arm kind and decoding mode ("staged/sampled"):
    # the wall time from one `propose` to the next, so a step whose draft first runs over
    # every token it missed (after a run of `ar` steps; the whole prompt the first time), an exploration's
    # loss and the bookkeeping around a tree are all charged to what caused them.  The parts above leave
    # those out (a cold draft's time is not its arm's price); without this `auto` ran slower than `ar` while
    # each part's estimate was close (docs/measurements.md, "Whole-step scales on an AVX2 EPYC").
    step_scales: dict[str, float] = field(default_factory=dict)
    # `verify_scales` also holds a scale per kind and row count ("ar/greedy/r3"): the cost curve is measured once
    # per machine, and its shape need not hold in every process.  On a Zen 4 EPYC whose one-row pass ran 25 ms in
    # some processes and 34 ms in others, passes of 3-4 rows took about 36 ms in both, so one scale per kind, fitted
    # to its commonest row count, priced the others up to 25% off: greedy `copy` steps of 3 rows at 27-31 ms that
    # took 34-38, a one-draft-token `tree` step at 38 ms that took 33 (docs/measurements.md, "A verification scale
    # per row count on a Zen 4 EPYC").
    verify_counts: dict[str, int] = field(default_factory=dict)  # steps behind each of `verify_scales` (this run)
    # Steps observed so far (this run, quiet `ar` steps included, `advance`), and the step at which each scale of
    # `verify_scales` and `step_scales` last learned.  A scale learned long ago counts less against a new step
    # (`STALE_HALF_LIFE`): on a Zen 4 VM whose passes ran 0.7x as long from one request to the next, `ar`, probed once
    # in 32 steps, kept the price it learned at the slower speed while the arms that ran learned the faster one, and
    # `auto` ran a break-even arm at 0.85x `ar` (docs/measurements.md, "Stale prices on a Zen 4 EPYC").
    steps: int = 0
    seen: dict[str, int] = field(default_factory=dict)

    def advance(self, steps: int = 1) -> None:
        """Count `steps` more steps on the scales' clock (`seen`)."""
        self.steps += steps

    def _kept(self, key: str, weight: float) -> float:
        """The weight the old value of scale `key` keeps against a new step: `1 - weight`, less the longer it has
        not learned (halved every `STALE_HALF_LIFE` steps, never below `STALE_KEEP` of it).  Marks it learned now."""
        age = max(0, self.steps - self.seen.get(key, self.steps) - 1)
        self.seen[key] = self.steps
        return (1.0 - weight) * max(STALE_KEEP, 0.5 ** (age / STALE_HALF_LIFE))

    def step_scale_for(self, kind: str, sampled: bool) -> float:
        """Measured / calibrated seconds of whole steps of this arm kind (1 until seen): a draft's catch-up
        falls on the kind whose drafter it is (tree arms share one, staged arms another)."""
        return self.step_scales.get(_verify_key(kind, sampled), 1.0)

    def observe_step(self, arm: Arm, wall_seconds: float, predicted: float, sampled: bool) -> None:
        """Fold in one whole step: `wall_seconds` from its `propose` to the next, against `predicted` (the
        calibrated price without this scale).  Clipped like the others, so one stall does not rule."""
        if predicted > 0 and wall_seconds > 0:
            ratio = min(4.0, max(0.25, wall_seconds / predicted))
            key = _verify_key(arm.kind, sampled)  # from 1: the parts' scales already took the first lesson
            keep = self._kept("step:" + key, 0.1)
            self.step_scales[key] = keep * self.step_scales.get(key, 1.0) + (1.0 - keep) * ratio

    def verify_scale_for(self, kind: str, sampled: bool, rows: int | None = None) -> float:
        """Measured / predicted verification time of a step of this arm kind (all steps' scale until seen); with
        `rows`, of its steps of that many rows (the kind's scale until seen)."""
        key = _verify_key(kind, sampled)
        scale = self.verify_scales.get(key, self.verify_scale)
        return scale if rows is None else self.verify_scales.get(_rows_key(key, rows), scale)

    def draft_estimate(self, arm: Arm, predicted: float) -> float:
        """Seconds of `arm`'s drafting: its own record, else the prediction scaled by its kind's record."""
        seen = self.draft_seconds.get(arm)
        return seen if seen is not None else predicted * self.draft_scale.get(arm.kind, 1.0)

    def observe(self, arm: Arm, draft_seconds: float | None, verify_seconds: float, predicted_verify: float,
                predicted_draft: float, sampled: bool = False, rows: int | None = None) -> None:
        """Fold in one step's times; `draft_seconds=None`: the drafting time is not the arm's (its draft
        caught up on the tokens other arms decoded), so only the verification is learned.  `rows`: the
        step's verification rows, whose own scale learns too (starting from the kind's, `ROW_PRIOR_STEPS`).

        Single outliers are clipped to 3x the current estimate (the prediction
        before the first observation).
        """
        self.advance()
        if draft_seconds is not None:
            self._observe_draft(arm, draft_seconds, predicted_draft)
        if predicted_verify > 0 and verify_seconds > 0:
            ratio = min(4.0, max(0.25, verify_seconds / predicted_verify))
            self.verify_scale = 0.9 * self.verify_scale + 0.1 * ratio
            key = _verify_key(arm.kind, sampled)
            kind_scale = self.verify_scales.get(key)
            # a mean of the first steps, then a moving average: one cold first step does not set the price
            self._observe_scale(key, ratio, ratio, 0.0)
            if rows is not None:
                self._observe_scale(_rows_key(key, rows), ratio, ratio if kind_scale is None else kind_scale,
                                    ROW_PRIOR_STEPS)

    def _observe_scale(self, key: str, ratio: float, prior: float, prior_steps: float) -> None:
        """One step's measured / predicted `ratio` into `verify_scales[key]`: the mean of the first steps (and
        `prior_steps` of `prior`, where the key is new), then a moving average, whose past counts less the longer
        it has not learned (`_kept`)."""
        n = self.verify_counts.get(key, 0)
        scale = self.verify_scales.get(key, prior)
        keep = self._kept(key, max(0.1, 1.0 / (n + 1 + prior_steps)))
        self.verify_scales[key] = keep * scale + (1.0 - keep) * ratio
        self.verify_counts[key] = n + 1

    def _observe_draft(self, arm: Arm, draft_seconds: float, predicted_draft: float) -> None:
        if predicted_draft > 0 and draft_seconds > 0:
            ratio = min(20.0, max(0.05, draft_seconds / predicted_draft))
            scale = self.draft_scale.get(arm.kind)
            self.draft_scale[arm.kind] = ratio if scale is None else 0.8 * scale + 0.2 * ratio
        old = self.draft_seconds.get(arm)
        first = old is None
        old = predicted_draft if first else old
        clipped = min(3.0 * old, max(old / 3.0, draft_seconds)) if old > 0 else draft_seconds
        self.draft_seconds[arm] = clipped if first else 0.8 * old + 0.2 * clipped


# The kind whose measured scales an arm kind's greedy steps share.  A greedy `lookup` or `copy` step is an `ar`
# step with more rows (its chains cost microseconds and no model, and checking a chain is a comparison per row),
# so its price is `ar`'s measured time moved along the cost curve: scales learned apart had each carried the
# machine's noise between neighbouring requests, and on SmolLM2 chat `auto` chose `copy` or `lookup` arms over
# `ar` on steps whose chains added no row or none that was accepted, running slower than `ar`.  Sampled steps
# keep a scale per kind: verifying a sampled chain does host work per node that `ar`'s step has not
# (docs/measurements.md, "Greedy lookup and copy steps on `ar`'s scale on a Zen 4 EPYC").
GREEDY_SCALE_KIND = {"ar": "ar", "lookup": "ar", "copy": "ar", "tree": "tree", "staged": "staged"}
_KEYS = {(kind, sampled): f"{kind if sampled else GREEDY_SCALE_KIND[kind]}/{'sampled' if sampled else 'greedy'}"
         for kind in GREEDY_SCALE_KIND for sampled in (False, True)}


def _rows_key(key: str, rows: int) -> str:
    """A kind's verification key (`_verify_key`) narrowed to steps of `rows` rows: "ar/greedy/r3"."""
    return f"{key}/r{int(rows)}"


def _verify_key(kind: str, sampled: bool) -> str:
    """"tree/greedy" etc. (looked up, not formatted: it is asked for several times per arm priced); `lookup`
    and `copy` steps share `ar`'s when greedy (`GREEDY_SCALE_KIND`)."""
    key = _KEYS.get((kind, sampled))
    return key if key is not None else f"{kind}/{'sampled' if sampled else 'greedy'}"


def solo_step_seconds(arm: Arm, profile: CostProfile, costs: StepCosts, lookup_lengths: Mapping[str, int],
                      sampled: bool = False, whole: bool = True) -> float:
    """Expected seconds of a step of `arm` priced alone: its verification (the cost curve with the host work
    around it, scaled as that arm kind's steps of as many rows measured) and its drafting (measured, else
    predicted); `whole`: times the whole-step scale (`StepCosts.step_scales`), which the steps teach against the
    rest."""
    rows = verify_rows(arm, lookup_lengths)
    seconds = costs.verify_scale_for(arm.kind, sampled, rows) * profile.step_seconds(rows, sampled)
    seconds += costs.draft_estimate(arm, predicted_draft_seconds(arm, profile, sampled))
    return seconds * costs.step_scale_for(arm.kind, sampled) if whole else seconds


def predicted_draft_seconds(arm: Arm, profile: CostProfile, sampled: bool = False) -> float:
    """Drafting time of one step of `arm`, from the drafts' measured cost curves (before any is measured).

    Each draft pass also costs the host work around it (growing the tree,
    sampling, bookkeeping), measured once with the curves
    (`CostProfile.draft_overhead`): on a GPU that is most of a draft pass.
    """
    if arm.kind == "ar":
        return 0.0
    if arm.kind in ("lookup", "copy") or not profile.drafts:
        return LOOKUP_SECONDS
    extra = profile.draft_pass_overhead(sampled)
    catch_up = profile.draft_seconds(0, 2)  # the last step's accepted tokens, run through the draft
    if arm.kind == "tree":  # the catch-up pass also gives the root's children; then a pass per deeper level
        rows = draft_pass_rows(arm)
        return catch_up + sum(profile.draft_seconds(0, r) + extra for r in rows[1:])
    passes = math.ceil(arm.size / STAGE_INNER_ACCEPT)
    return LOOKUP_SECONDS + catch_up + passes * (profile.draft_seconds(0, 3) + extra)


@dataclass(frozen=True)
class SharedLoad:
    """One request's view, before its step, of the batched round it is about to share (the server's state).

    Built by the scheduler from the rounds already run (`stagedspec.server.scheduler`), never from the
    round in progress, so the step's tree shape depends only on history and server state known before it.
    `others`: the other requests in the round.  `oracle_rows`: the rows their steps put in the round's
    oracle pass.  `draft_phases`: draft passes the others' steps run (the round's draft phases: a lane's
    k-th draft pass joins the k-th ragged draft pass), `draft_rows`: their rows per such phase.
    `seconds` / `tokens`: the others' share of a round's measured wall time and of its emitted tokens.
    """

    others: int = 0
    oracle_rows: float = 0.0
    draft_phases: int = 0
    draft_rows: float = 0.0
    seconds: float = 0.0
    tokens: float = 0.0
    # Measured / predicted time of the recent rounds' oracle passes, and of the rest of their rounds (draft
    # passes and the lanes' host work around them): the cost profile, solo and quiet-machine, scaled to the
    # shared passes as they run.
    oracle_scale: float = 1.0
    draft_scale: float = 1.0

    @property
    def requests(self) -> int:
        """Requests in the round, this one included."""
        return self.others + 1


def draft_pass_rows(arm: Arm) -> list[int]:
    """Rows of each draft pass of one step of `arm` (the first: catching the draft up on the last step's
    tokens), as `predicted_draft_seconds` counts them.  A tree's catch-up pass ends at its root, so it gives the
    root's children too: a tree of d levels runs d passes (a fan, one), not d + 1."""
    if arm.kind == "tree":
        depth = arm.tree_depth
        return [2] + [min(8, math.ceil(arm.size / depth) + 1)] * (depth - 1)
    if arm.kind == "staged":
        return [2] + [3] * math.ceil(arm.size / STAGE_INNER_ACCEPT)
    return []


def shared_step_seconds(arm: Arm, profile: CostProfile, load: SharedLoad, lookup_lengths: Mapping[str, int],
                        sampled: bool = False) -> float:
    """Seconds `arm`'s step adds to a batched round shared with `load.others` requests.

    - oracle: its rows at the margin of the others' rows on the cost curve, cost(R + r) - cost(R) (the
      pass's fixed cost is paid by the round whatever this request runs), plus its segment's own cost;
    - drafting: each draft pass inside the phases the others already run costs its marginal rows and its
      segment; a pass beyond them opens a new phase, priced as if every request in the round ran it
      (its cost over `requests`): phases are shared, so one request pricing a new phase alone would keep
      all from opening one even when all would gain (with identical requests, a request's gain and its
      share of the cost scale alike, so the choice is the round's best common arm);
    - plus the host work around each draft pass (`draft_overhead`), which the lanes do one at a time.

    With no others this is the solo price (`expected_rates`' seconds with unit scales).
    """
    rows = verify_rows(arm, lookup_lengths)
    base = load.oracle_rows
    if load.others and base > 0:
        seconds = profile.oracle_seconds(base + rows) - profile.oracle_seconds(base) + profile.segment_cost(-1)
    else:
        seconds = profile.oracle_seconds(rows)
    seconds *= load.oracle_scale
    if arm.kind == "ar":
        return seconds
    if arm.kind in ("lookup", "copy") or not profile.drafts:
        return seconds + LOOKUP_SECONDS
    return seconds + load.draft_scale * _shared_draft_seconds(arm, profile, load, sampled)


def _shared_draft_seconds(arm: Arm, profile: CostProfile, load: SharedLoad, sampled: bool) -> float:
    """`shared_step_seconds`' drafting part, unscaled."""
    seconds = 0.0
    extra = profile.draft_pass_overhead(sampled)
    n, phases, per_phase = load.requests, load.draft_phases if load.others else 0, load.draft_rows
    if arm.kind == "staged":
        seconds += LOOKUP_SECONDS
    for k, r in enumerate(draft_pass_rows(arm)):
        if k < phases:
            seconds += profile.draft_seconds(0, per_phase + r) - profile.draft_seconds(0, per_phase)
            seconds += profile.segment_cost(0)
        else:
            seconds += profile.draft_seconds(0, n * r) / n + profile.segment_cost(0) * (n - 1) / n
        if k:
            seconds += extra
    return seconds


def catch_up_seconds(arm: Arm, profile: CostProfile, backlog: int) -> float:
    """Seconds a model-drafting arm's draft spends on the `backlog` context tokens it has not run yet beyond
    the two a step normally brings (after a run of `ar` steps; the whole prompt before its first step)."""
    if arm.kind not in ("tree", "staged") or not profile.drafts or backlog <= 2:
        return 0.0
    return max(0.0, _long_pass_seconds(profile, backlog) - profile.draft_seconds(0, 2))


def _long_pass_seconds(profile: CostProfile, rows: int) -> float:
    """A draft pass over `rows` rows, past the curve's last measured row count as passes of that many.

    Static passes run more rows than their largest bucket as several passes of it (`runner.BUCKETS`), and a
    GPU's curve is flat up to there: extended past its last two points it priced a 0.5B draft's catch-up over
    a prompt as about one pass, and the exploration that ran it took several times its price
    (docs/measurements.md, "A draft's catch-up priced past the curve on an H200").  On a CPU a long pass costs
    about its rows' share of the largest either way."""
    top = max(profile.drafts[0])
    if rows <= top:
        return profile.draft_seconds(0, rows)
    full, rest = divmod(rows, top)
    return full * profile.draft_seconds(0, top) + (profile.draft_seconds(0, rest) if rest else 0.0)
