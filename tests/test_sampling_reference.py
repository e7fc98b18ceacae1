"""`probs_from_logits` against an independent numpy implementation of temperature, top-k and top-p.

Why: every exactness test says "distributed as the oracle's", and the oracle's distribution is whatever
`probs_from_logits` makes of its logits.  Comparing the engine's samples with that same function would
only show "equal to our own `ar`"; these tests pin the function itself to the definitions
(`tests/_reference_sampling.py` states them and the tie/threshold conventions), on hand-worked rows whose
answers are written out below, and on random rows of several vocabulary sizes.  A last test shows the
comparison has teeth: plausible wrong conventions disagree with the reference on the same rows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _reference_sampling import reference_probs, top_p_margin
from stagedspec.sampling import SamplingParams, probs_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

# (temperature, top_k, top_p): each knob alone, and combined as the chi-square configurations combine them.
PARAMS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0), (0.5, 40, 1.0), (1.0, 0, 0.9),
          (0.8, 0, 0.5), (1.3, 0, 0.93), (1.0, 4, 0.85), (0.7, 50, 0.9), (2.0, 2, 0.6)]


def _engine(logits: list[float] | torch.Tensor, t: float, k: int = 0, p: float = 1.0) -> np.ndarray:
    row = logits if isinstance(logits, torch.Tensor) else torch.tensor(logits, dtype=torch.float32)
    return np.asarray(probs_from_logits(row, SamplingParams(temperature=t, top_k=k, top_p=p)).tolist())


def _random_rows() -> list[torch.Tensor]:
    """Rows as the models make them: small and large vocabularies, flat and peaked, fp32 and bf16 values."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for vocab, scale in ((5, 1.5), (24, 2.0), (300, 3.0), (4096, 4.0)):
        for _ in range(4):
            rows.append(scale * torch.randn(vocab, generator=g))
    rows.append((3.0 * torch.randn(512, generator=g)).bfloat16().float())  # bf16 logits, ties likely far down
    return rows


ROWS = _random_rows()


@pytest.mark.parametrize("t, k, p", PARAMS, ids=[f"T{t}-k{k}-p{p}" for t, k, p in PARAMS])
def test_probs_from_logits_equals_the_definitions_on_random_rows(t: float, k: int, p: float) -> None:
    for i, row in enumerate(ROWS):
        if p < 1.0:  # a cumulative mass within fp32 rounding of p would make the kept prefix a coin toss
            assert top_p_margin(row, t, k, p) > 1e-5, f"row {i}: pick another seed, p sits on a cumulative mass"
        ref = reference_probs(row, t, k, p)
        got = _engine(row, t, k, p)
        assert np.array_equal(got > 0, ref > 0), f"row {i}: a different set of tokens kept"
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-7, err_msg=f"row {i}")


def _softmax(z: list[float]) -> list[float]:
    e = [math.exp(x - max(z)) for x in z]
    return [x / sum(e) for x in e]


# Rows whose answers are worked out by hand from the definitions: (logits, (T, k, p), expected distribution).
LOG = [math.log(x) for x in (0.5, 0.3, 0.15, 0.05)]
HAND_CASES = [
    ("temperature-1", [0.0, math.log(2)], (1.0, 0, 1.0), [1 / 3, 2 / 3]),
    ("temperature-divides-logits", [0.0, math.log(2)], (0.5, 0, 1.0), [1 / 5, 4 / 5]),
    ("temperature-above-1-flattens", [0.0, math.log(2)], (2.0, 0, 1.0), [1 / (1 + 2 ** 0.5), 2 ** 0.5 / (1 + 2 ** 0.5)]),
    ("greedy-first-of-ties", [1.0, 3.0, 3.0], (0.0, 0, 1.0), [0.0, 1.0, 0.0]),
    ("top-k-keeps-the-k-largest", [3.0, 1.0, 0.0, 2.0], (1.0, 2, 1.0), [*_softmax([3.0, 2.0])[:1], 0, 0,
                                                                         _softmax([3.0, 2.0])[1]]),
    ("top-k-keeps-ties-with-the-kth", [3.0, 1.0, 1.0, 0.0], (1.0, 2, 1.0), [*_softmax([3.0, 1.0, 1.0]), 0.0]),
    ("top-p-keeps-the-crossing-token", LOG, (1.0, 0, 0.6), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    ("top-p-below-the-first-mass", LOG, (1.0, 0, 0.49), [1.0, 0.0, 0.0, 0.0]),
    ("top-p-just-above-a-cumulative-mass", LOG, (1.0, 0, 0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    # top-k first: [0.4, 0.3] renormalised is [4/7, 3/7]; 4/7 >= 0.5, so top-p keeps token 0 alone (top-p first
    # would keep tokens 0 and 1: 0.4 < 0.5)
    ("top-k-before-top-p", [math.log(x) for x in (0.4, 0.3, 0.2, 0.1)], (1.0, 2, 0.5), [1.0, 0.0, 0.0, 0.0]),
    # temperature first: T=2 flattens [0.5, 0.3, 0.2] to sqrt-proportional masses, 0.416 < 0.5 keeps token 1 too
    # (top-p before temperature would keep token 0 alone: 0.5 >= 0.5)
    ("temperature-before-top-p", [math.log(x) for x in (0.5, 0.3, 0.2)], (2.0, 0, 0.5),
     [0.5 ** 0.5 / (0.5 ** 0.5 + 0.3 ** 0.5), 0.3 ** 0.5 / (0.5 ** 0.5 + 0.3 ** 0.5), 0.0]),
]


@pytest.mark.parametrize("logits, params, expected", [c[1:] for c in HAND_CASES], ids=[c[0] for c in HAND_CASES])
def test_hand_worked_rows(logits: list[float], params: tuple[float, int, float], expected: list[float]) -> None:
    """Both implementations give the answer worked out by hand: the reference is right, not merely self-consistent."""
    np.testing.assert_allclose(reference_probs(logits, *params), expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(_engine(logits, *params), expected, rtol=2e-6, atol=1e-7)


# --- negative controls: wrong conventions the comparison above must tell apart --------------------------------


def _exclusive_top_p(logits: torch.Tensor, t: float, k: int, p: float) -> np.ndarray:
    """WRONG: keeps tokens while the mass *including* them stays <= p (drops the token that crosses p)."""
    w = reference_probs(logits, t, k, 1.0)
    order = np.argsort(-w, kind="stable")
    keep = np.zeros_like(w, dtype=bool)
    keep[order[np.cumsum(w[order]) <= p]] = True
    keep[order[0]] = True
    w = np.where(keep, w, 0.0)
    return w / w.sum()


def _top_p_before_temperature(logits: torch.Tensor, t: float, k: int, p: float) -> np.ndarray:
    """WRONG: the top-p set chosen on the T=1 distribution, temperature applied to the survivors afterwards."""
    support = reference_probs(logits, 1.0, k, p) > 0
    w = reference_probs(logits, t, k, 1.0) * support
    return w / w.sum()


def _top_k_after_softmax_unrenormalised(logits: torch.Tensor, t: float, k: int, p: float) -> np.ndarray:
    """WRONG: top-k zeroes the tail of the full softmax but the top-p cut reads the unrenormalised masses."""
    w = reference_probs(logits, t, 0, 1.0)
    if k and k < len(w):
        w = np.where(w >= np.sort(w)[::-1][k - 1], w, 0.0)
    order = np.argsort(-w, kind="stable")
    before = np.cumsum(w[order]) - w[order]
    keep = np.zeros_like(w, dtype=bool)
    keep[order[before < p]] = True
    w = np.where(keep, w, 0.0)
    return w / w.sum()


WRONG = [("exclusive-top-p", _exclusive_top_p), ("top-p-before-temperature", _top_p_before_temperature),
         ("top-p-on-unrenormalised-top-k", _top_k_after_softmax_unrenormalised)]


@pytest.mark.parametrize("wrong", [w[1] for w in WRONG], ids=[w[0] for w in WRONG])
def test_a_wrong_convention_disagrees_with_the_engine_on_the_same_rows(wrong) -> None:  # noqa: ANN001
    """Each mistake, run on the rows and parameters of the comparison test, differs from the engine somewhere
    by far more than the tolerance there: that test would catch it."""
    worst = 0.0
    for t, k, p in PARAMS:
        if p == 1.0:
            continue
        for row in ROWS:
            worst = max(worst, float(np.abs(wrong(row, t, k, p) - _engine(row, t, k, p)).max()))
    assert worst > 1e-2, f"the comparison cannot tell this convention from the engine's (max diff {worst:.2g})"
