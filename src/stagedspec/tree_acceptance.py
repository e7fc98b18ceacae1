"""A draft's tree, grown at every position of the oracle's reply, scored against that reply.

Why: the mean accepted length a decoding run reports comes from a few
prompts, and the positions where its steps start depend on what was
accepted before, so two drafts (or two tree shapes) are compared on
different positions and the figure moves by several percent between runs.
Growing the tree after *every* true prefix of the oracle's greedy reply
measures each draft on the same positions, about fifty times as many trees
for 20 prompts, without running the oracle again.

In greedy decoding the oracle accepts the longest tree path that spells its
own continuation, so that is the accepted length here (up to bf16 near-ties
between a verification pass and one-token decoding).  The tree is the one
`ModelDrafter` grows in decoding (best-first, or level by level as on
CUDA; the same tree budget, depth, branching and width), so tree shapes can be
compared with it too.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from stagedspec.drafters.model import ModelDrafter
from stagedspec.models.feature_draft import is_feature_draft
from stagedspec.models.transformer import Transformer
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree


def matched_depth(tree: TokenTree, continuation: Sequence[int]) -> int:
    """How many tokens of `continuation` the tree spells from its root (the accepted draft tokens)."""
    kids = tree.children_lists()
    node, depth = 0, 0
    while depth < len(continuation):
        node = next((c for c in kids[node] if tree.tokens[c] == continuation[depth]), -1)
        if node < 0:
            break
        depth += 1
    return depth


@torch.inference_mode()
def tree_acceptance_everywhere(draft: Transformer, prompt_streams: Sequence[Sequence[int]],
                               continuations: Sequence[Sequence[int]], *, tree_budget: int, max_depth: int,
                               branching: int, growth: str = "best-first") -> dict[str, Any] | None:
    """Mean accepted length (1 + matched draft tokens) of greedy trees grown after every reply prefix.

    `growth` is `ModelDrafter`'s: "best-first", "levels" (static passes only) or "auto" (what decoding on the
    draft's device uses).
    Returns {"trees", "mean_accepted_length", "depth_reach", "draft_passes_per_tree", "growth"}, where
    depth_reach[d - 1] is the share of trees whose accepted path reaches depth d; None for a
    feature draft, whose trees need the oracle's hidden states from a decoding run.
    """
    if is_feature_draft(draft):
        return None
    drafter = ModelDrafter(draft, tree_budget=tree_budget, max_depth=max_depth, branching=branching,
                           max_len=max((len(p) + len(c) for p, c in zip(prompt_streams, continuations)), default=1) + 1,
                           growth=growth)
    greedy = SamplingParams()
    matched: list[int] = []
    passes = 0
    for prompt, cont in zip(prompt_streams, continuations):
        prompt, cont = list(prompt), list(cont)
        drafter.begin(prompt)
        for i in range(len(cont)):  # the tree after prompt + cont[:i] proposes cont[i:]
            tree = drafter.propose(prompt + cont[:i], greedy, None, len(cont) - i)
            matched.append(matched_depth(tree, cont[i:]))
            passes += tree.draft_passes
    n = len(matched)
    deepest = max([max_depth, *matched]) if matched else max_depth
    return {"trees": n,
            "mean_accepted_length": 1.0 + sum(matched) / n if n else 0.0,
            "depth_reach": [sum(m >= d for m in matched) / n if n else 0.0 for d in range(1, deepest + 1)],
            "draft_passes_per_tree": passes / n if n else 0.0, "growth": drafter.growth}
