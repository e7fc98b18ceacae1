"""Memory pressure: running requests' tree budgets shrink, in steps, before a request is kept waiting.

With batched passes every running request's tree rows share one pass, so the
pass's activations (the memory model's tree scratch) grow with the number of
requests and their tree sizes.  Each request therefore has a *shrink level*:
level 0 is its full tree (`SpeculationConfig.max_tree_budget` nodes), each level
halves the node cap (full, 1/2, 1/4, ...) and the last level, where the cap
reaches 0, is root-only (no speculation: one row a step).  The memory model
prices every level (`MemoryModel.tree_scratch`).  When a waiting request's KV
cache would fit but the tree rows of everyone would not, the scheduler gives
the newcomer the largest tree that fits; if not even its root-only pass fits,
running requests shrink one level at a time, newest first, until it does.
As memory frees, requests grow back a level at a time, oldest first.  A
running request is never paused or evicted: it keeps decoding, only with
smaller trees.

How a cap is applied (`CappedDrafter`): it works for every drafter the server
builds, because it acts on the proposed tree.  Root-only skips the drafter.
`auto` is told the cap and only picks arms whose trees fit it (so what it
learns is not skewed by cut trees).  Any tree still over the cap is cut
(`cut_tree`): a best-first tree with node scores to its best nodes (as the
adaptive budget does), any other to its first nodes in index order.

Exactness.  The cap is server state, fixed before the step and untouched by
the step's oracle pass, which is the rule trees live by
(`stagedspec.verification`).  Greedy: whatever is cut, verification follows
the oracle's argmax, so the tokens are unchanged.  Deterministic trees under
sampling: the deterministic rule reproduces the oracle's p for any set of
fixed proposals chosen without the oracle's result, and the cut is such a
choice.  Sampled trees need more, because the sampled rule is exact only if
each drawn child is a draw from q_i given what came before it:

  Claim.  At a node u with drawn children x_1, x_2, ... (successive draws
  without replacement: x_i ~ q_i), keep x_i or not by a rule that may read
  the path to u, x_1..x_{i-1} and randomness independent of x_i given those,
  but not x_i, its subtree or later siblings.  Verifying the kept children
  emits a token ~ p.
  Proof, by induction from the last kept child back to the first.  Given the
  path, x_1..x_{i-1} and their rejections, the target is r_{i-1} (the
  residual after i-1 rejections; r_0 = p), and x_i is still ~ q_i: the
  rejections read x_1..x_{i-1} and the verifier's own uniforms, and the keep
  decision is independent of x_i.  If x_i is not kept (nor, then, any later
  sibling: see below), the verifier draws from r_{i-1}.  If it is kept, it is
  accepted with min(1, r_{i-1}(x_i)/q_i(x_i)), and given a rejection the rest
  emits ~ r_i by induction, which is the speculative-sampling step: the token
  is ~ r_{i-1}.  At i = 1 that is p.  On acceptance the walk moves to x_i and
  uses the oracle's row there, and the same argument holds in x_i's subtree.

  The cut keeps the nodes of index <= cap.  Siblings' indices grow in draw
  order (`TokenTree`), so the kept drawn children of u are its first m draws,
  and x_i is kept iff its index is <= cap.  Its index is the number of nodes
  before it, which in every sampled tree the drafters build is fixed before
  x_i is: in pre-order (`grow_tree` ends with `depth_first`) those nodes are
  x_i's ancestors, the earlier siblings of x_i and of each ancestor, and their
  subtrees; an earlier sibling's subtree is drawn after x_i, but from fresh
  noise given that sibling, so it is independent of x_i given x_1..x_{i-1}
  (in `_grow_sampled` a subtree's size is fixed by its path: template and
  support).  In spine order (`StageDrafter`: at each position the spine
  token, then the alternatives at the same parent) the counts before a node
  are fixed by (k, branching) and the support of q along the spine, i.e. by
  its path.  Fixed nodes merged in (`MergedDrafter`) follow every drawn node
  and the deterministic rule, exact for any fixed set whatever it depends on.
  So every kept sampled tree satisfies the claim, whatever the cap.

`tests/test_distribution_exactness.py` checks cut sampled and mixed trees
under a cap that moves with history.  Seed for seed, a sampled request whose
tree was shrunk draws differently from its solo run (its draws are spent on
other proposals), so seeded equality with the solo run holds only for
requests that were never shrunk; the distribution holds always.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch

from stagedspec.drafters.base import Drafter
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree


def root_only_level(max_tree_budget: int) -> int:
    """The last shrink level: the one whose halved cap reaches 0 (no speculation)."""
    return max(1, max_tree_budget.bit_length())


def tree_budget_cap(max_tree_budget: int, level: int) -> int | None:
    """Most proposed nodes at shrink `level`: None (no cap) at 0, else `max_tree_budget` halved `level` times."""
    return None if level <= 0 else max_tree_budget >> level


def level_tree_budget(max_tree_budget: int, level: int) -> int:
    """The tree nodes the memory model charges at `level` (the cap, or the full tree)."""
    cap = tree_budget_cap(max_tree_budget, level)
    return max_tree_budget if cap is None else min(cap, max_tree_budget)


def cut_tree(tree: TokenTree, cap: int) -> TokenTree:
    """`tree` with at most `cap` proposed nodes: its best ones when it is a scored best-first tree, else its
    first ones in index order (exact for sampled trees: see the module docstring)."""
    if len(tree) - 1 <= cap:
        return tree
    if not tree.sampled and len(tree.scores) == len(tree.tokens):
        return tree.best_prefix(cap)
    return tree.first_nodes(cap)


class CappedDrafter(Drafter):
    """A request's drafter whose trees the scheduler caps by shrink level (see the module docstring)."""

    def __init__(self, inner: Drafter, max_tree_budget: int, level: int = 0) -> None:
        self.inner = inner
        self.max_tree_budget = max_tree_budget
        self.floor = root_only_level(max_tree_budget)
        self.level = level
        self.level_steps: Counter[int] = Counter()  # steps proposed at each level
        self._proposed = False

    @property
    def cap(self) -> int | None:
        return tree_budget_cap(self.max_tree_budget, self.level)

    @property
    def skipped_steps(self) -> int:
        """Steps proposed root-only (speculation off) for memory."""
        return self.level_steps[self.floor]

    @property
    def forward_passes(self) -> int:
        return self.inner.forward_passes

    def attach_oracle(self, oracle: Any) -> None:
        """Passed on: a feature draft reads the oracle's hidden states (without it, it would read none)."""
        self.inner.attach_oracle(oracle)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.inner.begin(prompt_ids)

    def propose(self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None,
                max_tokens: int) -> TokenTree:
        cap = self.cap  # read once: the scheduler changes levels only between rounds
        self.level_steps[self.level] += 1
        self._proposed = cap != 0
        if cap == 0:
            return TokenTree([context[-1]], [-1])
        self.inner.tree_budget_cap = cap  # `auto` picks only arms whose trees fit; the others' trees are cut below
        tree = self.inner.propose(context, sampling, generator, max_tokens)
        return tree if cap is None else cut_tree(tree, cap)

    def verified(self, seconds: float, first_accept: float | None = None) -> None:
        """Only a step the inner drafter proposed tells it what verifying cost."""
        if self._proposed:
            self.inner.verified(seconds, first_accept)
