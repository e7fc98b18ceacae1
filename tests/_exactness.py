"""Proof that an identity test of a speculative method tested speculation: drafted tokens were accepted.

Why: a speculative method whose sizes are measured (`--sizing measured`, `auto`) may draft nothing on a given
machine, and a drafter may propose only tokens the oracle rejects.  Its greedy output is then `ar`'s by
construction, and "identical to `ar`" compares `ar` with `ar`.  Every identity test of a speculative method
calls `assert_drafts_used` on the runs it compared, with a floor on the mean accepted length stated per test.

A run is described by whatever the code under test hands back:

- a `GenerationResult` or `GenerationStats` (library, `speculative_generate`, `Pipeline.generate`);
- the CLI's `--json` object (its `stats` holds `accepted_lengths`), or such a `stats` dict;
- the server's `stagedspec` extension of a response (`tokens_by_stage`: tokens per proposer, `"oracle"` being
  the oracle's own one per step).
"""

from __future__ import annotations

from typing import Any, Iterable


def accepted_and_steps(run: Any) -> tuple[int, int]:
    """(draft tokens accepted, oracle steps) of one run, from any of the forms in the module docstring."""
    stats = getattr(run, "stats", run)
    if isinstance(stats, dict) and "stats" in stats:
        stats = stats["stats"]
    lengths = stats.get("accepted_lengths") if isinstance(stats, dict) else getattr(stats, "accepted_lengths", None)
    if lengths is not None:
        return int(sum(lengths)), len(lengths)
    if isinstance(stats, dict) and "tokens_by_stage" in stats:
        by_stage = stats["tokens_by_stage"]
        # every step emits exactly one oracle token (the last step's may be cut by the length limit: close enough
        # for a floor, and never counts a drafted token that was not emitted)
        steps = int(by_stage.get("oracle", 0))
        return int(sum(v for k, v in by_stage.items() if k != "oracle")), steps
    raise TypeError(f"cannot read accepted draft tokens from {type(run).__name__}: {run!r:.200}")


def assert_drafts_used(runs: Any | Iterable[Any], method: str, floor: float = 1.0) -> float:
    """Assert that `runs` (one run or several) accepted drafted tokens: at least one, and a mean accepted length
    (tokens emitted per oracle step, over all the runs) above `floor`.  Returns that mean.

    `floor` 1.0 (the default) only demands that something drafted was accepted; a test whose drafts are known to
    be good states a higher floor, so a drafter that quietly stopped proposing most of its tokens fails too."""
    if isinstance(runs, (list, tuple)):
        items = list(runs)
    else:
        items = [runs]
    accepted = steps = 0
    for run in items:
        a, s = accepted_and_steps(run)
        accepted, steps = accepted + a, steps + s
    mean = (accepted + steps) / steps if steps else 0.0
    assert accepted > 0 and mean > floor, (
        f"{method}: mean accepted length {mean:.2f} over {steps} oracle steps ({accepted} drafted tokens accepted, "
        f"{len(items)} runs), floor {floor:g}: no draft was proven used, so its identity with ar compared ar "
        "with ar")
    return mean


def assert_bit_identical(got: Any, want: Any, what: str) -> None:
    """Assert two tensors are equal bit for bit, and say where they first differ when they are not.

    Why: the row-exactness tests compare a row computed among others with the same row computed alone; a bare
    `torch.equal` failure prints two tensors that agree to every shown digit and says nothing of which row or
    how far apart."""
    import torch

    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if torch.equal(got, want):
        return
    differs = got != want
    if got.is_floating_point():
        differs &= ~(torch.isnan(got) & torch.isnan(want))
    at = tuple(int(i) for i in differs.nonzero()[0])
    gap = (got.float() - want.float()).abs().max().item()
    raise AssertionError(f"{what}: not bit-identical: first at index {at} ({got[at].item()!r} != "
                         f"{want[at].item()!r}), {int(differs.sum())} of {differs.numel()} values differ, "
                         f"largest gap {gap:.3g}")
