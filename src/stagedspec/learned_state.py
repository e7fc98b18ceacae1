"""What decoding learns about this machine with one set of models, kept apart from the pipeline that uses it.

Two things are learned:

- the seconds of one oracle pass by row count (`pass_seconds`), which the
  adaptive tree budget prices trees with (`stagedspec.budget`);
- the measured-sizing policies (`stagedspec.auto.AutoPolicy`), one per method:
  `auto`'s over every arm, and each measured method's (`SpeculationConfig.sizing`)
  over `ar` and that method's arms.  A policy starts from what an earlier
  process saved beside the cost profile it was learned with, and is saved
  there again after each run that taught it something.

A `Pipeline` makes one of its own; the server makes one and gives it to every
request's pipeline, so that one measurement and one policy per method serve
all requests.  The saved policies are keyed by their cost profile (models,
machine), so they never mix; the pass costs in memory are one oracle's, so
one state serves the pipelines over one oracle.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stagedspec import costs
from stagedspec.methods import METHODS
from stagedspec.paths import learned_store, write_text_atomic

if TYPE_CHECKING:
    from stagedspec.auto import Arm, AutoPolicy
    from stagedspec.costs import CostProfile
    from stagedspec.models.transformer import Transformer

def forget_everything() -> list[Path]:
    """Delete what this machine has learned (`stagedspec tune --reset`), for every model: the next run
    measures and learns again.  Returns the files removed."""
    folder = learned_store()
    removed = sorted(p for p in folder.glob("*") if p.is_file()) if folder.is_dir() else []
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


# Row counts the oracle's pass costs are measured at (below the most a caller asks for, which is added).
PASS_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def auto_state_path(profile_key: str, method: str = "auto") -> Path:
    """Where `--method auto`'s learned state lives (or a measured method's: `METHOD-sizes`): beside the cost
    profile it was learned with."""
    name = "auto" if METHODS[method].always_measured else f"{method}-sizes"
    return costs.profile_path(profile_key).with_name(f"{profile_key}.{name}.json")  # whatever the profile's version


class LearnedState:
    """Measured oracle pass costs and the measured-sizing policies, by method; shareable between pipelines
    over the same models (the server's requests)."""

    def __init__(self) -> None:
        self._pass_seconds: dict[int, float] | None = None
        self._policies: dict[str, AutoPolicy] = {}

    def pass_seconds(self, model: Transformer, max_rows: int) -> dict[int, float]:
        """Seconds of one pass of `model` (the oracle) per number of rows up to `max_rows`: measured at first
        use (about a second), and again only when a caller needs more rows than were measured.

        What verification costs depends on this machine's kernels, dtype and threads, so it is measured
        rather than assumed."""
        cached = self._pass_seconds
        if cached is None or max(cached) < max_rows:
            # deferred: profiling imports torch, which reading and writing the learned state does not need
            from stagedspec.profiling import forward_cost_curve

            sizes = sorted({r for r in PASS_ROWS if r < max_rows} | {max_rows})
            context = min(256, model.config.max_position - max_rows - 1)
            cached = forward_cost_curve(model, sizes=sizes, context=max(1, context), repeats=3)
            self._pass_seconds = cached
        return cached

    def policy(self, method: str, arms: Sequence[Arm], profile: Callable[[], CostProfile]) -> AutoPolicy:
        """`method`'s policy ("auto", or a measured method), kept across requests: at first use a new one
        over `arms`, priced by `profile()` (this machine's cost profile: read from disk or measured), and
        started from what an earlier process learned with that profile, if it saved anything."""
        policy = self._policies.get(method)
        if policy is None:
            # deferred: auto imports torch, which reading and writing the learned state does not need
            from stagedspec.auto import AutoPolicy

            policy = AutoPolicy(arms, profile())
            try:  # what an earlier process learned on this machine with these models
                policy.restore(json.loads(auto_state_path(policy.profile.key, method).read_text()))
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                pass  # none yet, or unreadable: start from the priors
            self._policies[method] = policy
        return policy

    def set_policy(self, method: str, policy: AutoPolicy) -> None:
        """Use `policy` for `method` from now on instead of one made at first use (a test's policy on a
        hand-made profile: every arm gets its turn)."""
        self._policies[method] = policy

    def existing_policy(self, method: str) -> AutoPolicy | None:
        """`method`'s policy if one was made or set, else None (nothing is measured or read)."""
        return self._policies.get(method)

    def method_of(self, policy: object) -> str | None:
        """The method whose kept policy `policy` is (None: another one, such as a seeded run's own)."""
        return next((m for m, p in self._policies.items() if p is policy), None)

    def save(self, method: str) -> None:
        """Keep what `method`'s policy learned for the next process (a small JSON file beside the cost
        profile).  A policy on a hand-made profile (tests) belongs to no machine and is not saved."""
        policy = self._policies.get(method)
        if policy is None or not policy.profile.key:
            return
        path = auto_state_path(policy.profile.key, method)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(policy.state()))
        except OSError:
            pass  # a read-only cache costs a little exploration next time, nothing else
