"""The adaptive tree budget: the cut it picks, what it learns, and that it keeps greedy output exact."""

from __future__ import annotations

import pytest
import torch

from stagedspec.budget import AdaptiveBudget
from stagedspec.drafters.model import ModelDrafter
from stagedspec.errors import StagedSpecError
from stagedspec.generation import speculative_generate
from stagedspec.request import generate_ar
from stagedspec.runner import ModelOracle
from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.transformer import init_random
from stagedspec.tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = {1: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}  # verification as cheap for 16 rows as for one
STEEP = {1: 1.0, 2: 2.0, 16: 16.0}  # every row costs a full pass (no batching gain)


def test_flat_costs_keep_every_useful_node_and_steep_costs_keep_none() -> None:
    scores = [0.9, 0.5, 0.3, 0.01]
    assert AdaptiveBudget(FLAT).choose(scores, draft_seconds=0.1) == 4
    assert AdaptiveBudget(STEEP).choose(scores, draft_seconds=0.1) == 0
    mid = AdaptiveBudget({1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.5})
    assert mid.choose(scores, draft_seconds=0.0) == 2  # 1 + 1.4 tokens for 1.0 beats 1 + 1.7 for 2.0
    assert mid.pass_cost(6) == pytest.approx(3.0)  # extrapolated along the last segment


def test_alpha_learns_an_overconfident_draft_and_shrinks_the_cut() -> None:
    budget = AdaptiveBudget({1: 1.0, 2: 1.0, 3: 1.1, 4: 1.3, 5: 1.6}, prior_steps=1.0)
    scores = [0.9, 0.8, 0.7, 0.6]
    first = budget.choose(scores, draft_seconds=0.0)
    for _ in range(50):
        budget.observe(predicted=2.0, accepted=0)  # the draft is never right
    assert budget.alpha < 0.05 and budget.choose(scores, draft_seconds=0.0) < first


def test_bad_cost_curves_are_refused() -> None:
    with pytest.raises(ValueError):
        AdaptiveBudget({})
    with pytest.raises(ValueError):
        AdaptiveBudget({1: 0.0})


def test_best_prefix_keeps_ancestors_and_the_highest_scores() -> None:
    tree = TokenTree([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3], scores=[1.0, 0.5, 0.3, 0.25, 0.2, 0.1])
    cut = tree.best_prefix(3)
    assert sorted(zip(cut.tokens, cut.scores)) == [(0, 1.0), (1, 0.5), (2, 0.3), (3, 0.25)]
    assert all(cut.parents[i] < i for i in range(1, len(cut)))
    assert cut.parents[cut.tokens.index(3)] == cut.tokens.index(1)
    assert tree.best_prefix(10) is tree
    with pytest.raises(StagedSpecError):
        TokenTree([0, 1], [-1, 0]).best_prefix(1)  # no scores


def _tiny(seed: int, layers: int) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=24, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=256)
    return init_random(Transformer(cfg), seed=seed, std=0.3).eval()


def test_adaptive_trees_keep_greedy_output_identical_to_ar() -> None:
    for seed in range(6):
        oracle, draft = _tiny(seed, 3), _tiny(seed + 100, 1)
        prompt = torch.randint(0, 24, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = generate_ar(oracle, prompt, max_new_tokens=30).token_ids
        # a cost curve that makes mid-sized trees worth it, so cuts of many sizes happen
        budget = AdaptiveBudget({1: 1.0, 4: 1.05, 8: 1.3, 16: 2.0})
        drafter = ModelDrafter(draft, method="tree", tree_budget=12, max_depth=4, branching=3, adaptive=budget)
        out = speculative_generate(ModelOracle(oracle, 300), drafter, prompt, max_new_tokens=30)
        assert out.token_ids == ref, f"seed {seed}"
        assert max(out.stats.tree_sizes) <= 12 and len(budget.chosen) == len(out.stats.tree_sizes)
        assert budget.predicted > 0
