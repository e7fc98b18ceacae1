"""Pricing the arms: expected tokens per second of each, and the choice of the fastest."""

from __future__ import annotations

from typing import Mapping, Sequence

from stagedspec.auto.acceptance import AcceptanceStats, expected_tokens
from stagedspec.auto.arms import Arm, verify_rows
from stagedspec.auto.step_costs import SharedLoad, StepCosts, shared_step_seconds, solo_step_seconds
from stagedspec.costs import CostProfile
from stagedspec.realized_rates import RealizedRates

MARGIN = 0.03  # a speculative arm must promise this much more than `ar` to be chosen
# An exploring step's calibration is raised by this / sqrt(1 + steps the arm ran) (`AutoDrafter` explores every
# `EXPLORE_EVERY` priced steps, twice in a row: the first step may catch its draft up, and its drafting time is
# then not learned)
EXPLORE_WIDTH = 0.5


def expected_rates(
    arms: Sequence[Arm], profile: CostProfile, stats: AcceptanceStats, costs: StepCosts,
    lookup_lengths: Mapping[str, int], sampled: bool = False, load: SharedLoad | None = None,
    optimism: float = 0.0, catch_up: Mapping[str, float] | None = None, realized: RealizedRates | None = None,
) -> dict[Arm, float]:
    """Expected tokens per second of each arm: a pure function of the costs, the statistics and the load.

    With a `load` of other requests (the batched server), an arm's rate is the round's: (the others'
    tokens + the arm's) / (the others' seconds + what the arm adds to the round), the others' measured.
    `optimism`: upper confidence bounds instead (`expected_tokens`), for an exploring step.
    `catch_up`: seconds each arm kind's draft must first spend catching up, charged to this step.
    `realized`: the request's realized / priced rate per arm kind (`RealizedRates`), applied to solo prices.
    """
    rates = {}
    for arm in arms:
        tokens = expected_tokens(arm, stats, lookup_lengths, optimism=optimism)
        extra = (catch_up or {}).get(arm.kind, 0.0)
        if load is not None and load.others and load.seconds > 0:
            seconds = shared_step_seconds(arm, profile, load, lookup_lengths, sampled) + extra
            rates[arm] = (load.tokens + tokens) / (load.seconds + seconds)
            continue
        rate = tokens / (solo_step_seconds(arm, profile, costs, lookup_lengths, sampled) + extra)
        rates[arm] = rate * realized.factor(arm.kind) if realized is not None else rate
    return rates


def choose_arm(
    arms: Sequence[Arm], profile: CostProfile, stats: AcceptanceStats, costs: StepCosts,
    lookup_lengths: Mapping[str, int], sampled: bool = False, load: SharedLoad | None = None,
    explore: bool = False, catch_up: Mapping[str, float] | None = None, realized: RealizedRates | None = None,
    rates_out: dict[Arm, float] | None = None,
) -> Arm:
    """The arm with the highest expected tokens per second; `ar` unless another beats it by `MARGIN`.

    `load`: the batched round this step shares (`SharedLoad`); None or no others: priced alone.
    `explore`: rank by upper confidence bounds (`EXPLORE_WIDTH`), which favour arms that ran little.
    `realized`: the request's own realized / priced rates (`RealizedRates`), which scale the solo prices.
    `rates_out`: filled with every arm's rate (`contenders` reads them)."""
    # A lookup or copy arm whose chains add no row now is `ar` by another name: not a choice of its own (priced
    # by another kind's record it could win by noise, and every step it won was a full one, `AutoDrafter`)
    arms = [a for a in arms if a.kind not in ("lookup", "copy") or verify_rows(a, lookup_lengths) > 1] or arms
    rates = expected_rates(arms, profile, stats, costs, lookup_lengths, sampled, load,
                           EXPLORE_WIDTH if explore else 0.0, catch_up, realized)
    if rates_out is not None:
        rates_out.update(rates)
    best = max(rates, key=lambda a: rates[a])
    plain = Arm("ar")
    # A shared round's rate moves by about 1/requests of what this request's own rate would: so does the margin.
    margin = MARGIN / load.requests if load is not None and load.others and load.seconds > 0 else MARGIN
    if plain in rates and best != plain and rates[best] < (1.0 + margin) * rates[plain]:
        return plain
    return best


# Arms whose price moves with this step's lookup chains are priced every priced step; a draft's arms (`tree`,
# `staged`) move only as their statistics and times do, so between full pricings only those that came within
# this share of the best rate are priced (`contenders`).
CONTENDER_SHARE = 0.85


def contenders(rates: Mapping[Arm, float]) -> frozenset[Arm]:
    """The draft arms worth pricing until the next full pricing: those within `CONTENDER_SHARE` of the best
    rate of a full pricing (`rates`, every arm's).  Lookup arms and `ar` are always priced (`AutoPolicy.choose`).
    """
    if not rates:
        return frozenset()
    best = max(rates.values())
    return frozenset(a for a, r in rates.items() if a.kind in ("tree", "staged") and r >= CONTENDER_SHARE * best)
