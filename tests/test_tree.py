"""TokenTree geometry and `grow_tree`: budgets, best-first order, batching, fixed sampled shapes."""

from __future__ import annotations

import math
from collections import Counter
from itertools import product

import pytest
import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree, _sampled_template, grow_tree

V = 6
GREEDY = SamplingParams()
T1 = SamplingParams(temperature=1.0)


class TableDraft:
    """A draft 'model': fixed random logits per token path, and a log of every `expand` call."""

    def __init__(self, seed: int = 0, vocab: int = V, scale: float = 2.0) -> None:
        self.seed, self.vocab, self.scale = seed, vocab, scale
        self.calls: list[list[int]] = []

    def logits_at(self, path: tuple[int, ...]) -> Tensor:
        gen = torch.Generator().manual_seed(hash((self.seed, path)) % 2**31)
        return self.scale * torch.randn(self.vocab, generator=gen)

    def __call__(self, tree: TokenTree, nodes: list[int]) -> Tensor:
        self.calls.append(list(nodes))
        return torch.stack([self.logits_at(tuple(tree.tokens[j] for j in [0, *tree.path_to(n)])) for n in nodes])


def node_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[j] for j in [0, *tree.path_to(i)]) for i in range(1, len(tree))}


def all_candidates(draft: TableDraft, root: int, branching: int, max_depth: int) -> dict[tuple[int, ...], float]:
    """Every node the top-k tree could contain, with its cumulative draft probability (brute force)."""
    scores: dict[tuple[int, ...], float] = {}
    level = {(root,): 1.0}
    for _ in range(max_depth):
        nxt = {}
        for path, score in level.items():
            probs = draft.logits_at(path).softmax(-1)
            values, tokens = probs.topk(branching)
            for q, t in zip(values.tolist(), tokens.tolist()):
                nxt[path + (t,)] = score * q
        scores.update(nxt)
        level = nxt
    return scores


# --------------------------------------------------------------------------
# TokenTree geometry
# --------------------------------------------------------------------------


def test_mask_positions_and_paths_of_a_grown_tree() -> None:
    tree = grow_tree(3, TableDraft(1), sampling=T1, generator=None, tree_budget=12, max_depth=4, branching=3)
    n = len(tree)
    mask = tree.attention_mask()
    depths = tree.depths
    for i in range(n):
        ancestors = {0, *tree.path_to(i)}
        assert {j for j in range(n) if mask[i, j]} == ancestors
        path = tree.path_to(i)
        assert len(path) == depths[i]
        assert all(tree.parents[b] == a for a, b in zip([0, *path], path))
        assert tree.parents[i] < i
    assert tree.positions(10).tolist() == [10 + d for d in depths]
    assert tree.depth == max(depths)


def test_chain_and_root_only_geometry() -> None:
    chain = TokenTree.chain(7, [1, 2, 3])
    assert chain.depth == 3 and chain.path_to(3) == [1, 2, 3]
    assert torch.equal(chain.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    root = TokenTree([7], [-1])
    assert root.depth == 0 and root.path_to(0) == [] and root.attention_mask().tolist() == [[True]]


# --------------------------------------------------------------------------
# mode="topk"
# --------------------------------------------------------------------------


@pytest.mark.parametrize("tree_budget, max_depth, branching",
                         [(1, 1, 1), (5, 2, 2), (16, 6, 4), (30, 3, 3), (40, 2, 3)])
def test_topk_respects_budget_depth_and_branching(tree_budget: int, max_depth: int, branching: int) -> None:
    draft = TableDraft(2)
    tree = grow_tree(0, draft, sampling=T1, generator=None, tree_budget=tree_budget, max_depth=max_depth,
                     branching=branching)
    capacity = sum(branching**d for d in range(1, max_depth + 1))
    assert len(tree) - 1 == min(tree_budget, capacity)
    assert tree.depth <= max_depth
    assert not tree.sampled and tree.proposer == ["root"] + ["draft"] * (len(tree) - 1)
    for u in range(len(tree)):
        kids = tree.children(u)
        assert len(kids) <= branching
        if kids:  # children are among the parent's top-`branching` draft tokens
            path = tuple(tree.tokens[j] for j in [0, *tree.path_to(u)])
            top = set(draft.logits_at(path).topk(branching).indices.tolist())
            assert {tree.tokens[c] for c in kids} <= top


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("tree_budget", [1, 4, 9, 20])
def test_topk_width_one_is_exact_best_first(seed: int, tree_budget: int) -> None:
    """width=1 yields the `tree_budget` candidates of largest cumulative probability (brute force)."""
    draft = TableDraft(seed)
    tree = grow_tree(4, draft, sampling=GREEDY, generator=None, tree_budget=tree_budget, max_depth=3, branching=3,
                     width=1)
    scores = all_candidates(draft, 4, branching=3, max_depth=3)
    best = set(sorted(scores, key=scores.get, reverse=True)[:tree_budget])
    assert node_paths(tree) == best


def reference_rounds(draft: TableDraft, root: int, tree_budget: int, max_depth: int, branching: int, width: int) -> set:
    """The round-based growth, restated on paths with plain sorting: each round admits the `width`
    best candidates whose parents were expanded in earlier rounds."""
    probs = {(root,): 1.0}
    tree: set[tuple[int, ...]] = set()
    expanded = [(root,)]
    frontier: dict[tuple[int, ...], float] = {}
    while expanded or frontier:
        for path in expanded:
            values, tokens = draft.logits_at(path).softmax(-1).topk(branching)
            for q, t in zip(values.tolist(), tokens.tolist()):
                frontier[path + (t,)] = probs[path] * q
        take = sorted(frontier, key=lambda p: (-frontier[p], len(p)))[: min(width, tree_budget - len(tree))]
        if not take:
            break
        for path in take:
            probs[path] = frontier.pop(path)
            tree.add(path)
        left = tree_budget - len(tree) > 0
        expanded = [p for p in take if len(p) - 1 < max_depth] if left else []
    return tree


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tree_budget, max_depth, width", [(8, 3, 2), (16, 6, None), (12, 2, 5), (10, 4, 10)])
def test_topk_rounds_admit_the_best_of_the_frontier(seed: int, tree_budget: int, max_depth: int,
                                                    width: int | None) -> None:
    draft = TableDraft(seed + 10)
    tree = grow_tree(1, draft, sampling=GREEDY, generator=None, tree_budget=tree_budget, max_depth=max_depth,
                     branching=3, width=width)
    w = width or math.ceil(tree_budget / max_depth)
    assert node_paths(tree) == reference_rounds(draft, 1, tree_budget, max_depth, 3, w)


def test_topk_batches_one_expand_per_round() -> None:
    draft = TableDraft(3)
    tree = grow_tree(0, draft, sampling=T1, generator=None, tree_budget=16, max_depth=6, branching=4)
    width = math.ceil(16 / 6)
    assert draft.calls[0] == [0]
    assert tree.draft_passes == len(draft.calls) <= 1 + math.ceil(16 / width)
    expanded = [n for call in draft.calls for n in call]
    assert len(expanded) == len(set(expanded))  # no node is run twice
    assert all(len(call) <= width for call in draft.calls)
    assert all(tree.depths[n] < 6 for n in expanded)
    # width=1 is best-first one node per pass; budget 0 never calls the draft.
    one = TableDraft(3)
    grow_tree(0, one, sampling=T1, generator=None, tree_budget=5, max_depth=6, branching=4, width=1)
    assert len(one.calls) == 5 and all(len(c) == 1 for c in one.calls)
    none = TableDraft(3)
    root_only = grow_tree(9, none, sampling=T1, generator=None, tree_budget=0)
    assert len(root_only) == 1 and root_only.tokens == [9] and none.calls == []


def test_topk_scores_with_temperature_one_softmax_when_greedy() -> None:
    greedy = grow_tree(2, TableDraft(5), sampling=GREEDY, generator=None, tree_budget=10, max_depth=3, branching=3)
    t1 = grow_tree(2, TableDraft(5), sampling=T1, generator=None, tree_budget=10, max_depth=3, branching=3)
    assert (greedy.tokens, greedy.parents) == (t1.tokens, t1.parents)


def test_topk_skips_tokens_the_draft_cannot_produce() -> None:
    """Under top-k sampling a token outside the draft's top-k has q = 0 and gets no slot."""
    tree = grow_tree(0, TableDraft(6), sampling=SamplingParams(temperature=1.0, top_k=2), generator=None,
                     tree_budget=20, max_depth=2, branching=4)
    assert len(tree) - 1 == 2 + 4
    assert all(len(tree.children(u)) <= 2 for u in range(len(tree)))


def test_topk_branching_per_depth() -> None:
    tree = grow_tree(0, TableDraft(7), sampling=T1, generator=None, tree_budget=50, max_depth=5, branching=[3, 2])
    assert tree.depth == 2 and len(tree) - 1 == 3 + 6


# --------------------------------------------------------------------------
# mode="sampled"
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "branching, tree_budget, max_depth",
    [([3, 2, 1], 16, 6), ([2, 2, 2], 6, 6), ([1, 1, 1], 16, 6), (2, 16, 3), ([4, 3], 10, 1)],
)
def test_sampled_shape_is_fixed_in_advance(branching: int | list[int], tree_budget: int, max_depth: int) -> None:
    """Whatever is drawn, the shape (parents) is the same: it depends on the parameters alone."""
    shapes = set()
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        draft = TableDraft(seed, scale=1.0)  # a different draft each time: full support, varying draws
        tree = grow_tree(0, draft, sampling=T1, generator=gen, mode="sampled", tree_budget=tree_budget,
                         max_depth=max_depth, branching=branching)
        shapes.add(tuple(tree.parents))
        assert tree.sampled
        for u in range(len(tree)):
            kids = tree.children(u)
            assert (u in tree.child_q) == bool(kids)
            assert len({tree.tokens[c] for c in kids}) == len(kids)  # without replacement
            assert all(tree.child_q[u][tree.tokens[c]] > 0 for c in kids)
        assert tree.draft_passes == len(draft.calls) == tree.depth  # one pass per level
    assert len(shapes) == 1
    bs = [branching] * max_depth if isinstance(branching, int) else branching[:max_depth]
    template = _sampled_template(tree_budget, bs)
    assert len(tree) == len(template)


def test_sampled_template_truncates_breadth_first() -> None:
    # 3 children, then 2 each (6), budget 10 leaves 1 for the first depth-2 node.
    t = _sampled_template(10, [3, 2, 1])
    assert len(t) == 11
    assert [len(c) for c in t] == [3, 2, 2, 2, 1, 0, 0, 0, 0, 0, 0]


def test_sampled_draws_only_the_support() -> None:
    tree = grow_tree(0, TableDraft(1), sampling=SamplingParams(temperature=1.0, top_k=2), generator=None,
                     mode="sampled", branching=[4, 3])
    assert len(tree.children(0)) == 2
    assert all(len(tree.children(c)) == 2 for c in tree.children(0))


def test_sampled_children_are_draws_without_replacement() -> None:
    """The first two children are distributed as q(a) q(b) / (1 - q(a)) (chi-square, fixed seed)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    q = logits.softmax(-1).double()
    gen = torch.Generator().manual_seed(0)
    n = 6000
    counts: Counter = Counter()
    for _ in range(n):
        tree = grow_tree(0, lambda t, nodes: logits.expand(len(nodes), -1), sampling=T1, generator=gen,
                         mode="sampled", branching=[2])
        counts[tuple(tree.tokens[1:])] += 1
    stat = 0.0
    for a, b in product(range(V), repeat=2):
        if a != b:
            expected = n * float(q[a] * q[b] / (1 - q[a]))
            stat += (counts[(a, b)] - expected) ** 2 / expected
    df = V * (V - 1) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    assert pvalue > 1e-3


def test_sampled_is_reproducible_with_a_seed() -> None:
    def grow(seed: int) -> TokenTree:
        return grow_tree(0, TableDraft(2), sampling=T1, generator=torch.Generator().manual_seed(seed),
                         mode="sampled", branching=[3, 2])

    assert grow(1).tokens == grow(1).tokens
    assert any(grow(1).tokens != grow(s).tokens for s in range(2, 6))


def test_bad_arguments() -> None:
    with pytest.raises(StagedSpecError, match="temperature"):
        grow_tree(0, TableDraft(), sampling=GREEDY, generator=None, mode="sampled")
    with pytest.raises(StagedSpecError, match="mode"):
        grow_tree(0, TableDraft(), sampling=T1, generator=None, mode="beam")
    with pytest.raises(StagedSpecError):
        grow_tree(0, TableDraft(), sampling=T1, generator=None, tree_budget=-1)
    with pytest.raises(StagedSpecError):
        grow_tree(0, TableDraft(), sampling=T1, generator=None, width=0)
    with pytest.raises(ValueError, match="shape"):
        grow_tree(0, lambda t, nodes: torch.zeros(len(nodes) + 1, V), sampling=T1, generator=None)
