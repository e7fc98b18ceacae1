"""Prompt-lookup drafter: matching, copying, frequencies, incremental updates."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stagedspec.drafters.context import ContextDrafter
from stagedspec.errors import StagedSpecError


def tokens_of(chain: list[tuple[int, float]]) -> list[int]:
    return [t for t, _ in chain]


def test_copies_the_span_after_a_repeated_suffix() -> None:
    d = ContextDrafter([1, 2, 3, 4, 5, 9, 1, 2, 3])
    # Suffix (1, 2, 3) occurred at 0..2; what followed was 4 5 9, then the copy reaches 1 2 3 itself.
    assert d.propose_chain(3) == [(4, 1.0), (5, 1.0), (9, 1.0)]
    assert tokens_of(d.propose_chain(6)) == [4, 5, 9, 1, 2, 3]
    assert d.top_k(5) == [(4, 1.0)]  # every matched suffix (1 2 3, 2 3, 3) was followed only by 4


def test_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    d = ContextDrafter([5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2])
    # (5, 1, 2) matches at 0..2 -> 7, although (1, 2) last continued with 8.
    assert tokens_of(d.propose_chain(2)) == [7, 6]
    d = ContextDrafter([5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2], max_ngram=2)
    assert tokens_of(d.propose_chain(2)) == [8, 5]  # only (1, 2) can match: its latest occurrence


def test_probabilities_are_empirical_frequencies() -> None:
    d = ContextDrafter([1, 2, 7, 1, 2, 8, 1, 2])
    # (1, 2) occurred twice before, followed by 7 and by 8; the most recent (8) is copied.
    chain = d.propose_chain(2)
    assert chain == [(8, 0.5), (1, 1.0)]  # 8: one of two occurrences; then, of those, all went on with 1
    # top_k: (1, 2) was followed by 7 and 8 once each (a tie: the most recent first); the shorter
    # suffix (2,) was followed by the same two tokens, so it adds nothing.
    assert d.top_k(3) == [(8, 0.5), (7, 0.5)]

    d = ContextDrafter([1, 2, 1, 3, 1, 2, 1])
    # Suffix (1, 2, 1) -> 3 (once); (2, 1) -> 3 (once); (1,) -> 2 twice, 3 once.
    assert d.top_k(3) == [(3, 1.0), (2, pytest.approx(2 / 3))]
    assert tokens_of(d.propose_chain(4)) == [3, 1, 2, 1]


def test_self_overlapping_copies_extend_a_pattern() -> None:
    assert tokens_of(ContextDrafter([7, 7, 7]).propose_chain(5)) == [7] * 5
    assert tokens_of(ContextDrafter([1, 2, 1, 2]).propose_chain(5)) == [1, 2, 1, 2, 1]


def test_no_match_gives_nothing() -> None:
    assert ContextDrafter().propose_chain(4) == [] and ContextDrafter().top_k(4) == []
    d = ContextDrafter([1, 2, 3, 4])
    assert d.propose_chain(4) == [] and d.top_k(4) == []  # the suffix never matches itself
    d = ContextDrafter([3, 1, 2, 3], min_ngram=2)
    assert d.propose_chain(4) == []  # only a unigram repeats
    assert ContextDrafter([3, 1, 2, 3]).propose_chain(2) == [(1, 1.0), (2, 1.0)]
    assert d.propose_chain(0) == [] and d.top_k(0) == []


def test_updates_incrementally() -> None:
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 12, size=400).tolist()
    stream[300:340] = stream[100:140]  # a long repeat
    online = ContextDrafter(stream[:50])
    for i in range(50, len(stream), 7):
        online.update(stream[i : i + 7])
        batch = ContextDrafter(stream[: i + 7])
        assert online.propose_chain(6) == batch.propose_chain(6)
        assert online.top_k(5) == batch.top_k(5)
    assert len(online) == len(stream) and online.tokens == stream

    d = ContextDrafter([10, 11, 12, 13])
    assert d.propose_chain(2) == []
    d.update([10, 11])  # now (10, 11) repeats
    assert tokens_of(d.propose_chain(2)) == [12, 13]
    d.update(np.array([12, 99]))  # numpy ints are fine; the match is now broken
    assert d.propose_chain(2) == []
    d.reset([4, 5, 4])
    assert len(d) == 3 and tokens_of(d.propose_chain(1)) == [5]


def test_recent_window_caps_the_work_per_call() -> None:
    d = ContextDrafter([1, 2] * 5000, recent=8)
    chain = d.propose_chain(3)
    assert tokens_of(chain) == [1, 2, 1] and all(p == 1.0 for _, p in chain)
    assert all(len(occ.ends) <= 16 for occ in d._index.values())


def test_rejects_bad_settings() -> None:
    with pytest.raises(StagedSpecError, match="min n-gram"):
        ContextDrafter(min_ngram=0)
    with pytest.raises(StagedSpecError, match="must be >= min n-gram"):
        ContextDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(StagedSpecError, match="recent"):
        ContextDrafter(recent=0)


def _index_state(d: ContextDrafter) -> dict:
    """What proposals can read of the index: the recent ends, next-token stats and totals per n-gram."""
    return {key: (occ.ends[-d.recent:], {t: list(s) for t, s in occ.nexts.items()}, occ.total)
            for key, occ in d._index.items()}


@pytest.mark.parametrize("recent", [1, 2, 32])
def test_truncate_leaves_the_index_reset_would_build(recent):
    """Taking tokens back (as below a model stage) gives the state and proposals of a fresh index."""
    rng = random.Random(recent)
    d = ContextDrafter(max_ngram=3, recent=recent)
    for _ in range(300):
        if rng.random() < 0.6 or len(d) == 0:
            d.update(rng.choice([0, 1, 2, 3]) for _ in range(rng.randint(1, 12)))
        else:
            d.truncate(len(d) - rng.randint(1, min(len(d), 8)))
        fresh = ContextDrafter(d.tokens, max_ngram=3, recent=recent)
        assert _index_state(d) == _index_state(fresh)
        assert d.propose_chain(5) == fresh.propose_chain(5) and d.top_k(3) == fresh.top_k(3)


def test_lookup_drafter_follows_a_context_that_takes_tokens_back():
    """The lookup drafter's proposals after the context lost its tail equal those of a fresh drafter."""
    from stagedspec.drafters.lookup import LookupDrafter

    rng = random.Random(0)
    base = [rng.choice(range(6)) for _ in range(80)]
    d = LookupDrafter()
    d.begin(base)
    for _ in range(50):
        cut = len(base) - rng.randint(0, 5)
        base = base[:cut] + [rng.choice(range(6)) for _ in range(rng.randint(1, 5))]
        fresh = LookupDrafter()
        assert d.chains(base, 4) == fresh.chains(base, 4)


def test_match_length_is_the_suffix_the_copy_follows() -> None:
    """`match_length` names the suffix `propose_chain` copies after: `auto` learns and prices copies by it."""
    assert ContextDrafter([1, 2, 3, 4, 5, 9, 1, 2, 3]).match_length() == 3
    assert ContextDrafter([5, 1, 2, 7, 6, 1, 2]).match_length() == 2
    assert ContextDrafter([1, 2, 3, 4, 2]).match_length() == 1
    assert ContextDrafter([1, 2, 3]).match_length() == 0
