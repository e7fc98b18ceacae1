"""A draft tree grown level by level on the draft's device, with one copy back at the end.

`tree.grow_tree` grows best-first on the host: after every draft pass it
brings the top-k tokens back to choose what to expand next.  On a GPU each
such copy waits for the pass and for everything queued before it, so a
depth-6 tree costs six round trips.  (On an H100 this growth ran level with
best-first: there the draft's own passes, not the round trips, bound drafting;
docs/measurements.md, "Tree growth level by level against best-first on an H100".)

Here the choices stay on the device (EAGLE-2's dynamic tree, in fixed
shapes): level d's `width` best candidates by cumulative draft probability
are expanded in one draft pass, each proposes its `branching` best tokens,
and after `max_depth` levels the `tree_budget` best candidates of all levels are
kept.  Every shape is fixed by (tree_budget, depth, width, branching), every
index is a device tensor, and the host reads the tree once.

Why the kept nodes form a tree.  A candidate's score is its parent's plus a
log probability (<= 0), minus a tie-break that grows with depth, so every
candidate scores strictly below its parent; the `tree_budget` best therefore
include each kept node's parent.  A candidate exists only when its parent
was expanded, so every kept node's draft pass ran.

Exactness does not depend on any of this: like `grow_tree(mode="topk")` the
tree is a deterministic function of the drafts, and verification treats each
child as a one-hot proposal (`stagedspec.verification`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams, probs_from_logits
from stagedspec.tree import TokenTree

# run_level(tokens [w] on the device, depth d >= 1, tree_mask [w, used + w] bool on the device) -> logits [w, V]:
# one draft pass over level d's expanded nodes, each seeing the context, the earlier levels' slots flagged in
# its mask row, and itself (the last w columns); their entries stay cached until the tree is done.
RunLevel = Callable[[Tensor, int, Tensor], Tensor]

_DEPTH_TIE_BREAK = 1e-9  # per level, in log probability (float64): a child never ties its parent


def grow_levels(
    root_token: int,
    root_logits: Tensor,
    run_level: RunLevel,
    *,
    sampling: SamplingParams,
    tree_budget: int,
    max_depth: int,
    width: int,
    branching: int,
    proposer: str = "draft",
) -> TokenTree:
    """Grow a tree of up to `tree_budget` nodes and `max_depth` levels below `root_token` (see the module docstring).

    `root_logits` [1, V]: the draft's prediction after the root.  Scores are
    log probabilities under the draft's softmax at temperature 1 when greedy,
    else under `probs_from_logits(logits, sampling)`, as in `grow_tree`; a
    token of probability 0 is never kept.  The tree comes back in pre-order
    with `scores` (cumulative probabilities) and `draft_passes` set.
    """
    if tree_budget < 0 or max_depth < 0 or width < 1 or branching < 1:
        raise StagedSpecError(f"level growth needs tree budget, depth >= 0 and width, branching >= 1; got "
                              f"{tree_budget}, {max_depth}, {width}, {branching}")
    tree = TokenTree([root_token], [-1])
    if tree_budget == 0 or max_depth == 0:
        tree.scores = [1.0]
        return tree
    device = root_logits.device
    k = min(branching, root_logits.shape[-1])
    values, tokens = _log_probs(root_logits, sampling).topk(k, dim=-1)
    scores = [values.reshape(-1).double() - _DEPTH_TIE_BREAK]  # per level: candidates' cumulative log prob
    level_tokens = [tokens.reshape(-1)]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]  # global candidate index; -1: the root
    first = [0]  # global index of each level's first candidate
    ancestors = torch.zeros(0, 0, dtype=torch.bool, device=device)  # the last pass's mask rows
    for depth in range(1, max_depth):
        w = min(width, scores[-1].shape[0])
        best, rows = scores[-1].topk(w)
        # Each expanded candidate sees its parent's ancestors (the parent's row of the last pass's mask: the
        # last pass expanded its parents in order, k candidates each) and itself.
        seen = ancestors[torch.div(rows, k, rounding_mode="floor")] if depth > 1 else ancestors.new_zeros(w, 0)
        mask = torch.cat([seen, torch.eye(w, dtype=torch.bool, device=device)], dim=1)
        logits = run_level(level_tokens[-1][rows], depth, mask)
        tree.draft_passes += 1
        ancestors = mask
        values, tokens = _log_probs(logits, sampling).topk(k, dim=-1)  # [w, k]
        first.append(first[-1] + scores[-1].shape[0])
        scores.append((best[:, None] + values.double() - _DEPTH_TIE_BREAK * (depth + 1)).reshape(-1))
        level_tokens.append(tokens.reshape(-1))
        parents.append((first[-2] + rows)[:, None].expand(w, k).reshape(-1))
    tree.draft_passes += 1  # the root's prediction (the catch-up pass that made it)
    every_score, every_token, every_parent = torch.cat(scores), torch.cat(level_tokens), torch.cat(parents)
    n = min(tree_budget, every_score.shape[0])
    kept = every_score.topk(n).indices.sort().values  # level order: parents before children
    packed = torch.stack([kept.double(), every_token[kept].double(), every_parent[kept].double(),
                          every_score[kept]]).cpu()  # the one copy back; ids < 2^53 are exact in float64
    node_of = {-1: 0}
    tree.scores = [1.0]
    for index, token, parent, score in zip(*(row.tolist() for row in packed)):
        if score == float("-inf") or int(parent) not in node_of:
            continue  # probability 0 under the sampling filters (and so are its descendants)
        node_of[int(index)] = tree.add(node_of[int(parent)], int(token), proposer)
        tree.scores[-1] = math.exp(score)
    return tree.depth_first()


def _log_probs(logits: Tensor, sampling: SamplingParams) -> Tensor:
    if sampling.greedy:
        return logits.float().log_softmax(-1)
    return probs_from_logits(logits, sampling).log()
