"""`--method auto`, `--dtype auto` and the measured cost profiles behind them.

Choosing an arm is a pure function of (cost curves, acceptance statistics),
so it is tested on synthetic curves: a flat one must pick big trees, a steep
one plain decoding, and a draft that is never accepted must be dropped.
"""

from __future__ import annotations

import json

import pytest
import torch

from stagedspec.auto import (
    FAN_SIZES,
    Arm,
    AcceptanceStats,
    AutoPolicy,
    ChainStats,
    SharedLoad,
    StepCosts,
    arms_for,
    choose_arm,
    draft_pass_rows,
    expected_rates,
    expected_tokens,
    matched_prefix,
    predicted_draft_seconds,
    shared_step_seconds,
    spine,
    verify_rows,
)
from stagedspec.costs import PROFILE_VERSION, CostProfile, interpolate, monotone, profile_path
from stagedspec.profiling import load_or_measure
from stagedspec.drafters.base import Drafter
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_thread", "private_cost_cache")

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
FLAT = CostProfile(oracle={r: 0.010 for r in ROWS}, drafts=[{r: 0.0005 for r in (1, 2, 4, 8)}])
STEEP = CostProfile(oracle={r: 0.010 * r for r in ROWS}, drafts=[{r: 0.0005 for r in (1, 2, 4, 8)}])
ARMS = arms_for(has_lookup=True, has_draft=True)
NO_LOOKUP_NOW = {"context": 0, "ngram": 0}


def trained_stats(draft: float, context: float = 0.5, ngram: float = 0.3, steps: int = 200) -> AcceptanceStats:
    """Statistics as if each proposer's chains had been accepted with these per-depth rates."""
    stats = AcceptanceStats()
    g = torch.Generator().manual_seed(0)
    for name, rate in (("draft", draft), ("context", context), ("ngram", ngram)):
        for _ in range(steps):
            matched = 0
            while matched < 8 and float(torch.rand((), generator=g)) < rate:
                matched += 1
            stats.chains[name].record(matched, 8)
    return stats


def arm_names_run(drafter: Drafter, context: list[int], steps: int, max_tokens: int) -> list[str]:
    """The arm each of `steps` steps of an `AutoDrafter` ran ("ar" for a quiet step), one token emitted a step,
    each step's verification reported as 10 ms."""
    drafter.begin(context)
    out = []
    for _ in range(steps):
        drafter.propose(context, SamplingParams(), None, max_tokens)
        drafter.verified(0.01)
        out.append(drafter._last.arm.name if drafter._last is not None else "ar")
        context = context + [4]
    return out


class OneNodeDrafter(Drafter):
    """Proposes a one-node chain every step: a model drafter in miniature."""

    def begin(self, prompt):  # noqa: ANN001, ANN201
        pass

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        return TokenTree.chain(context[-1], [5])


def test_a_sampled_chains_first_token_counts_by_its_acceptance_probability() -> None:
    """`ChainStats.record(..., first=P)`: depth 1 counts P in place of the draw (its expectation, less noise);
    deeper depths count their draws, each given its parent's acceptance."""
    s = ChainStats(0.5)
    s.record(matched=0, length=3, first=0.4)  # rejected, though it had 40% odds
    s.record(matched=2, length=3, first=0.9)
    assert s.tries == [2.0, 1.0, 1.0] and s.hits == pytest.approx([1.3, 1.0, 0.0])
    s.record(matched=1, length=3)  # greedy: the draw is the outcome
    assert s.hits[0] == pytest.approx(2.3) and s.tries[:2] == [3.0, 2.0]


def test_a_flat_cost_curve_picks_big_trees() -> None:
    arm = choose_arm(ARMS, FLAT, trained_stats(draft=0.7), StepCosts(), NO_LOOKUP_NOW)
    assert arm.kind in ("tree", "staged") and arm.max_tree_budget >= 8, arm


def test_a_steep_cost_curve_picks_no_speculation() -> None:
    assert choose_arm(ARMS, STEEP, trained_stats(draft=0.7), StepCosts(), {"context": 4, "ngram": 4}) == Arm("ar")


def test_a_draft_that_is_never_accepted_is_dropped() -> None:
    arm = choose_arm(ARMS, FLAT, trained_stats(draft=0.0), StepCosts(), {"context": 6, "ngram": 6})
    assert arm.kind in ("lookup", "ar"), arm
    assert choose_arm(ARMS, FLAT, trained_stats(draft=0.0, context=0.0, ngram=0.0), StepCosts(),
                      {"context": 6, "ngram": 6}) == Arm("ar")


def test_a_lookup_chain_that_does_not_exist_now_is_worth_nothing() -> None:
    stats = trained_stats(draft=0.0, context=0.9, ngram=0.0)
    assert expected_tokens(Arm("lookup", 4), stats, {"context": 0, "ngram": 0}) == 1.0
    assert expected_tokens(Arm("lookup", 4), stats, {"context": 4}) > 3.0
    assert choose_arm(ARMS, FLAT, stats, StepCosts(), {"context": 6}).kind == "lookup"


def test_measured_draft_time_overrides_the_prediction() -> None:
    stats = trained_stats(draft=0.7)
    costs = StepCosts()
    for arm in ARMS:
        if arm.kind in ("tree", "staged"):
            costs.draft_seconds[arm] = 1.0  # drafting turned out to cost 100 oracle passes
    assert choose_arm(ARMS, FLAT, stats, costs, NO_LOOKUP_NOW).kind in ("ar", "lookup")


def test_verification_time_is_learned_per_arm_kind_so_ar_is_not_charged_the_trees_work() -> None:
    """On a GPU at T=1 a lookup step's verification cost far more than its pass (host work per node),
    while `ar`'s did not: with one scale for both, `ar` was priced like lookup and lost to it."""
    stats = trained_stats(draft=0.0, context=0.35, ngram=0.0)
    lookup_now = {"context": 4, "ngram": 0}
    costs = StepCosts()
    assert choose_arm(ARMS, FLAT, stats, costs, lookup_now, sampled=True).kind == "lookup"
    for _ in range(60):  # lookup's steps took 1.6x the curve, ar's 1.0x
        costs.observe(Arm("lookup", 4), 2e-4, 0.016, 0.010, 2e-4, sampled=True)
        costs.observe(Arm("ar"), 0.0, 0.010, 0.010, 0.0, sampled=True)
    assert costs.verify_scale_for("lookup", True) == pytest.approx(1.6, rel=0.01)
    assert costs.verify_scale_for("ar", True) == pytest.approx(1.0, rel=0.01)
    assert costs.verify_scale_for("tree", True) == pytest.approx(costs.verify_scale)  # not seen: all steps' scale
    plain_or_lookup = [a for a in ARMS if a.kind in ("ar", "lookup")]
    assert choose_arm(plain_or_lookup, FLAT, stats, costs, lookup_now, sampled=True) == Arm("ar")
    assert costs.verify_scale_for("lookup", False) == pytest.approx(costs.verify_scale)  # greedy: not seen yet


def test_a_step_is_priced_with_its_verification_overhead() -> None:
    """The measured host work of verifying (per mode, linear in the rows) is part of a step's price: with a
    sampled tree's verification dear, as on a GPU at T=1, a lookup chain that would win on passes alone loses."""
    cheap = CostProfile(oracle={r: 0.003 for r in ROWS}, drafts=FLAT.drafts)
    dear = CostProfile(oracle=cheap.oracle, drafts=FLAT.drafts,
                       verify_overhead={"greedy": [0.0002, 0.0004], "sampled": [0.0004, 0.0074]})
    assert dear.step_seconds(1, True) == pytest.approx(0.0034)
    assert dear.step_seconds(8, True) == pytest.approx(0.0104) and dear.step_seconds(15, True) == pytest.approx(0.0174)
    assert dear.step_seconds(8, False) == pytest.approx(0.0034) and cheap.step_seconds(8, True) == 0.003
    stats = trained_stats(draft=0.0, context=0.3, ngram=0.0)
    lookup_now = {"context": 6, "ngram": 0}
    plain_or_lookup = [a for a in ARMS if a.kind in ("ar", "lookup")]
    assert choose_arm(plain_or_lookup, cheap, stats, StepCosts(), lookup_now, sampled=True).kind == "lookup"
    assert choose_arm(plain_or_lookup, dear, stats, StepCosts(), lookup_now, sampled=True) == Arm("ar")


def test_ar_is_probed_when_its_price_could_change_the_choice() -> None:
    """After `AR_PROBE_EVERY` steps without `ar`, a step runs it when the best arm's lead is small (its
    measured time keeps `ar`'s price honest), or when `ar` ran too few steps to be priced, never when the
    lead is large and `ar`'s price measured."""
    from stagedspec.auto import AR_PROBE_MIN_STEPS

    close = AutoPolicy(ARMS, FLAT)
    close.sampled_stats = trained_stats(draft=0.0, context=0.3, ngram=0.0)
    t1 = SamplingParams(temperature=1.0)
    lookup_now = {"context": 4, "ngram": 0}
    assert close.choose(t1, lookup_now).kind == "lookup"
    assert close.choose(t1, lookup_now, probe_plain=True) == Arm("ar")
    far = AutoPolicy(ARMS, FLAT)
    far.greedy_stats = trained_stats(draft=0.8)
    # `ar` timed on too few steps is probed whatever the lead: its price is not measured enough to trust
    assert far.choose(SamplingParams(), NO_LOOKUP_NOW, probe_plain=True) == Arm("ar")
    for _ in range(AR_PROBE_MIN_STEPS):
        far.greedy_stats.observe_arm(Arm("ar"), 1.0, 1)
    assert far.choose(SamplingParams(), NO_LOOKUP_NOW, probe_plain=True).kind in ("tree", "staged")


def test_chain_stats_learn_per_depth_rates_from_a_prior() -> None:
    s = ChainStats(prior=0.5, weight=2.0)
    assert s.rate(0) == pytest.approx(0.5) and s.rate(5) == pytest.approx(0.5)
    for _ in range(50):
        s.record(matched=1, length=4)  # depth 0 always accepted, depth 1 always rejected
    assert s.rate(0) > 0.95 and s.rate(1) < 0.1
    assert s.tries[:3] == [50, 50] and len(s.tries) == 2  # depth 2 was never reached
    reach = s.reach(3)
    assert reach[0] > 0.95 and reach[1] < 0.1 and reach[2] <= reach[1]


def test_arm_calibration_follows_what_the_arm_yielded() -> None:
    stats = AcceptanceStats()
    arm = Arm("tree", 8)
    for _ in range(30):
        stats.observe_arm(arm, predicted_tokens=3.0, tokens=2)  # half the predicted extra tokens
    assert stats.calibration(arm) == pytest.approx(0.5, abs=0.05)


def test_arm_calibration_is_learned_against_the_raw_prediction() -> None:
    """What a step records is the chains' prediction without the calibration, so the factor reaches the true
    actual/predicted ratio (recording the calibrated prediction made it settle at its square root)."""
    stats = AcceptanceStats()
    arm = Arm("tree", 8)
    raw = expected_tokens(arm, stats, {}, calibrated=False) - 1.0  # the chains' prior: about 2 extra tokens
    assert raw > 1.5
    for _ in range(400):  # the arm yields one extra token a step, as `AutoDrafter` records it
        stats.observe_arm(arm, predicted_tokens=expected_tokens(arm, stats, {}, calibrated=False), tokens=2)
    assert stats.calibration(arm) == pytest.approx(1.0 / raw, rel=0.05)
    assert expected_tokens(arm, stats, {}) == pytest.approx(2.0, rel=0.05)


def test_spine_and_matched_prefix() -> None:
    tree = TokenTree([0], [-1])
    a = tree.add(0, 5)
    tree.add(0, 6)
    tree.add(a, 7)
    assert spine(tree) == [5, 7]
    assert matched_prefix([5, 7, 9], [5, 7, 8, 1]) == 2 and matched_prefix([5], []) == 0


def test_arms_depend_on_what_can_propose_and_the_device() -> None:
    assert arms_for(False, False) == [Arm("ar")]
    assert {a.kind for a in arms_for(True, False)} == {"ar", "lookup", "copy"}
    assert {a.kind for a in arms_for(True, False, has_context=False)} == {"ar", "lookup"}  # an n-gram alone
    assert {a.kind for a in arms_for(True, True, kind="lookup")} == {"ar", "lookup", "copy"}


def test_a_copy_arm_verifies_the_prompt_lookup_chain_alone() -> None:
    """`copy:k` puts only the context chain in the pass (a `lookup` arm adds the n-gram's two chains), and is
    priced by the context chain's acceptance alone: where rows are dear and the n-gram is seldom right, it
    beats both `ar` and `lookup`."""
    from stagedspec.auto import verify_rows

    lengths = {"context": 6, "ngram": 6}
    assert verify_rows(Arm("copy", 4), lengths) == 5 and verify_rows(Arm("lookup", 4), lengths) == 13
    assert verify_rows(Arm("copy", 4), {"ngram": 6}) == 1
    stats = trained_stats(draft=0.0, context=0.8, ngram=0.05)
    assert expected_tokens(Arm("copy", 4), stats, lengths) == pytest.approx(
        1 + sum(stats.chains["context"].reach(4)))
    dear_rows = CostProfile(oracle={r: 0.005 * (1 + 0.2 * (r - 1)) for r in ROWS}, drafts=[])  # the native kernels'
    assert choose_arm([Arm("ar"), Arm("lookup", 4), Arm("copy", 4)], dear_rows, stats, StepCosts(), lengths) == \
        Arm("copy", 4)
    assert max(a.size for a in arms_for(False, True, "cuda") if a.kind == "tree") > max(
        a.size for a in arms_for(False, True, "cpu") if a.kind == "tree")


# --- pricing in the batched server's shared passes -----------------------------------------------------------------

# A CPU-like curve: 10 ms a pass, flat to 8 rows, then 0.25 ms a row to 32 rows and 1 ms a row beyond (rows cost
# once the batch fills the kernels, more once it is compute-bound); a draft pass 1 ms, flat to 4 rows, then 0.1 ms
# a row; per-segment costs; host work per draft pass.
BATCH_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
SHARED = CostProfile(oracle={r: 0.010 + 0.00025 * min(24, max(0, r - 8)) + 0.001 * max(0, r - 32) for r in BATCH_ROWS},
                     drafts=[{r: 0.001 + 0.0001 * max(0, r - 4) for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)}],
                     draft_overhead={"greedy": 2e-4, "sampled": 4e-4}, segment_seconds=[0.002, 0.0003])


def shared_load(others: int, rows_each: float, phases: int, draft_rows_each: float, seconds_each: float = 0.012,
                tokens_each: float = 2.0) -> SharedLoad:
    """The view of a request whose `others` neighbours each put these rows in the last round."""
    return SharedLoad(others=others, oracle_rows=others * rows_each, draft_phases=phases,
                      draft_rows=others * draft_rows_each, seconds=others * seconds_each, tokens=others * tokens_each)


@pytest.mark.parametrize("profile", [FLAT, STEEP, SHARED], ids=["flat", "steep", "shared"])
@pytest.mark.parametrize("draft", [0.0, 0.5, 0.8])
@pytest.mark.parametrize("lookup", [{"context": 0, "ngram": 0}, {"context": 6, "ngram": 3}])
def test_alone_in_the_batch_the_price_and_the_choice_are_the_solo_ones(profile, draft, lookup) -> None:  # noqa: ANN001
    stats = trained_stats(draft=draft)
    alone = SharedLoad()  # the only running request: what the scheduler gives a request with no neighbours
    for arm in ARMS:
        solo = profile.oracle_seconds(verify_rows(arm, lookup)) + predicted_draft_seconds(arm, profile)
        assert shared_step_seconds(arm, profile, alone, lookup) == pytest.approx(solo, rel=1e-9), arm
    assert expected_rates(ARMS, profile, stats, StepCosts(), lookup, load=alone) == expected_rates(
        ARMS, profile, stats, StepCosts(), lookup)
    solo_choice = choose_arm(ARMS, profile, stats, StepCosts(), lookup)
    assert choose_arm(ARMS, profile, stats, StepCosts(), lookup, load=alone) == solo_choice
    assert choose_arm(ARMS, profile, stats, StepCosts(), lookup, load=None) == solo_choice
    # neighbours with nothing measured yet (no round timed): priced alone too
    assert choose_arm(ARMS, profile, stats, StepCosts(), lookup, load=SharedLoad(others=3)) == solo_choice


def test_a_request_s_rows_cost_their_margin_of_the_shared_pass() -> None:
    tree = Arm("tree", 16)
    assert verify_rows(tree, {}) == 17
    oracle_only = CostProfile(oracle=SHARED.oracle, segment_seconds=SHARED.segment_seconds)  # drafting: ~0
    alone = shared_step_seconds(tree, oracle_only, SharedLoad(), {})
    assert alone == pytest.approx(oracle_only.oracle_seconds(17), abs=1e-3)  # the pass's 10 ms and its rows
    # others with 40 rows: its 17 rows cost 17 x 1 ms of the curve's slope there, plus its segment
    crowded = shared_step_seconds(tree, oracle_only, shared_load(7, 40 / 7, 0, 0), {})
    assert crowded - alone == pytest.approx(17 * 0.001 + 0.002 - oracle_only.oracle_seconds(17))
    # an `ar` step in the crowd costs its margin, not the pass's 10 ms
    assert shared_step_seconds(Arm("ar"), SHARED, shared_load(7, 40 / 7, 0, 0), {}) == pytest.approx(0.003)


def test_at_high_load_arms_cheap_per_row_win() -> None:
    """Solo the pass is flat to 8 rows and a big tree wins; in a crowded pass every row costs the curve's slope
    there, and the arms that buy their tokens with fewer rows win, as the model says."""
    stats = trained_stats(draft=0.75, context=0.0, ngram=0.0)
    lookup = NO_LOOKUP_NOW
    solo = choose_arm(ARMS, SHARED, stats, StepCosts(), lookup)
    assert solo.kind in ("tree", "staged") and verify_rows(solo, lookup) >= 5, solo
    # 7 others, 4 draft phases, a round of 4 ms and 2 tokens per request; more rows each time
    loads = [shared_load(7, rows, 4, 3, 0.004) for rows in (1, 3, 6, 12)]
    chosen = [choose_arm(ARMS, SHARED, stats, StepCosts(), lookup, load=load) for load in loads]
    rows = [verify_rows(arm, lookup) for arm in chosen]
    assert rows == sorted(rows, reverse=True) and rows[-1] < verify_rows(solo, lookup), chosen
    # and the choice is the arm with the best round rate: tokens per marginal second beat the round's rate
    load = loads[-1]
    best = chosen[-1]
    rate = (load.tokens + expected_tokens(best, stats, lookup)) / (
        load.seconds + shared_step_seconds(best, SHARED, load, lookup))
    assert rate == pytest.approx(max(expected_rates(ARMS, SHARED, stats, StepCosts(), lookup, load=load).values()))


def test_draft_phases_the_others_run_are_cheap_to_join() -> None:
    """Drafting that costs a solo request more than it gains is worth it inside the draft phases its
    neighbours already run (their fixed cost is paid), and a new phase is priced as shared by the round."""
    slow_draft = CostProfile(oracle={r: 0.010 + 0.0002 * max(0, r - 8) for r in BATCH_ROWS},
                             drafts=[{r: 0.006 for r in (1, 2, 4, 8, 16, 32, 48)}],
                             draft_overhead={"greedy": 1e-4, "sampled": 1e-4}, segment_seconds=[0.001, 0.0002])
    stats = trained_stats(draft=0.85, context=0.45, ngram=0.0)
    lookup = {"context": 6, "ngram": 0}
    assert choose_arm(ARMS, slow_draft, stats, StepCosts(), lookup).kind in ("lookup", "ar")
    joined = choose_arm(ARMS, slow_draft, stats, StepCosts(), lookup, load=shared_load(7, 4, 5, 3, 0.004, 2.0))
    assert joined.kind in ("tree", "staged"), joined
    staged = Arm("staged", 3)
    inside = shared_step_seconds(staged, slow_draft, shared_load(7, 4, 5, 3), lookup)
    beyond = shared_step_seconds(staged, slow_draft, shared_load(7, 4, 0, 0), lookup)
    alone = shared_step_seconds(staged, slow_draft, SharedLoad(), lookup)
    assert inside < beyond < alone
    assert len(draft_pass_rows(staged)) == 3  # the catch-up pass, then two passes of the draft stage


def test_fans_are_one_level_trees_whose_root_gets_every_node() -> None:
    """`tree:1` and `tree:kd1`: one draft pass (the catch-up pass ends at the root and gives its children), priced
    so; a deeper tree arm runs a pass per level past the first, with two children a node."""
    arms = arms_for(has_lookup=True, has_draft=True)
    names = {a.name for a in arms}
    assert {"tree:1", *(f"tree:{k}d1" for k in FAN_SIZES)} <= names and "tree:4" in names
    fan, deep = Arm("tree", 3, depth=1), Arm("tree", 4)
    assert (fan.name, fan.tree_depth, fan.tree_branching) == ("tree:3d1", 1, 3)
    assert (deep.tree_depth, deep.tree_branching) == (4, 2) and fan != Arm("tree", 3)
    assert draft_pass_rows(fan) == [2] and draft_pass_rows(Arm("tree", 1)) == [2]
    assert len(draft_pass_rows(deep)) == deep.tree_depth
    profile = CostProfile(oracle={r: 0.010 for r in ROWS}, drafts=[{r: 0.001 for r in (1, 2, 4, 8)}],
                          draft_overhead={"greedy": 1e-4, "sampled": 1e-4})
    assert predicted_draft_seconds(fan, profile) == pytest.approx(0.001)  # the catch-up pass alone
    assert predicted_draft_seconds(deep, profile) == pytest.approx(0.001 + 3 * (0.001 + 1e-4))
    stats = trained_stats(draft=0.4)
    assert 1.0 < expected_tokens(Arm("tree", 1), stats, NO_LOOKUP_NOW) < expected_tokens(fan, stats, NO_LOOKUP_NOW) < 2.0


def test_the_margin_over_ar_scales_with_the_round() -> None:
    """In a round of 8 a request's arm moves the round's rate by about an eighth of what it moves its own, so
    `MARGIN` is divided by the requests: a speculative arm that gains a little is still taken."""
    stats = trained_stats(draft=0.0, context=0.12, ngram=0.0)  # context chains: a few extra tokens in a hundred
    lookup = {"context": 1, "ngram": 0}
    load = shared_load(7, 2, 0, 0, 0.012, 1.0)
    rates = expected_rates(ARMS, SHARED, stats, StepCosts(), lookup, load=load)
    gain = rates[Arm("lookup", 1)] / rates[Arm("ar")] - 1
    assert 0 < gain < 0.03  # under the solo margin, over the shared one
    assert choose_arm(ARMS, SHARED, stats, StepCosts(), lookup, load=load) == Arm("lookup", 1)


def test_the_scheduler_s_load_view_comes_from_finished_rounds() -> None:
    from stagedspec.server.batching import RaggedPass, RoundRecord
    from stagedspec.server.scheduler import LoadTracker

    oracle, draft = object(), object()
    tracker = LoadTracker(oracle)
    a, b, c, new = object(), object(), object(), object()
    assert tracker.view(a, [a]) == SharedLoad()  # alone: the solo price
    assert tracker.view(a, [a, b]) is None  # neighbours but no round measured yet: priced alone
    record = RoundRecord([id(a), id(b), id(c)], [
        RaggedPass(draft, {id(a): 2, id(b): 2}, 0.001), RaggedPass(draft, {id(a): 3, id(b): 3}, 0.001),
        RaggedPass(draft, {id(a): 3}, 0.001), RaggedPass(oracle, {id(a): 7, id(b): 5, id(c): 200}, 0.02)], 0.03)
    tracker.observe(record, {id(a): 3, id(b): 2, id(c): 1}, first={id(c)})
    assert tracker.lane_seconds is None  # a round with a prompt's prefill is not a step's cost
    tracker.observe(RoundRecord([id(a), id(b), id(c)], record.passes, 0.03), {id(a): 3, id(b): 2, id(c): 1},
                    first=set())
    assert tracker.lane_seconds == pytest.approx(0.01) and tracker.lane_tokens == pytest.approx(2.0)
    view = tracker.view(c, [a, b, c, new])
    assert view == SharedLoad(others=3, oracle_rows=12.0, draft_phases=3, draft_rows=13 / 3, seconds=pytest.approx(0.03),
                              tokens=pytest.approx(6.0))
    assert tracker.view(a, [a, b]).draft_phases == 2 and tracker.view(a, [a, b]).oracle_rows == 5.0


# --- cost profiles -------------------------------------------------------------------------------------------------


def test_interpolation_and_monotone_curves() -> None:
    curve = {1: 1.0, 2: 2.0, 4: 3.0}
    assert interpolate(curve, 3) == pytest.approx(2.5) and interpolate(curve, 6) == pytest.approx(4.0)
    assert interpolate(curve, 0.5) == 1.0
    assert monotone({1: 5.0, 2: 1.0, 4: 3.0}) == {1: 1.0, 2: 1.0, 4: 3.0}  # a slow outlier at 1 row is capped


def test_profiles_are_measured_once_and_cached(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random

    monkeypatch.undo()  # the real cache location, under a temporary $STAGEDSPEC_CACHE
    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    # an idle machine as far as the profile can tell: one measured beside a busy process is never cached
    # (`test_a_cost_profile_measured_beside_a_busy_process_is_not_cached`), and CI machines may be busy
    monkeypatch.setattr("stagedspec.threads.read_busy_seconds", lambda cpus, path="/proc/stat": None)
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position=320)
    torch.manual_seed(0)
    oracle = init_random(Transformer(cfg)).eval()
    draft = init_random(Transformer(cfg)).eval()
    first = load_or_measure(oracle, [draft], "cpu")
    assert "measuring pass costs" in capsys.readouterr().err
    path = profile_path(first.key)
    assert path.exists() and set(first.oracle) >= {1, 2, 4} and len(first.drafts) == 1
    again = load_or_measure(oracle, [draft], "cpu")
    assert capsys.readouterr().err == "" and again.oracle == first.oracle  # from the cache, no new line
    assert load_or_measure(oracle, [], "cpu").key != first.key  # other models, other key
    path.write_text("{not json")
    assert load_or_measure(oracle, [draft], "cpu").oracle  # a corrupt entry is measured again
    stored = json.loads(path.read_text())
    assert stored["version"] == PROFILE_VERSION and "draft_overhead" in stored and len(stored["segment_seconds"]) == 2
    assert set(stored["verify_overhead"]) == {"greedy", "sampled"}
    assert all(len(v) == 2 and min(v) >= 0 for v in stored["verify_overhead"].values())
    assert path.name == f"{first.key}.v{PROFILE_VERSION}.json"  # beside, not over, what older versions cached


def test_requests_arriving_together_share_one_measured_profile(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The server's first requests ask for the profile at once, on threads: one measures, the others read what
    it wrote, so every policy prices with the same numbers as the file a later process reads."""
    import threading
    import time

    import stagedspec.profiling as profiling
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random

    monkeypatch.undo()
    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position=320)
    oracle = init_random(Transformer(cfg), seed=1).eval()
    calls = []

    def measure(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a slow measurement, different every time
        calls.append(1)
        time.sleep(0.05)
        return CostProfile(oracle={1: 0.01 * len(calls), 4: 0.02}, drafts=[], key=profiling.profile_key(oracle, [], "cpu"))

    monkeypatch.setattr(profiling, "measure_profile", measure)
    got = []
    threads = [threading.Thread(target=lambda: got.append(load_or_measure(oracle, [], "cpu"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 4
    on_disk = CostProfile.from_json(profile_path(got[0].key).read_text())
    assert all(p.oracle == on_disk.oracle for p in got)


# --- dtype auto ----------------------------------------------------------------------------------------------------


def test_dtype_auto_follows_native_bf16(monkeypatch) -> None:  # noqa: ANN001
    from stagedspec import hardware
    from stagedspec.pipeline import resolve_dtype

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert hardware.auto_dtype("cpu")[0] == "bf16"
    assert resolve_dtype("auto", "cpu")[0] == torch.bfloat16
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(hardware, "cpu_capability", lambda: "AVX2")
    dtype, why = resolve_dtype("auto", "cpu")
    assert dtype == torch.float32 and "no native bf16" in why
    # the native int4 kernels take either activation dtype; PyTorch's fallback ones compute in bf16
    from stagedspec.kernels import native

    expected = torch.float32 if native.native_kernels(quiet=True) is not None else torch.bfloat16
    assert resolve_dtype("auto", "cpu", quant="int4")[0] == expected
    assert resolve_dtype("fp32", "cpu")[0] == torch.float32


def test_the_machine_is_named_and_fingerprinted() -> None:
    from stagedspec import hardware

    assert hardware.describe("cpu") and len(hardware.fingerprint("cpu")) == 16


# --- the pipeline ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):  # noqa: ANN001, ANN201
    from _tiny_models import save_tiny_hf

    from stagedspec.models.loading import load_model
    from stagedspec.models.draft_formats import truncated_copy
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    folder = tmp_path_factory.mktemp("auto") / "tiny"
    save_tiny_hf("llama_gqa", folder)
    model, tok = load_model(folder, dtype=torch.float32)
    flat = CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])  # every arm gets its turn
    pipe = Pipeline(model, tok, [truncated_copy(model, 1)], SpeculationConfig(method="auto"))
    pipe.learned.set_policy("auto", AutoPolicy(arms_for(True, True), flat))
    ar = Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))
    return pipe, ar


def test_auto_greedy_is_ar_and_seeded_sampling_reproduces(tiny_pipeline) -> None:  # noqa: ANN001
    from stagedspec.sampling import SamplingParams

    pipe, ar = tiny_pipeline
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    for n in (5, 17, 40):
        assert pipe.generate(prompt, max_new_tokens=n).token_ids == ar.generate(prompt, max_new_tokens=n).token_ids
    sampling = SamplingParams(temperature=1.0, top_k=20)
    first = pipe.generate(prompt, max_new_tokens=30, sampling=sampling, seed=7)
    pipe.generate(prompt, max_new_tokens=30, sampling=sampling)  # the shared policy learns more in between
    again = pipe.generate(prompt, max_new_tokens=30, sampling=sampling, seed=7)
    assert again.token_ids == first.token_ids
    assert len(pipe.auto_policy().choices) >= 2 and first.stats.dtype == "fp32"


def test_what_auto_learned_is_kept_for_the_next_process(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A new pipeline on the same machine and models starts from the saved statistics, not the priors."""
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random
    from stagedspec.learned_state import auto_state_path
    from stagedspec.models.draft_formats import truncated_copy
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position=400)
    model = init_random(Transformer(cfg), seed=3).eval()

    class Tok:  # the little a pipeline needs from a tokenizer when given token ids
        eos_token_ids: list[int] = []

        def decode(self, ids, skip_special_tokens=False):  # noqa: ANN001, ANN202
            return ""

    def pipeline() -> Pipeline:
        return Pipeline(model, Tok(), [truncated_copy(model, 1)], SpeculationConfig(method="auto"))

    first = pipeline()
    first.generate([1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=24)
    learned = first.auto_policy().greedy_stats.chains["context"].tries
    assert learned and auto_state_path(first.auto_policy().profile.key).exists()
    second = pipeline()
    assert second.auto_policy().greedy_stats.chains["context"].tries == learned
    assert second.auto_policy().state()["version"] == 1


def test_the_shared_pricing_is_scaled_to_the_passes_as_measured() -> None:
    """Rounds whose oracle passes take twice, and whose drafting and host work take three times, what the
    profile predicts scale a step's oracle and drafting parts by those factors."""
    from stagedspec.server.batching import RaggedPass, RoundRecord
    from stagedspec.server.scheduler import LoadTracker

    oracle, draft = object(), object()
    a, b = object(), object()
    profile = CostProfile(oracle={1: 0.010, 64: 0.010}, drafts=[{1: 0.001, 64: 0.001}],
                          draft_overhead={"greedy": 0.0005, "sampled": 0.0005}, segment_seconds=[0.002, 0.0])
    # predicted: oracle 10 ms + 1 segment x 2 ms = 12 ms; drafting 1 ms + 2 lane passes x 0.5 ms = 2 ms
    passes = [RaggedPass(draft, {id(a): 3, id(b): 3}, 0.001), RaggedPass(oracle, {id(a): 4, id(b): 4}, 0.024)]
    tracker = LoadTracker(oracle)
    for _ in range(40):
        tracker.observe(RoundRecord([id(a), id(b)], passes, 0.024 + 0.006), {id(a): 2, id(b): 2}, set(), profile)
    assert tracker.oracle_scale == pytest.approx(2.0, rel=1e-3) and tracker.draft_scale == pytest.approx(3.0, rel=1e-3)
    view = tracker.view(a, [a, b])
    assert (view.oracle_scale, view.draft_scale) == (tracker.oracle_scale, tracker.draft_scale)
    import dataclasses

    plain = dataclasses.replace(view, oracle_scale=1.0, draft_scale=1.0)
    # (the oracle curve is flat: every arm's oracle part is its segment, as `ar`'s)
    for arm in (Arm("ar"), Arm("staged", 3), Arm("tree", 8)):
        scaled = shared_step_seconds(arm, profile, view, {})
        oracle_part = shared_step_seconds(Arm("ar"), profile, plain, {})
        draft_part = shared_step_seconds(arm, profile, plain, {}) - oracle_part
        assert scaled == pytest.approx(2.0 * oracle_part + 3.0 * draft_part, rel=1e-3), arm


def test_deep_in_a_plain_run_only_probe_steps_price_the_arms(monkeypatch) -> None:  # noqa: ANN001
    """After `PLAIN_STREAK` steps of `ar`, steps between lookup probes run `ar` without pricing every arm (on a
    GPU that pricing was a few percent of a step); probe steps still price them."""
    from stagedspec.auto import LOOKUP_PROBE_EVERY, PLAIN_STREAK, AutoDrafter
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.generation import NoDrafter

    policy = AutoPolicy([Arm("ar")], STEEP)
    priced = []
    real_choose = policy.choose
    monkeypatch.setattr(policy, "choose", lambda *a, **k: priced.append(1) or real_choose(*a, **k))

    class Lookup(LookupDrafter):  # chains that never exist
        def chains(self, context, k):  # noqa: ANN001, ANN201
            return []

    drafter = AutoDrafter(policy, {Arm("ar"): (NoDrafter(), [])}, lookup=Lookup(None, context=True))
    context = [1, 2, 3]
    drafter.begin(context)
    steps = PLAIN_STREAK + 4 * LOOKUP_PROBE_EVERY
    for _ in range(steps):
        tree = drafter.propose(context, SamplingParams(), None, 8)
        assert len(tree) == 1
        context = context + [4]
    assert policy.choices["ar"] == steps
    assert PLAIN_STREAK < len(priced) < PLAIN_STREAK + 4 * LOOKUP_PROBE_EVERY


def test_a_best_first_tree_is_priced_by_its_nodes_chances() -> None:
    """A tree arm's expectation is the sum of its nodes' chances of lying on the accepted path, for the tree
    grown best-first as the drafter grows it (not its nodes spread evenly over the levels)."""
    from stagedspec.auto import SECOND_CHOICE

    chains = ChainStats(prior=0.6, weight=1e9)  # every depth's rate stays 0.6
    a, second = 0.6, SECOND_CHOICE * 0.6
    assert chains.best_first(1, 1) == pytest.approx(a)
    assert chains.best_first(2, 1) == pytest.approx(a + (1 - a) * second)  # a sibling hedges the first
    assert chains.best_first(2, 2) == pytest.approx(a + a * a)  # a child of the first beats its sibling
    values = [chains.best_first(n, 8) for n in (1, 2, 4, 8, 16, 32)]
    assert values == sorted(values)  # more nodes help ...
    assert (values[-1] - values[-2]) / 16 < (values[1] - values[0]) / 1  # ... less per node
    sure = ChainStats(prior=1.0, weight=1e9)
    assert sure.best_first(5, 5) == pytest.approx(5.0)  # a draft that is always right: the chain, all accepted
    assert expected_tokens(Arm("tree", 8), AcceptanceStats(), {}) > expected_tokens(Arm("tree", 2), AcceptanceStats(), {})


def test_a_staged_arm_prices_the_union_of_its_draft_and_lookup_chains() -> None:
    """The oracle takes the longer match of the draft's chain and the merged lookup chain: both count, and a
    longer draft chain still adds beside a long lookup chain."""
    stats = trained_stats(draft=0.6, context=0.6)
    long_context = {"context": 8, "ngram": 0}
    draft_only = expected_tokens(Arm("staged", 3), stats, NO_LOOKUP_NOW)
    both = expected_tokens(Arm("staged", 3), stats, long_context)
    assert both > draft_only
    assert expected_tokens(Arm("staged", 3, 8), stats, long_context) > both  # 8 lookup tokens, not 4
    assert (expected_tokens(Arm("staged", 3, 8), stats, long_context)
            > expected_tokens(Arm("staged", 1, 8), stats, long_context) + 0.1)


def test_long_lookup_staged_arms_are_offered_and_named() -> None:
    from stagedspec.auto import STAGE_LONG_LOOKUP, lookup_horizon, staged_lookup_length

    long_arms = [a for a in ARMS if a.kind == "staged" and a.lookup]
    assert long_arms and all(staged_lookup_length(a) == STAGE_LONG_LOOKUP for a in long_arms)
    assert Arm("staged", 3, 8).name == "staged:3+8" and Arm("staged", 3).name == "staged:3"
    assert Arm("staged", 3, 8).max_tree_budget == 11 and Arm("staged", 3).max_tree_budget == 7
    assert lookup_horizon(ARMS) == STAGE_LONG_LOOKUP  # the chains scored every step reach the longest arm's
    assert verify_rows(Arm("staged", 3, 8), {"context": 5}) == 1 + 3 + 5  # a shorter chain now: its rows only


def test_an_arm_tried_once_is_judged_by_its_family_too() -> None:
    """One unlucky step no longer writes an arm off: its calibration is shrunk towards its family's, and an
    arm never run is priced by what its siblings yielded."""
    stats = AcceptanceStats()
    for _ in range(50):  # staged arms yield twice the extra tokens the chain model says
        stats.observe_arm(Arm("staged", 3), 2.0, 3)
    family = stats.family_calibration("staged")
    assert family > 1.5
    assert stats.calibration(Arm("staged", 6)) == pytest.approx(family)  # never run: its family's
    stats.observe_arm(Arm("staged", 6), 3.0, 1)  # one step, nothing accepted
    assert 1.0 < stats.calibration(Arm("staged", 6)) < family  # moved, not written off
    assert stats.calibration(Arm("staged", 6, 8)) == pytest.approx(1.0)  # the long-lookup family is apart
    assert stats.calibration(Arm("tree", 8)) == pytest.approx(1.0)


def test_an_exploring_step_tries_an_arm_that_ran_little() -> None:
    """Ranked by upper confidence bounds, an arm a little below the best but hardly tried is explored; the
    ordinary choice stays the best estimate."""
    stats = trained_stats(draft=0.7)
    best = choose_arm(ARMS, FLAT, stats, StepCosts(), NO_LOOKUP_NOW)
    for _ in range(300):  # the best arm ran a lot and yielded what the model said
        stats.observe_arm(best, 3.0, 3)
    assert choose_arm(ARMS, FLAT, stats, StepCosts(), NO_LOOKUP_NOW) == best
    explored = choose_arm(ARMS, FLAT, stats, StepCosts(), NO_LOOKUP_NOW, explore=True)
    assert explored != best
    assert stats.arm_steps.get(explored, 0) < stats.arm_steps.get(best, 0)
    # An arm far worse than `ar` is not explored: the bonus cannot lift it past plain decoding.
    assert choose_arm(ARMS, STEEP, trained_stats(draft=0.05), StepCosts(), NO_LOOKUP_NOW, explore=True) == Arm("ar")


def test_catching_up_is_not_learned_as_an_arm_s_drafting_time() -> None:
    costs = StepCosts()
    arm = Arm("staged", 3)
    costs.observe(arm, None, 0.03, 0.03, 0.005)  # a cold step: only the verification is learned
    assert arm not in costs.draft_seconds and "staged" not in costs.draft_scale
    assert costs.verify_scales["staged/greedy"] == pytest.approx(1.0)
    costs.observe(arm, 0.006, 0.03, 0.03, 0.005)
    assert costs.draft_seconds[arm] == pytest.approx(0.006)


def test_an_exploration_runs_its_arm_twice_and_learns_its_time_from_the_warm_step(monkeypatch) -> None:  # noqa: ANN001
    """The exploring step's draft catches up on what other drafters decoded; the repeat, on a warm cache, is
    what teaches the arm's drafting time."""
    import stagedspec.auto.drafter as drafter_module
    from stagedspec.auto import AutoDrafter
    from stagedspec.generation import NoDrafter

    monkeypatch.setattr(drafter_module, "EXPLORE_EVERY", 3)
    a, b = Arm("tree", 2), Arm("tree", 4)
    policy = AutoPolicy([a, b], FLAT)
    da, db = OneNodeDrafter(), OneNodeDrafter()
    drafter = AutoDrafter(policy, {a: (da, []), b: (db, [])})
    observed = []
    real_observe = policy.costs.observe
    monkeypatch.setattr(policy.costs, "observe",
                        lambda arm, draft, *rest, **k: observed.append((arm, draft)) or real_observe(arm, draft, *rest, **k))
    context = [1, 2, 3]
    drafter.begin(context)
    runs, starts = [], []
    for i in range(10):
        drafter.propose(context, SamplingParams(), None, 8)
        if drafter._exploring is not None:  # an exploration began: its arm runs again next step
            starts.append(i)
        drafter.verified(0.01)
        runs.append(drafter._last.arm)
        context = context + [4]
    assert starts, runs
    first = starts[0]
    assert runs[first + 1] == runs[first], runs  # the exploration ran twice
    learned = dict((i + 1, d) for i, (_, d) in enumerate(observed))  # observation i is of step i + 1
    assert learned[first] is None and learned[first + 1] is not None  # cold step skipped, warm step learned


def test_whole_steps_that_cost_more_than_their_parts_say_turn_the_choice_to_ar() -> None:
    """A speculative step whose wall time exceeds its calibrated price (a draft catching up after a run of
    `ar` steps, an exploration's loss) raises the speculative arms' whole-step scale, and `ar` is chosen;
    `ar`'s own scale is learned apart, and the scales are saved with the state."""
    from stagedspec.auto import AutoPolicy, solo_step_seconds

    stats = trained_stats(draft=0.6)
    costs = StepCosts()
    best = choose_arm(ARMS, FLAT, stats, costs, NO_LOOKUP_NOW)
    assert best.kind != "ar"
    price = solo_step_seconds(best, FLAT, costs, NO_LOOKUP_NOW, whole=False)
    for _ in range(40):
        costs.observe_step(best, 3.5 * price, price, sampled=False)
        costs.observe_step(Arm("ar"), 0.01, 0.01, sampled=False)
    assert costs.step_scale_for(best.kind, False) > 3.0 and costs.step_scale_for("ar", False) == pytest.approx(1.0)
    assert costs.step_scale_for(best.kind, True) == 1.0  # sampled steps are learned apart
    assert choose_arm([a for a in ARMS if a.kind in ("ar", best.kind)], FLAT, stats, costs, NO_LOOKUP_NOW) == Arm("ar")
    policy = AutoPolicy(ARMS, FLAT)
    policy.costs = costs
    again = AutoPolicy(ARMS, FLAT)
    again.restore(json.loads(json.dumps(policy.state())))
    assert again.costs.step_scales == costs.step_scales


def test_a_draft_far_behind_is_not_explored_but_an_ordinary_step_shares_its_catch_up() -> None:
    """An exploring step pays its draft's whole catch-up (two steps' worth), so after a long run of `ar` a
    close arm is not explored; an ordinary step charges only its share of the remaining tokens, so the
    prompt's catch-up does not keep a paying draft from ever starting."""
    from stagedspec.auto import AutoPolicy, catch_up_seconds

    steep_draft = CostProfile(oracle={r: 0.010 for r in ROWS}, drafts=[{1: 0.0005, 2: 0.0005, 64: 0.2}])
    assert catch_up_seconds(Arm("tree", 4), steep_draft, 64) == pytest.approx(0.1995)
    assert catch_up_seconds(Arm("lookup", 4), steep_draft, 64) == 0.0 == catch_up_seconds(Arm("tree", 4), steep_draft, 2)
    policy = AutoPolicy(ARMS, steep_draft)
    policy.greedy_stats = trained_stats(draft=0.7)
    far = {"tree": 64, "staged": 64}
    assert policy.choose(SamplingParams(), NO_LOOKUP_NOW, explore=True, backlog=far, remaining=100) == Arm("ar")
    assert policy.choose(SamplingParams(), NO_LOOKUP_NOW, backlog=far, remaining=1000).kind in ("tree", "staged")


def test_explorations_that_do_not_convince_come_ever_more_rarely_and_a_win_restores_their_pace() -> None:
    """While `ar` wins the priced step after each exploration, the gap between explorations doubles up to
    `EXPLORE_MAX_GAP`; a priced step that chooses a speculative arm brings it back to `EXPLORE_EVERY`."""
    from stagedspec.auto import EXPLORE_EVERY, EXPLORE_MAX_GAP, AutoDrafter

    tree, plain = Arm("tree", 2), Arm("ar")
    policy = AutoPolicy([plain, tree], FLAT)
    d = OneNodeDrafter()
    priced: list[bool] = []
    speculate_at: set[int] = set()

    def choose(sampling, lengths, max_tree_budget=None, load=None, probe_plain=False, explore=False, **_):  # noqa: ANN001, ANN202
        priced.append(explore)
        return tree if explore or len(priced) in speculate_at else plain

    policy.choose = choose

    def explorations(steps: int) -> list[int]:
        """Run a fresh `AutoDrafter` for `steps` steps: the priced steps (counted from 0) that explored."""
        priced.clear()
        drafter = AutoDrafter(policy, {plain: (d, []), tree: (d, [])})
        context = [1, 2, 3]
        drafter.begin(context)
        for _ in range(steps):
            drafter.propose(context, SamplingParams(), None, 8)
            drafter.verified(0.01)
            context = context + [4]
        return [i for i, e in enumerate(priced) if e]

    explored = explorations(5000)  # quiet steps between probes: fewer priced steps per step
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert explored[0] == EXPLORE_EVERY - 1
    assert gaps[:3] == [2 * EXPLORE_EVERY + 1, 4 * EXPLORE_EVERY + 1, 8 * EXPLORE_EVERY + 1]
    assert max(gaps) == EXPLORE_MAX_GAP + 1 and gaps[-1] == EXPLORE_MAX_GAP + 1

    # a priced step that speculates on its own merits (the one after the third exploration) restores the pace
    speculate_at.add(explored[2] + 2)  # `len(priced)` counts from 1
    again = explorations(2500)
    assert again[:3] == explored[:3] and again[3] - again[2] == EXPLORE_EVERY + 1


def test_a_request_prices_the_arms_by_its_own_record_not_only_the_machine_s(monkeypatch) -> None:  # noqa: ANN001
    """The machine's statistics say the prompt is always copied (learned on code that restates its prompt);
    a request whose prompt is never copied (prose) must turn back to `ar` within some tens of steps.  The
    control: priced by the machine's 200 observations alone (the former behaviour), the same request is
    still on losing lookups after 60 steps.  The next request starts from the machine's statistics again."""
    import stagedspec.auto.drafter as drafter_module
    from stagedspec.auto import REQUEST_PRIOR, AutoDrafter
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.generation import NoDrafter

    class Lookup(LookupDrafter):  # a 6-token context chain every step, never what the oracle emits
        def chains(self, context, k):  # noqa: ANN001, ANN201
            return [("context", [9] * 6)]

    class Copier(Drafter):
        def begin(self, prompt):  # noqa: ANN001, ANN201
            pass

        def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
            return TokenTree.chain(context[-1], [9] * 6)

    def seconds(rows: int) -> float:
        return 0.010 + 0.001 * rows

    profile = CostProfile(oracle={r: seconds(r) for r in ROWS}, drafts=[])
    lookup_arm = Arm("lookup", 6)

    def request(policy: AutoPolicy, steps: int) -> list[str]:
        drafter = AutoDrafter(policy, {Arm("ar"): (NoDrafter(), []), lookup_arm: (Copier(), [])},
                              lookup=Lookup(None, context=True))
        context = [1, 2, 3]
        drafter.begin(context)
        arms = []
        for _ in range(steps):
            drafter.propose(context, SamplingParams(), None, 64)
            arms.append(drafter._last.arm.name if drafter._last is not None else "ar")  # quiet steps run ar
            context = context + [4]  # the oracle's token: the chain's first token is rejected
        return arms

    def copying_machine() -> AutoPolicy:
        # priced by the profile alone: this test's steps take no wall time, which would teach false prices
        policy = AutoPolicy([Arm("ar"), lookup_arm], profile, learn_times=False)
        policy.greedy_stats = trained_stats(draft=0.5, context=0.99)
        for _ in range(200):  # and lookup:6 yielding what its chains promised
            policy.greedy_stats.observe_arm(lookup_arm, 6.0, 6)
        return policy

    policy = copying_machine()
    machine_rate = policy.greedy_stats.chains["context"].rate(0)
    first = request(policy, 60)
    assert first[0] == "lookup:6"
    assert first.index("ar") < 40 and first[-10:].count("ar") >= 8, first
    assert policy.greedy_stats.chains["context"].rate(0) > 0.7 * machine_rate  # the machine's view moved less
    assert request(policy, 1) == ["lookup:6"]  # a new request starts from the machine's statistics
    own = policy.greedy_stats.scaled(REQUEST_PRIOR)
    assert own.chains["context"].tries[0] == pytest.approx(REQUEST_PRIOR)
    machine = policy.greedy_stats.chains["context"]
    assert own.chains["context"].hits[0] / REQUEST_PRIOR == pytest.approx(machine.hits[0] / machine.tries[0])

    monkeypatch.setattr(drafter_module, "REQUEST_PRIOR", 1e9)  # the control: the machine's statistics alone
    control = request(copying_machine(), 60)
    assert control[-10:].count("lookup:6") >= 5, control


def test_an_arm_kind_that_realizes_less_than_its_price_is_dropped_and_a_slow_host_changes_nothing() -> None:
    """A request's realized / priced rate per arm kind scales the prices (`stagedspec.realized_rates`): a
    tree whose steps yield 0.7x what it was priced at loses to `ar` after a few steps, though the shared
    models still price it above `ar` (the control: priced without the request's record, the tree runs).
    `ar` itself realizing 0.7x its price (the host slower for a while) moves an untried kind alike, so the
    choice stays; a kind that realizes its price keeps it."""
    from stagedspec.realized_rates import PRIOR_STEPS, RealizedRates

    arms = [Arm("ar"), Arm("tree", 4)]
    stats = trained_stats(draft=0.4)
    close = CostProfile(oracle={r: 0.010 for r in ROWS}, drafts=[{r: 0.001 for r in (1, 2, 4, 8)}])
    rates = expected_rates(arms, close, stats, StepCosts(), NO_LOOKUP_NOW)
    assert 1.1 < rates[Arm("tree", 4)] / rates[Arm("ar")] < 1.5, rates  # a tree priced somewhat above `ar`
    assert choose_arm(arms, close, stats, StepCosts(), NO_LOOKUP_NOW) == Arm("tree", 4)  # the control

    losing = RealizedRates()
    picks = []
    for _ in range(12):
        losing.observe("tree", tokens=2, seconds=0.020, priced_tokens=2.0, priced_seconds=0.014)
        picks.append(choose_arm(arms, close, stats, StepCosts(), NO_LOOKUP_NOW, realized=losing))
    assert picks[0] == Arm("tree", 4) and picks[-1] == Arm("ar"), picks
    assert picks.index(Arm("ar")) < 8, picks
    assert losing.factor("tree") == pytest.approx((2 * 12 + 2 * PRIOR_STEPS) / (2 * 12 + 2 * PRIOR_STEPS)
                                                  / ((0.020 * 12 + 0.014 * PRIOR_STEPS) / (0.014 * (12 + PRIOR_STEPS))))

    slow_host = RealizedRates()
    for _ in range(12):
        slow_host.observe("ar", tokens=1, seconds=0.0143, priced_tokens=1.0, priced_seconds=0.010)
    assert slow_host.factor("ar") < 0.8 and slow_host.factor("tree") == slow_host.factor("ar")
    assert choose_arm(arms, close, stats, StepCosts(), NO_LOOKUP_NOW, realized=slow_host) == Arm("tree", 4)

    as_priced = RealizedRates()
    for _ in range(12):
        as_priced.observe("tree", tokens=2, seconds=0.014, priced_tokens=2.0, priced_seconds=0.014)
    assert as_priced.factor("tree") == pytest.approx(1.0)
    assert choose_arm(arms, close, stats, StepCosts(), NO_LOOKUP_NOW, realized=as_priced) == Arm("tree", 4)


def test_a_request_records_each_step_s_wall_time_against_its_price(monkeypatch) -> None:  # noqa: ANN001
    """`AutoDrafter` records every step priced alone: its tokens and wall time (from one `propose` to the
    next) against the tokens and seconds it was chosen for; a seeded sampled request's policy, which prices by
    the profile alone, keeps no record, and a new request starts afresh."""
    import stagedspec.auto.drafter as drafter_module
    from stagedspec.auto import AutoDrafter

    clock = [100.0]
    monkeypatch.setattr(drafter_module.time, "perf_counter", lambda: clock[0])
    tree = Arm("tree", 2)
    for learn_times in (True, False):
        policy = AutoPolicy([tree], FLAT, learn_times=learn_times)
        drafter = AutoDrafter(policy, {tree: (OneNodeDrafter(), [])})
        context = [1, 2, 3]
        drafter.begin(context)
        priced = []
        for _ in range(6):
            drafter.propose(context, SamplingParams(), None, 8)
            priced.append((drafter._last.priced_tokens, drafter._last.priced_seconds))
            drafter.verified(0.010)
            clock[0] += 0.012  # each whole step takes 12 ms
            context = context + [4, 5]  # two tokens a step
        drafter.propose(context, SamplingParams(), None, 8)
        record = drafter._realized.kinds.get("tree")
        if not learn_times:
            assert record is None and drafter._realized_now() is None
            continue
        assert record.steps == 5  # the first step (the prompt's prefill) is not a step's cost
        assert record.tokens == 10 and record.seconds == pytest.approx(0.060)
        assert record.priced_tokens == pytest.approx(sum(t for t, _ in priced[1:]))
        assert record.priced_seconds == pytest.approx(sum(s for _, s in priced[1:]))
        drafter.begin([1, 2, 3])
        assert drafter._realized.kinds == {}


def test_a_policy_that_prices_by_the_profile_alone_does_not_explore() -> None:
    """A seeded sampled request's policy (`learn_times=False`) starts from the priors every request and
    cannot carry an exploration's lesson to the next, so none of its priced steps explores; the control, a
    policy that learns times, explores within `EXPLORE_EVERY` priced steps."""
    from stagedspec.auto import EXPLORE_EVERY, AutoDrafter

    tree, plain = Arm("tree", 2), Arm("ar")
    for learn_times in (False, True):
        policy = AutoPolicy([plain, tree], FLAT, learn_times=learn_times)
        flags: list[bool] = []
        policy.choose = lambda sampling, lengths, max_tree_budget=None, load=None, explore=False, **_: (  # noqa: ANN001
            flags.append(explore) or plain)
        drafter = AutoDrafter(policy, {plain: (OneNodeDrafter(), []), tree: (OneNodeDrafter(), [])})
        context = [1, 2, 3]
        drafter.begin(context)
        for _ in range(16 * EXPLORE_EVERY):  # quiet steps between probes: about 12 priced steps
            drafter.propose(context, SamplingParams(temperature=1.0), None, 64)
            context = context + [4]
        assert any(flags) == learn_times, (learn_times, flags)


def test_greedy_lookup_and_copy_steps_share_ars_measured_scales() -> None:
    """A greedy lookup or copy step is an `ar` step with more rows: priced by `ar`'s measured time along the cost
    curve, so noise in one kind's record does not make the other look cheaper.  Sampled steps keep their own."""
    costs = StepCosts()
    for _ in range(20):
        costs.observe(Arm("ar"), 0.0, 0.013, 0.010, 0.0)
        costs.observe_step(Arm("ar"), 0.013, 0.010, False)
    for kind in ("copy", "lookup"):
        assert costs.verify_scale_for(kind, False) == costs.verify_scale_for("ar", False)
        assert costs.step_scale_for(kind, False) == costs.step_scale_for("ar", False)
        assert costs.step_scale_for(kind, True) == 1.0  # sampled: not seen


def test_each_row_count_learns_its_own_verification_scale() -> None:
    """The cost curve's shape need not hold in every process: one-row steps that run at 0.75x the curve and
    three-row steps at 1.05x are each priced as measured, where one scale for the kind priced the copy step's three
    rows as cheap as `ar`'s one.  A row count not seen yet is priced by its kind's scale, and a new one starts
    from it (`ROW_PRIOR_STEPS`), so one noisy step does not set its price."""
    from stagedspec.auto.step_costs import ROW_PRIOR_STEPS

    costs = StepCosts()
    for _ in range(30):
        costs.observe(Arm("ar"), 0.0, 0.0075, 0.010, 0.0, rows=1)
        costs.observe(Arm("copy", 2), 0.0, 0.0105, 0.010, 0.0, rows=3)
    assert costs.verify_scale_for("ar", False, 1) == pytest.approx(0.75, rel=0.01)
    assert costs.verify_scale_for("copy", False, 3) == pytest.approx(1.05, rel=0.02)
    kind = costs.verify_scale_for("ar", False)  # both fed the greedy `ar` kind's scale
    assert 0.75 < kind < 1.05
    assert costs.verify_scale_for("lookup", False, 5) == kind  # five rows: not seen
    # `solo_step_seconds` prices with the row count's scale
    from stagedspec.auto import solo_step_seconds

    assert solo_step_seconds(Arm("ar"), FLAT, costs, NO_LOOKUP_NOW, whole=False) == pytest.approx(
        0.75 * FLAT.step_seconds(1, False), rel=0.01)
    fresh = StepCosts()
    fresh.observe(Arm("tree", 3), 0.001, 0.010, 0.010, 0.001, rows=4)  # the kind's first step sets both
    assert fresh.verify_scale_for("tree", False, 4) == pytest.approx(1.0)
    fresh.observe(Arm("tree", 1), 0.001, 0.020, 0.010, 0.001, rows=2)  # a new row count: 2.0, shrunk to the kind's
    expected = (ROW_PRIOR_STEPS * 1.0 + 2.0) / (ROW_PRIOR_STEPS + 1)
    assert fresh.verify_scale_for("tree", False, 2) == pytest.approx(expected)
    assert fresh.verify_scale_for("tree", False, 4) == pytest.approx(1.0)


def test_a_scale_that_has_not_learned_for_a_while_follows_the_next_step_faster() -> None:
    """The machine's speed drifts: a scale last learned many steps ago (`ar` between its probes) moves at least
    halfway to the next step's time, one learned on the step before moves as a moving average does, and even a
    stale scale keeps `STALE_KEEP` of its weight, so one noisy step does not set the price alone."""
    from stagedspec.auto.step_costs import STALE_HALF_LIFE, STALE_KEEP

    costs = StepCosts()
    for _ in range(20):
        costs.observe(Arm("ar"), 0.0, 0.010, 0.010, 0.0, rows=1)
    assert costs.verify_scale_for("ar", False, 1) == pytest.approx(1.0)
    costs.observe(Arm("ar"), 0.0, 0.007, 0.010, 0.0, rows=1)  # the next step: the moving average's tenth
    assert costs.verify_scale_for("ar", False, 1) == pytest.approx(0.97)
    costs.advance(4 * STALE_HALF_LIFE)  # other arms' steps, or quiet `ar` ones
    costs.observe(Arm("ar"), 0.0, 0.007, 0.010, 0.0, rows=1)
    moved = costs.verify_scale_for("ar", False, 1)
    assert moved == pytest.approx(0.97 * STALE_KEEP * 0.9 + 0.7 * (1 - STALE_KEEP * 0.9))
    assert 0.7 < moved < (0.97 + 0.7) / 2
    costs.advance(STALE_HALF_LIFE // 2)  # half stale: between the two
    before = costs.verify_scale_for("ar", False, 1)
    costs.observe(Arm("ar"), 0.0, 0.007, 0.010, 0.0, rows=1)
    keep = 0.9 * 0.5 ** ((STALE_HALF_LIFE // 2) / STALE_HALF_LIFE)
    assert costs.verify_scale_for("ar", False, 1) == pytest.approx(keep * before + (1 - keep) * 0.7)


def test_a_lookup_arm_with_no_chain_now_is_never_chosen_over_ar() -> None:
    """With no chain to verify, a copy or lookup step is `ar` under another name; however its kind's record
    prices it, `ar` is the choice (every such step was a full one, bookkeeping and all)."""
    stats = trained_stats(draft=0.0, context=0.35, ngram=0.0)
    costs = StepCosts(verify_scales={"copy/sampled": 0.5, "lookup/sampled": 0.5})  # as if those were cheap
    arms = [Arm("ar"), Arm("copy", 1), Arm("lookup", 2)]
    assert choose_arm(arms, FLAT, stats, costs, NO_LOOKUP_NOW, sampled=True) == Arm("ar")
    assert choose_arm(arms, FLAT, stats, costs, {"context": 2, "ngram": 0}, sampled=True) != Arm("ar")


def test_a_policy_that_does_not_learn_times_charges_a_cold_draft_its_whole_catch_up() -> None:
    """A seeded sampled request's policy cannot see its first draft steps lose, so a draft far behind pays its
    whole catch-up there, where a learning policy charges only its share of the remaining tokens."""
    from stagedspec.auto import AutoPolicy

    steep_draft = CostProfile(oracle={r: 0.010 for r in ROWS}, drafts=[{1: 0.0005, 2: 0.0005, 64: 0.2}])
    far = {"tree": 64, "staged": 64}
    for learn_times, kinds in ((True, ("tree", "staged")), (False, ("ar",))):
        policy = AutoPolicy(ARMS, steep_draft, learn_times=learn_times)
        policy.greedy_stats = trained_stats(draft=0.7)
        assert policy.choose(SamplingParams(), NO_LOOKUP_NOW, backlog=far, remaining=1000).kind in kinds
        assert policy.choose(SamplingParams(), NO_LOOKUP_NOW, backlog={}, remaining=1000).kind in ("tree", "staged")


def test_a_copy_is_priced_by_how_long_a_suffix_it_matched() -> None:
    """A prompt-lookup chain copied after a one-token match is learned and priced apart from one copied after
    three tokens: code's long matches had taught one shared series to price chat's chance one-token copies at
    2-3 tokens a step (`arms.CONTEXT_SERIES`)."""
    from stagedspec.auto.arms import context_chain, context_series

    assert [context_series(n) for n in (1, 2, 3, 5)] == ["context:1", "context:2", "context", "context"]
    assert context_chain({"context:1": 4, "ngram": 6}) == ("context:1", 4)
    assert context_chain({"ngram": 6}) == ("context", 0)
    stats = AcceptanceStats()
    for _ in range(200):
        stats.chains["context"].record(8, 8)  # long matches: always copied through
        stats.chains["context:1"].record(0, 8)  # chance matches: never right
    strong, weak = {"context": 8}, {"context:1": 8}
    assert verify_rows(Arm("copy", 8), strong) == verify_rows(Arm("copy", 8), weak) == 9
    assert expected_tokens(Arm("copy", 8), stats, strong) > 8.0
    assert expected_tokens(Arm("copy", 8), stats, weak) < 1.05
    flat = CostProfile(oracle={r: 0.010 for r in ROWS}, drafts=[])
    arms = [Arm("ar"), Arm("copy", 8)]
    assert choose_arm(arms, flat, stats, StepCosts(), strong) == Arm("copy", 8)
    assert choose_arm(arms, flat, stats, StepCosts(), weak) == Arm("ar")


def test_the_drafter_learns_each_copy_in_its_matched_suffix_series() -> None:
    """`AutoDrafter` scores each step's prompt-lookup chain into the series of the suffix it matched."""
    from stagedspec.auto import AutoDrafter
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.generation import NoDrafter

    lookup = LookupDrafter(None, context=True, chain_length=4)
    policy = AutoPolicy([Arm("ar"), Arm("copy", 4)], FLAT)
    drafter = AutoDrafter(policy, {Arm("ar"): (NoDrafter(), []), Arm("copy", 4): (lookup, [])}, lookup=lookup)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 3]  # "3" matched one token back: a one-token match
    drafter.begin(prompt)
    drafter.propose(prompt, SamplingParams(), None, 16)
    drafter.propose(prompt + [4, 9], SamplingParams(), None, 16)  # the copy [4, 5, ...] was right once
    learned = policy.greedy_stats.chains
    assert learned["context:1"].tries[:2] == [1, 1] and learned["context:1"].hits[:2] == [1, 0]
    assert not learned["context"].tries


def test_a_catch_up_past_the_draft_curve_is_priced_as_passes_of_its_largest_size() -> None:
    """Static passes run a long catch-up as passes of their largest bucket; a flat (GPU) curve extended past its
    last two points had priced 300 tokens as one pass."""
    from stagedspec.auto import catch_up_seconds

    flat_gpu = CostProfile(oracle={r: 0.0035 for r in ROWS}, drafts=[{1: 0.0024, 2: 0.0025, 32: 0.0026, 48: 0.0027}])
    seconds = catch_up_seconds(Arm("staged", 2), flat_gpu, 300)  # 6 passes of 48 rows, then 12 rows
    assert seconds == pytest.approx(6 * 0.0027 + flat_gpu.draft_seconds(0, 12) - 0.0025)
    assert catch_up_seconds(Arm("staged", 2), flat_gpu, 40) == pytest.approx(flat_gpu.draft_seconds(0, 40) - 0.0025)
    assert catch_up_seconds(Arm("copy", 2), flat_gpu, 300) == 0.0


def test_every_draft_family_is_explored_early_in_a_request_even_when_its_price_says_it_loses() -> None:
    """A price is a model; one that is wrong about a draft never lets it run to show otherwise (the Qwen pair ran
    `ar` on every step of a prose prompt where a fixed draft chain ran at 1.22x `ar`).  So each draft family runs
    twice early in a request whatever its price, a family at a time; then `ar` again while the prices say so.
    A seeded sampled request's policy (no learned times) never explores, and an exploration whose cost (its
    draft's catch-up, and its two steps' priced time beyond two `ar` steps) would take the request's
    explorations past their share of its plain time is skipped."""
    from stagedspec.auto import AutoDrafter
    from stagedspec.auto.drafter import FAMILY_EXPLORE_AFTER

    plain, tree, staged = Arm("ar"), Arm("tree", 2), Arm("staged", 1)

    def kinds_run(policy: AutoPolicy, prompt_len: int = 3, max_tokens: int = 64, steps: int = 14) -> list[str]:
        drafter = AutoDrafter(policy, {plain: (OneNodeDrafter(), []), tree: (OneNodeDrafter(), []),
                                       staged: (OneNodeDrafter(), [])})
        return arm_names_run(drafter, list(range(1, prompt_len + 1)), steps, max_tokens)

    # priced, the draft arms always lose; 256 tokens' budget (5% of 2.56 s) holds both families' steps
    runs = kinds_run(AutoPolicy([plain, tree, staged], STEEP), max_tokens=256)
    assert runs.count("tree:2") == 2 and runs.count("staged:1") == 2, runs
    first = runs.index("tree:2")
    assert runs[first + 1] == "tree:2" and first >= FAMILY_EXPLORE_AFTER  # twice in a row, after the first steps
    assert runs.index("staged:1") > first + 1  # one family at a time
    assert set(runs[runs.index("staged:1") + 2:]) == {"ar"}  # then the prices decide again
    assert set(kinds_run(AutoPolicy([plain, tree, staged], STEEP, learn_times=False), max_tokens=256)) == {"ar"}
    # 64 tokens' budget (32 ms): two 3-row tree steps cost 40 ms beyond `ar` and are skipped, two 2-row steps
    # of the staged family 21 ms and run
    runs = kinds_run(AutoPolicy([plain, tree, staged], STEEP))
    assert "tree:2" not in runs and runs.count("staged:1") == 2, runs
    # a draft whose catch-up over a long prompt is dear: 0.2 s against 5% of 64 steps of 10 ms
    dear = CostProfile(oracle={r: 0.010 * r for r in ROWS}, drafts=[{1: 0.0005, 2: 0.0005, 64: 0.2}])
    assert set(kinds_run(AutoPolicy([plain, tree, staged], dear), prompt_len=64)) == {"ar"}
    # explorations that fit the budget one at a time but not together (the tree's about 0.025 s of catch-up and
    # 0.042 s of steps, the staged family's 0.025 s and 0.021 s, against 0.080 s for a 160-token request): the
    # first family is explored, the second is not
    each = CostProfile(oracle={r: 0.010 * r for r in ROWS}, drafts=[{1: 0.0005, 2: 0.0005, 64: 0.025}])
    runs = kinds_run(AutoPolicy([plain, tree, staged], each), prompt_len=64, max_tokens=160)
    assert runs.count("tree:2") == 2 and "staged:1" not in runs, runs


def test_a_family_whose_explorations_lose_is_explored_in_fewer_requests() -> None:
    """Explored in every request whatever they taught, the draft families cost SmolLM2's `auto` 8% of `ar`'s
    speed on prose.  A family whose exploration lost to `ar` waits a request, then three, ... up to
    `FAMILY_MAX_GAP - 1`; one that won is explored in every request again.  The gaps are learned state."""
    from stagedspec.auto import AutoDrafter
    from stagedspec.auto.policy import FAMILY_MAX_GAP

    plain, tree, staged = Arm("ar"), Arm("tree", 2), Arm("staged", 1)
    policy = AutoPolicy([plain, tree, staged], STEEP)
    explored = []
    for request in range(16):
        if policy.family_turn("tree"):
            explored.append(request)
            policy.family_result("tree", paid=False)
    assert explored == [0, 2, 6, 14] and FAMILY_MAX_GAP == 8
    assert policy.family_turn("staged")  # families are apart
    restored = AutoPolicy([plain, tree, staged], STEEP)
    restored.restore(json.loads(json.dumps(policy.state())))
    assert restored.family_gaps == {"tree": 8} and restored.family_wait == policy.family_wait
    policy.family_result("tree", paid=True)
    assert policy.family_turn("tree") and policy.family_turn("tree")

    # a request whose turn it is not explores the other families only
    policy = AutoPolicy([plain, tree, staged], STEEP)
    policy.family_result("tree", paid=False)  # wait one request
    drafter = AutoDrafter(policy, {plain: (OneNodeDrafter(), []), tree: (OneNodeDrafter(), []),
                                   staged: (OneNodeDrafter(), [])})
    runs = arm_names_run(drafter, [1, 2, 3], steps=14, max_tokens=64)
    assert "tree:2" not in runs and runs.count("staged:1") == 2, runs
