"""Katz-backoff n-gram drafter: exact numbers on toy corpora, normalisation, fast tables, files."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from stagedspec.drafters.ngram import (
    NgramModel,
    benchmark_lookup,
    build_from_token_streams,
    katz_discount,
)
from stagedspec.errors import StagedSpecError
from stagedspec.tokenizer import vocab_fingerprint

# Toy corpus, one document, vocabulary {0..4} (token 4 never occurs).
TOY = [0, 1, 2, 0, 1, 3, 0, 1, 2, 1]
TOY_V = 5


def build(streams, order=3, vocab=TOY_V, **kw) -> NgramModel:  # noqa: ANN001, ANN003
    return build_from_token_streams(streams, order, vocab, "fp", progress=False, **kw)


@pytest.fixture(scope="module")
def toy() -> NgramModel:
    return build(TOY)


def ranking(dist: np.ndarray) -> list[int]:
    """Tokens of positive probability, by probability then smaller id: the model's documented order."""
    pos = np.flatnonzero(dist > 0)
    return pos[np.lexsort((pos, -dist[pos]))].tolist()


def random_corpus(vocab: int, n_tokens: int, n_docs: int, seed: int) -> list[np.ndarray]:
    """Zipf-distributed tokens with copied phrases, so every order has repeated and singleton n-grams."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        doc = list(rng.zipf(1.4, size=n_tokens // n_docs) % vocab)
        for _ in range(5):
            a = int(rng.integers(0, len(doc) - 8))
            b = int(rng.integers(0, len(doc) - 8))
            doc[b : b + 6] = doc[a : a + 6]
        docs.append(np.array(doc))
    return docs


# --------------------------------------------------------------------------- hand-computed numbers


def test_toy_trigram_matches_hand_computation(toy: NgramModel) -> None:
    # Unigram, add-one: counts 0:3 1:4 2:2 3:1 4:0, N = 10, V = 5 -> P(w) = (c + 1) / 15.
    assert toy.distribution([]) == pytest.approx([4 / 15, 5 / 15, 3 / 15, 2 / 15, 1 / 15])

    # Bigrams 01:3 12:2 20:1 13:1 30:1 21:1 -> n1 = 4, n2 = 1, n3 = 1, n4 = 0: Good-Turing (k = 5) is
    # degenerate, so absolute discounting with D = n1 / (n1 + 2 n2) = 4/6 = 2/3.
    d2 = toy.meta["discounts"]["2"]
    assert d2["method"] == "absolute" and d2["D"] == pytest.approx(2 / 3)
    # Context (0): only 01 (x3), c(0) = 3.  P*(1|0) = (3 - 2/3)/3 = 7/9.  Left over 2/9;
    # alpha(0) = (2/9) / (1 - P(1)) = (2/9) / (10/15) = 1/3, so P(w|0) = P(w)/3 for w != 1.
    assert toy.backoff_weight([0]) == pytest.approx(1 / 3)
    assert toy.distribution([0]) == pytest.approx([4 / 45, 7 / 9, 3 / 45, 2 / 45, 1 / 45])
    # Context (1): 12 (x2), 13 (x1), c = 3.  P*(2|1) = (4/3)/3 = 4/9, P*(3|1) = (1/3)/3 = 1/9.
    # alpha(1) = (1 - 5/9) / (1 - 3/15 - 2/15) = (4/9)/(2/3) = 2/3.
    assert toy.backoff_weight([1]) == pytest.approx(2 / 3)
    assert toy.distribution([1]) == pytest.approx([8 / 45, 10 / 45, 4 / 9, 1 / 9, 2 / 45])
    # Context (2): 20, 21 once each, c = 2: P* = (1/3)/2 = 1/6 each.  alpha(2) = (2/3) / (1 - 9/15)
    # = 5/3 (alpha may exceed 1): P(2|2) = 5/3 * 3/15 = 1/3, P(3|2) = 2/9, P(4|2) = 1/9.
    assert toy.backoff_weight([2]) == pytest.approx(5 / 3)
    assert toy.distribution([2]) == pytest.approx([1 / 6, 1 / 6, 1 / 3, 2 / 9, 1 / 9])
    # Context (3): 30 once: P*(0|3) = 1/3, alpha(3) = (2/3) / (1 - 4/15) = 10/11.
    assert toy.backoff_weight([3]) == pytest.approx(10 / 11)
    assert toy.prob([3], 1) == pytest.approx(10 / 11 * 5 / 15)

    # Trigrams 012:2, 120 201 013 130 301 121 once -> n1 = 6, n2 = 1: D = 6/8 = 3/4.
    assert toy.meta["discounts"]["3"]["D"] == pytest.approx(3 / 4)
    # Context (0,1): 012 (x2), 013 (x1), c = 3.  P*(2|01) = (2 - 3/4)/3 = 5/12, P*(3|01) = (1/4)/3 = 1/12.
    # alpha(01) = (1 - 1/2) / (1 - P(2|1) - P(3|1)) = (1/2)/(4/9) = 9/8, times P(.|1) for 0, 1, 4.
    assert toy.backoff_weight([0, 1]) == pytest.approx(9 / 8)
    assert toy.distribution([0, 1]) == pytest.approx([1 / 5, 1 / 4, 5 / 12, 1 / 12, 1 / 20])
    # Context (1,2): 120, 121 once each: P* = (1/4)/2 = 1/8.  alpha(12) = (3/4) / (1 - 1/6 - 1/6) = 9/8:
    # P(2|12) = 9/8 * 1/3 = 3/8, P(3|12) = 9/8 * 2/9 = 1/4, P(4|12) = 9/8 * 1/9 = 1/8.
    assert toy.backoff_weight([1, 2]) == pytest.approx(9 / 8)
    assert toy.distribution([1, 2]) == pytest.approx([1 / 8, 1 / 8, 3 / 8, 1 / 4, 1 / 8])
    assert toy.prob([7, 1, 2], 3) == pytest.approx(1 / 4)  # only the last order - 1 tokens matter


def test_unseen_contexts_back_off_to_their_suffix(toy: NgramModel) -> None:
    # (2,2) never occurred: P(.|2,2) = P(.|2).  (4) never occurred: the unigram.  (4,0): P(.|0).
    assert toy.backoff_weight([2, 2]) == 1.0
    np.testing.assert_array_equal(toy.distribution([2, 2]), toy.distribution([2]))
    np.testing.assert_array_equal(toy.distribution([4]), toy.distribution([]))
    np.testing.assert_array_equal(toy.distribution([4, 0]), toy.distribution([0]))
    # Ids outside the vocabulary cut the context there, as an unseen token would.
    np.testing.assert_array_equal(toy.distribution([0, 99]), toy.distribution([]))
    np.testing.assert_array_equal(toy.distribution([-1, 0]), toy.distribution([0]))


def test_good_turing_factors_by_hand() -> None:
    # n1..n6 = 100, 40, 20, 12, 8, 5; k = 5: A = 6 * 5 / 100 = 0.3, d_r = (r*/r - A) / (1 - A).
    d = katz_discount({1: 100, 2: 40, 3: 20, 4: 12, 5: 8, 6: 5, 9: 3}, k=5)
    assert d.method == "good-turing"
    # r* = 0.8, 1.5, 2.4, 10/3, 3.75; r*/r = 0.8, 0.75, 0.8, 5/6, 0.75.
    expected = [0.5 / 0.7, 0.45 / 0.7, 0.5 / 0.7, (5 / 6 - 0.3) / 0.7, 0.45 / 0.7]
    assert list(d.factors[1:]) == pytest.approx(expected)
    assert d.apply(np.array([1, 2, 5, 6, 9])) == pytest.approx([5 / 7, 2 * 9 / 14, 5 * 9 / 14, 6, 9])


def test_degenerate_good_turing_falls_back_to_absolute() -> None:
    d = katz_discount({1: 10, 2: 6, 3: 4, 4: 3, 5: 2, 6: 1})  # d_1 = (1.2 - 0.6)/0.4 = 1.5 > 1
    assert d.method == "absolute" and d.absolute_d == pytest.approx(10 / 22)
    assert d.apply(np.array([1, 3, 7])) == pytest.approx([1 - 10 / 22, 3 - 10 / 22, 7])
    assert katz_discount({1: 4}).absolute_d == 0.5  # n2 = 0: D = 1/2


def test_bigram_good_turing_by_hand() -> None:
    # Two-token documents, so each is one bigram: 01 x3, 02 x2, 12 x2, and 10 20 21 30 03 once.
    docs = [[0, 1]] * 3 + [[0, 2]] * 2 + [[1, 2]] * 2 + [[1, 0], [2, 0], [2, 1], [3, 0], [0, 3]]
    model = build(docs, order=2, vocab=4, discount_k=2)
    # n1 = 5, n2 = 2, n3 = 1, k = 2: A = 3 n3 / n1 = 3/5; d1 = (2 n2/n1 - A)/(1 - A) = (4/5 - 3/5)/(2/5) = 1/2,
    # d2 = (3 n3/(2 n2) - A)/(1 - A) = (3/4 - 3/5)/(2/5) = 3/8; counts above k = 2 are kept.
    d2 = model.meta["discounts"]["2"]
    assert d2["method"] == "good-turing" and d2["factors"] == pytest.approx([1 / 2, 3 / 8])
    # Unigram counts 0:9 1:7 2:6 3:2, N = 24, V = 4: P = (10, 8, 7, 3)/28.
    # Context (0): 01 x3 -> 3, 02 x2 -> 3/4, 03 x1 -> 1/2, c(0) = 6: P* = 1/2, 1/8, 1/12.
    # alpha(0) = (1 - 17/24) / (1 - 18/28) = (7/24)/(10/28) = 49/60; P(0|0) = 49/60 * 10/28 = 7/24.
    assert model.backoff_weight([0]) == pytest.approx(49 / 60)
    assert model.distribution([0]) == pytest.approx([7 / 24, 1 / 2, 1 / 8, 1 / 12])
    # Context (1): 12 x2 -> 3/4, 10 x1 -> 1/2, c = 3: P*(2|1) = 1/4, P*(0|1) = 1/6.
    # alpha(1) = (7/12) / (1 - 17/28) = 49/33: P(1|1) = 49/33 * 8/28 = 14/33, P(3|1) = 49/33 * 3/28 = 7/44.
    assert model.backoff_weight([1]) == pytest.approx(49 / 33)
    assert model.distribution([1]) == pytest.approx([1 / 6, 14 / 33, 1 / 4, 7 / 44])


def test_ngrams_do_not_span_documents() -> None:
    model = build([[0, 1], [2, 3]], order=2, vocab=4)
    assert model.n_contexts == {2: 2}  # only (0) and (2) are followed by something
    np.testing.assert_array_equal(model.distribution([1]), model.distribution([]))
    flat = build([0, 1, 2, 3], order=2, vocab=4)  # a flat sequence is one document
    assert flat.n_contexts == {2: 3}


# --------------------------------------------------------------------------- normalisation and fast tables


@pytest.mark.parametrize("order", [2, 3, 4, 5])
def test_every_distribution_sums_to_one(order: int) -> None:
    vocab = 40
    model = build(random_corpus(vocab, 1500, 3, seed=order), order=order, vocab=vocab)
    rng = np.random.default_rng(0)
    contexts = [list(rng.integers(0, vocab, size=n)) for n in range(order + 2) for _ in range(20)]
    contexts += [[vocab + 3]]  # out of vocabulary: the unigram
    for ctx in contexts:
        dist = model.distribution(ctx)
        assert dist.min() >= 0 and dist.sum() == pytest.approx(1.0, abs=1e-12)
    for m, lvl in model.levels.items():  # every seen context of every order
        for row in range(lvl.n_contexts):
            dist = model._dense(m, row)
            assert dist.min() >= 0 and dist.sum() == pytest.approx(1.0, abs=1e-12)
    ctx = contexts[-2]
    dist = model.distribution(ctx)
    for tok in range(vocab):
        assert model.prob(ctx, tok) == dist[tok]  # bit-identical, same float operations


def seen_contexts(model: NgramModel, corpus: list[np.ndarray]) -> list[list[int]]:
    """Every context of every length (0..order-1) that occurs in the corpus, plus random (mostly unseen) ones."""
    out = {()}
    for doc in corpus:
        for i in range(len(doc)):
            for n in range(1, model.order):
                if i - n >= 0:
                    out.add(tuple(doc[i - n : i].tolist()))
    rng = np.random.default_rng(1)
    out.update(tuple(rng.integers(0, model.vocab_size, size=model.order - 1).tolist()) for _ in range(30))
    return [list(c) for c in sorted(out)]


@pytest.mark.parametrize("order", [2, 3, 4])
def test_top_k_and_chain_agree_with_distribution(order: int) -> None:
    vocab = 30
    corpus = random_corpus(vocab, 1200, 2, seed=10 + order)
    model = build(corpus, order=order, vocab=vocab)
    contexts = seen_contexts(model, corpus)
    assert len(contexts) > vocab
    if order > 2:  # these seeds also exercise the dense fallback of the table merge
        assert model.meta["dense_fallbacks"] > 0
    for ctx in contexts:
        dist = model.distribution(ctx)
        best = ranking(dist)
        for k in (1, 3, model.top_n, model.top_n + 5):
            got = model.top_k(ctx, k)
            assert [t for t, _ in got] == best[:k]
            assert [p for _, p in got] == pytest.approx(dist[best[:k]], rel=1e-6)
    for ctx in contexts[:: max(1, len(contexts) // 40)]:
        chain, hist = model.propose_chain(ctx, 5), list(ctx)
        for tok, p in chain:
            dist = model.distribution(hist)
            assert tok == ranking(dist)[0] and p == pytest.approx(dist[tok], rel=1e-6)
            hist.append(tok)
        assert len(chain) == 5


def test_top_k_skips_zero_probability_tokens() -> None:
    all_seen = build([[0, 1]] * 7 + [[0, 0]] * 6, order=2, vocab=3, discount_k=5)
    # Counts 01:7, 00:6 are both above k = 5: nothing is discounted, alpha(0) = 0, P(2|0) = 0.
    assert all_seen.backoff_weight([0]) == 0.0
    assert all_seen.distribution([0]) == pytest.approx([6 / 13, 7 / 13, 0])
    assert all_seen.top_k([0], 5) == [(1, pytest.approx(7 / 13)), (0, pytest.approx(6 / 13))]


# --------------------------------------------------------------------------- files


def test_save_load_round_trip(tmp_path: Path) -> None:
    vocab = 30
    corpus = random_corpus(vocab, 800, 2, seed=3)
    model = build_from_token_streams(corpus, 4, vocab, fingerprint="abc123", progress=False)
    path = tmp_path / "model.ngram"  # any name: no ".npz" is appended
    model.save(path)
    assert path.is_file() and not (tmp_path / "model.ngram.npz").exists()
    loaded = NgramModel.load(path, expected_fingerprint="abc123", expected_vocab_size=vocab)
    assert (loaded.order, loaded.vocab_size, loaded.fingerprint, loaded.top_n) == (4, vocab, "abc123", 8)
    assert loaded.n_contexts == model.n_contexts
    assert loaded.meta["discounts"] == model.meta["discounts"]
    for ctx in seen_contexts(model, corpus)[::7]:
        np.testing.assert_array_equal(loaded.distribution(ctx), model.distribution(ctx))
        assert loaded.top_k(ctx, 8) == model.top_k(ctx, 8)
        assert loaded.propose_chain(ctx, 4) == model.propose_chain(ctx, 4)


def test_load_errors(tmp_path: Path, toy: NgramModel) -> None:
    with pytest.raises(StagedSpecError, match="not found"):
        NgramModel.load(tmp_path / "missing.npz")
    with pytest.raises(StagedSpecError, match="not found"):
        NgramModel.load(tmp_path)  # a directory

    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"definitely not a zip archive" * 10)
    with pytest.raises(StagedSpecError, match="not a valid n-gram file"):
        NgramModel.load(garbage)

    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))  # a valid npz, but not ours
    with pytest.raises(StagedSpecError, match="not a valid n-gram file"):
        NgramModel.load(other)

    good = tmp_path / "toy.npz"
    toy.save(good)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(StagedSpecError, match="not a valid n-gram file"):
        NgramModel.load(truncated)

    # A structurally damaged table (offsets not ending at the number of entries).
    damaged = tmp_path / "damaged.npz"
    with np.load(good) as data:
        arrays = {name: data[name] for name in data.files}
    arrays["o2_offsets"] = arrays["o2_offsets"] + 1
    np.savez(damaged, **arrays)
    with pytest.raises(StagedSpecError, match="not a valid n-gram file"):
        NgramModel.load(damaged)

    with pytest.raises(StagedSpecError, match="built for another tokenizer"):
        NgramModel.load(good, expected_fingerprint="something-else")
    with pytest.raises(StagedSpecError, match="vocabulary size 5"):
        NgramModel.load(good, expected_fingerprint="fp", expected_vocab_size=6)
    assert NgramModel.load(good, expected_fingerprint="fp", expected_vocab_size=5).order == 3
    with zipfile.ZipFile(good) as z:  # the format is a plain, pickle-free npz
        assert "meta.npy" in z.namelist()


def test_user_errors() -> None:
    with pytest.raises(StagedSpecError, match="order must be between 2 and 5"):
        build(TOY, order=6)
    with pytest.raises(StagedSpecError, match="order must be between 2 and 5"):
        build(TOY, order=1)
    with pytest.raises(StagedSpecError, match="outside the vocabulary"):
        build([0, 1, 7], vocab=5)
    with pytest.raises(StagedSpecError, match="outside the vocabulary"):
        build([0, -1, 2], vocab=5)
    with pytest.raises(StagedSpecError, match="no tokens"):
        build([[], []])
    with pytest.raises(StagedSpecError, match="no documents"):
        build([])
    with pytest.raises(StagedSpecError, match="flat sequence"):
        build([np.zeros((2, 2), dtype=int)])
    toy = build(TOY)
    with pytest.raises(StagedSpecError, match="outside the vocabulary"):
        toy.prob([0], 5)


def test_fingerprint_and_benchmark(toy: NgramModel) -> None:
    vocab = {"a": 0, "b": 1}
    assert vocab_fingerprint(vocab) == vocab_fingerprint(dict(reversed(vocab.items())))
    assert vocab_fingerprint(vocab) != vocab_fingerprint({"a": 1, "b": 0})
    assert len(vocab_fingerprint(vocab)) == 64
    us = benchmark_lookup(toy, [TOY[:i] for i in range(1, len(TOY))], chain_length=3, repeats=1)
    assert 0 < us < 1000
    assert toy.top_k([0, 1], 0) == [] and toy.propose_chain([0, 1], 0) == []
    assert toy.propose_chain(np.array([0, 1]), 2) == toy.propose_chain([0, 1], 2)  # numpy contexts work
