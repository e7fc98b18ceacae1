"""Greedy verification on hand-made trees, and degenerate sampling cases with a known answer."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree
from stagedspec.verification import VerifyResult, verify

V = 8
GREEDY = SamplingParams()


def rows(*argmaxes: int) -> Tensor:
    """Oracle logits whose row i has its maximum at argmaxes[i] (and distinct lower values elsewhere)."""
    logits = torch.linspace(0.0, 1.0, V).repeat(len(argmaxes), 1)
    for i, t in enumerate(argmaxes):
        logits[i, t] = 5.0
    return logits


def tree_example() -> TokenTree:
    """
    0:root(9)
    ├── 1:(1) ── 3:(3) ── 5:(5)
    │         └─ 4:(4)
    └── 2:(2) ── 6:(6)
    """
    return TokenTree([9, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 1, 3, 2])


@pytest.mark.parametrize(
    "argmaxes, accepted, next_token",
    [
        ((7, 0, 0, 0, 0, 0, 0), [], 7),  # root rejects both children
        ((1, 7, 0, 0, 0, 0, 0), [1], 7),  # first child, then a correction
        ((2, 0, 6, 0, 0, 0, 7), [2, 6], 7),  # second branch to its leaf, bonus token
        ((1, 4, 0, 0, 3, 0, 0), [1, 4], 3),  # second grandchild, leaf: bonus 3
        ((1, 3, 0, 5, 0, 2, 0), [1, 3, 5], 2),  # full depth
        ((1, 3, 0, 6, 0, 0, 0), [1, 3], 6),  # 6 exists in the tree, but not under node 3
    ],
)
def test_greedy_follows_the_oracle_argmax(argmaxes: tuple[int, ...], accepted: list[int], next_token: int) -> None:
    result = verify(tree_example(), rows(*argmaxes), GREEDY, None)
    assert result == VerifyResult(accepted, next_token)


def test_greedy_root_only_tree_is_autoregressive() -> None:
    assert verify(TokenTree([3], [-1]), rows(6), GREEDY, None) == VerifyResult([], 6)


def test_greedy_chain() -> None:
    chain = TokenTree.chain(0, [4, 5, 6])
    assert verify(chain, rows(4, 5, 6, 1), GREEDY, None) == VerifyResult([1, 2, 3], 1)
    assert verify(chain, rows(4, 2, 6, 1), GREEDY, None) == VerifyResult([1], 2)


def test_greedy_duplicate_children_take_the_first() -> None:
    tree = TokenTree([0, 3, 3], [-1, 0, 0])
    assert verify(tree, rows(3, 1, 2), GREEDY, None) == VerifyResult([1], 1)


def test_greedy_ignores_sampling_filters_and_draft_q() -> None:
    """Temperature 0 is greedy whatever top-k/top-p say; a sampled tree's q is irrelevant."""
    tree = tree_example()
    tree.sampled = True
    tree.child_q = {u: torch.full((V,), 1.0 / V) for u in range(len(tree))}
    params = SamplingParams(temperature=0.0, top_k=2, top_p=0.5)
    assert verify(tree, rows(2, 0, 6, 0, 0, 0, 7), params, None) == VerifyResult([2, 6], 7)


def test_greedy_argmax_ties_match_torch_argmax() -> None:
    logits = torch.zeros(2, V)
    logits[0, [2, 5]] = 1.0  # a tie: torch's argmax picks the first maximal index
    tree = TokenTree([0, 2], [-1, 0])
    assert verify(tree, logits, GREEDY, None).accepted == [1]


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="shape"):
        verify(tree_example(), rows(1, 2), GREEDY, None)


# --------------------------------------------------------------------------
# Sampling cases whose answer is certain
# --------------------------------------------------------------------------

T1 = SamplingParams(temperature=1.0)


def peaked(*argmaxes: int) -> Tensor:
    """Rows so peaked that sampling is deterministic in float32 (other tokens get exp(-200) ~ 0)."""
    logits = torch.zeros(len(argmaxes), V)
    for i, t in enumerate(argmaxes):
        logits[i, t] = 200.0
    return logits


@pytest.mark.parametrize("sampled", [False, True])
def test_sampling_with_a_certain_oracle_acts_like_greedy(sampled: bool) -> None:
    tree = tree_example()
    if sampled:
        tree.sampled = True
        tree.child_q = {u: torch.full((V,), 1.0 / V) for u in range(len(tree)) if tree.children(u)}
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert verify(tree, peaked(1, 4, 0, 0, 3, 0, 0), T1, gen) == VerifyResult([1, 4], 3)
        assert verify(tree, peaked(7, 0, 0, 0, 0, 0, 0), T1, gen) == VerifyResult([], 7)


def test_tokens_outside_the_oracle_top_k_are_always_rejected() -> None:
    tree = TokenTree([0, 6, 7], [-1, 0, 0])
    logits = torch.arange(V, dtype=torch.float32).flip(0).repeat(3, 1)  # oracle prefers low ids
    params = SamplingParams(temperature=1.0, top_k=3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        result = verify(tree, logits, params, gen)
        assert result.accepted == [] and result.next_token in (0, 1, 2)


def test_sampled_draft_equal_to_oracle_always_accepts() -> None:
    """p == q: the ratio is 1, so acceptance is certain and the (empty) residual is never needed."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    tree = TokenTree([0, 2, 5], [-1, 0, 1], sampled=True)
    tree.child_q = {0: logits[0].softmax(-1), 1: logits[1].softmax(-1)}
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert verify(tree, logits, T1, gen).accepted == [1, 2]


def test_sampled_verification_reports_the_first_childs_acceptance_probability() -> None:
    """`first_accept`: p(x) for a fixed first child, min(1, p(x) / q(x)) for a drawn one, whatever the draw; None
    greedy and for a root without children.  It only reads p: the draws and the result are the same."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    p = logits[0].softmax(-1)
    fixed = TokenTree([0, 4, 6], [-1, 0, 0])
    for seed in range(5):
        assert verify(fixed, logits, T1, torch.Generator().manual_seed(seed)).first_accept == pytest.approx(float(p[4]))
    drawn = TokenTree([0, 4, 6], [-1, 0, 0], sampled=True)
    q = torch.full((V,), 1.0 / V)
    drawn.child_q = {0: q}
    assert verify(drawn, logits, T1, torch.Generator().manual_seed(0)).first_accept == \
        pytest.approx(min(1.0, float(p[4]) * V))
    assert verify(fixed, logits, SamplingParams(), None).first_accept is None
    # the batched walk (CUDA logits) reports the same, from the acceptance probabilities it computes anyway
    from stagedspec.verification import verify_sampled
    for tree, expected in ((fixed, float(p[4])), (drawn, min(1.0, float(p[4]) * V))):
        got = verify_sampled(tree, logits, T1, torch.Generator().manual_seed(0)).first_accept
        assert got == pytest.approx(expected)
    assert verify(TokenTree([0], [-1]), logits[:1], T1, torch.Generator().manual_seed(0)).first_accept is None


def test_sampled_tree_without_child_q_is_an_error() -> None:
    tree = TokenTree([0, 2], [-1, 0], sampled=True)
    with pytest.raises(StagedSpecError, match="child_q"):
        verify(tree, torch.zeros(2, V), T1, torch.Generator().manual_seed(0))


def test_sampling_is_reproducible_with_a_seed() -> None:
    tree = tree_example()
    logits = torch.randn(len(tree), V, generator=torch.Generator().manual_seed(3))

    def run(seed: int) -> list[VerifyResult]:
        gen = torch.Generator().manual_seed(seed)
        return [verify(tree, logits, T1, gen) for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_greedy_tokens_match_argmax_with_ties_and_nan():
    """`greedy_tokens` (max on the CPU) picks argmax's index: the first among ties, NaN as the maximum."""
    from stagedspec.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows, vocab = 1 + trial % 13, (49152, 8192, 7)[trial % 3]
        x = (torch.randint(-4, 5, (rows, vocab), generator=g) * 0.5).to((torch.bfloat16, torch.float32)[trial % 2])
        if trial % 5 == 0:
            x[0, trial % vocab] = float("nan")
        if trial % 4 == 0:
            x = x.t().contiguous().t()  # a strided view
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
