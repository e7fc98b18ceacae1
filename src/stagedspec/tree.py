"""Token trees: the speculative batch the oracle verifies in one forward pass.

Node 0 is the root: the last committed token, which the oracle has not run
yet.  Every other node is a proposed token whose parent has a smaller index.
A node's position is the root's position plus its depth, and it attends only
to its ancestors (and itself).

`grow_tree` builds a tree from any draft distribution, in rounds of batched
draft forward passes: deterministically (best-first by cumulative draft
probability, the staged-speculation tree) or by sampling without replacement
(the only kind of multi-branch tree that keeps *sampled* decoding exact with
min(1, p/q) acceptance).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams, probs_from_logits


@dataclass
class TokenTree:
    """A tree of proposed tokens and the draft distributions they came from.

    - `tokens[i]`, `parents[i]` (`parents[0] == -1`, `parents[i] < i`).
    - `sampled=False`: children are deterministic proposals (e.g. the draft's
      top-k); for verification each is a one-hot q.
    - `sampled=True`: the children of node u are successive draws *without
      replacement* from `child_q[u]` (float32 [V]), in increasing node index,
      except the nodes listed in `fixed`: deterministic proposals (prompt
      lookup, say) merged into a sampled tree.  The verifier tries a node's
      drawn children first and its fixed ones after them, which keeps it
      exact even when which fixed children exist depends on the draws.
    """

    tokens: list[int]
    parents: list[int]
    sampled: bool = False
    child_q: dict[int, Tensor] = field(default_factory=dict)
    fixed: set[int] = field(default_factory=set)  # deterministic nodes of a sampled tree
    proposer: list[str] = field(default_factory=list)  # which stage proposed each node (telemetry)
    draft_passes: int = 0  # `expand` calls `grow_tree` made to build it (telemetry)
    scores: list[float] = field(default_factory=list)  # cumulative draft probability per node (best-first trees)

    def __post_init__(self) -> None:
        if not self.proposer:
            self.proposer = ["root"] + ["draft"] * (len(self.tokens) - 1)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, root: int, tokens: list[int], **kw) -> "TokenTree":  # noqa: ANN003
        return cls([root, *tokens], list(range(-1, len(tokens))), **kw)

    def add(self, parent: int, token: int, proposer: str = "draft", fixed: bool = False) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.proposer.append(proposer)
        if self.scores:
            self.scores.append(0.0)  # a node added to a scored tree has no draft score
        if fixed and self.sampled:
            self.fixed.add(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def merge_fixed(self, other: "TokenTree") -> None:
        """Add `other`'s proposals (deterministic ones, same root) as fixed nodes, sharing common prefixes.

        A path of `other` follows any existing node with the same token (drawn
        or fixed), so no token appears twice among a node's children.
        """
        if other.sampled and not other.fixed.issuperset(range(1, len(other))):
            raise StagedSpecError("only deterministic proposals can be merged into a tree")
        mapped = [0]
        for i in range(1, len(other)):
            parent, tok = mapped[other.parents[i]], other.tokens[i]
            twin = self.child_with(parent, tok)
            mapped.append(twin if twin is not None else self.add(parent, tok, other.proposer[i], fixed=True))

    @property
    def depths(self) -> list[int]:
        d = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path (0 for a root-only tree)."""
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.tokens)) if self.parents[i] == node]

    def children_lists(self) -> list[list[int]]:
        """Every node's children in index order, in one pass (what tree walks need)."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return kids

    def child_with(self, parent: int, token: int) -> int | None:
        """The child of `parent` carrying `token`, if there is one."""
        return next((c for c in range(parent + 1, len(self.tokens))
                     if self.parents[c] == parent and self.tokens[c] == token), None)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to `node` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def depth_first(self) -> "TokenTree":
        """The same tree re-indexed in pre-order (each node's children in their current order).

        The oracle's KV slots follow node indices, and CPU attention kernels
        round by slot: a path whose nodes sit in consecutive slots gets
        logits bit-identical to one-token decoding.  In pre-order the first
        child of every node is the next node, so the first-child path (the
        draft's favourite) is such a path.  Sibling order, and so the draw
        order of sampled children, is kept.
        """
        kids = self.children_lists()
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(kids[node]))
        new_index = {old: new for new, old in enumerate(order)}
        return TokenTree(
            tokens=[self.tokens[o] for o in order],
            parents=[-1] + [new_index[self.parents[o]] for o in order[1:]],
            sampled=self.sampled,
            child_q={new_index[k]: v for k, v in self.child_q.items()},
            fixed={new_index[i] for i in self.fixed},
            proposer=[self.proposer[o] for o in order],
            draft_passes=self.draft_passes,
            scores=[self.scores[o] for o in order] if self.scores else [],
        )

    def best_prefix(self, n: int) -> "TokenTree":
        """The root and the `n` highest-scoring nodes (a deterministic tree with `scores`), in pre-order.

        A child's score is its parent's times a probability, so it never
        exceeds its parent's: the kept nodes always include their ancestors
        (ties go to the shallower node).
        """
        if self.sampled or len(self.scores) != len(self.tokens):
            raise StagedSpecError("only a deterministic tree with node scores can be cut to its best nodes")
        if n >= len(self.tokens) - 1:
            return self
        depth = self.depths
        keep = sorted(range(1, len(self.tokens)), key=lambda i: (-self.scores[i], depth[i], i))[:n]
        kept = [0, *sorted(keep)]
        index = {old: new for new, old in enumerate(kept)}
        cut = TokenTree(
            tokens=[self.tokens[i] for i in kept],
            parents=[-1] + [index[self.parents[i]] for i in kept[1:]],
            proposer=[self.proposer[i] for i in kept],
            draft_passes=self.draft_passes,
            scores=[self.scores[i] for i in kept],
        )
        return cut.depth_first()

    def first_nodes(self, n: int) -> "TokenTree":
        """The root and the first `n` nodes in index order (every node's parent precedes it, so the
        kept nodes always include their ancestors); node order, sibling (draw) order and `child_q` are kept.

        Why index order: for any tree the drafters here build, a node's index is fixed by the nodes before
        it, never by its own token, its subtree or its later siblings, which is what keeps a cut sampled
        tree exact (the proof is in `stagedspec.server.pressure`, the cut's one user).
        """
        if n >= len(self.tokens) - 1:
            return self
        kept = range(n + 1)
        return TokenTree(
            tokens=self.tokens[: n + 1],
            parents=self.parents[: n + 1],
            sampled=self.sampled,
            child_q={k: v for k, v in self.child_q.items() if k in kept},
            fixed={i for i in self.fixed if i in kept},
            proposer=self.proposer[: n + 1],
            draft_passes=self.draft_passes,
            scores=self.scores[: n + 1],
        )

    def attention_mask(self, device: torch.device | str = "cpu") -> Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]
        return mask.to(device)

    def positions(self, root_position: int, device: torch.device | str = "cpu") -> Tensor:
        return torch.tensor(self.depths, dtype=torch.long, device=device) + root_position


# --------------------------------------------------------------------------
# Growing trees from a draft model
# --------------------------------------------------------------------------

Expand = Callable[[TokenTree, list[int]], Tensor]
"""`expand(tree, nodes)` -> draft logits [len(nodes), V]: the distribution of each node's children.

One call is one draft forward pass over the listed nodes (all already in
`tree`), so `grow_tree` batches every node it wants expanded in a round.
"""


def grow_tree(
    root_token: int,
    expand: Expand,
    *,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    mode: str = "topk",
    tree_budget: int = 16,
    max_depth: int = 6,
    branching: int | list[int] = 4,
    width: int | None = None,
    proposer: str = "draft",
) -> TokenTree:
    """Grow a token tree rooted at `root_token` by calling the draft `expand` in rounds.

    The tree comes back in pre-order (`TokenTree.depth_first`).
    `tree_budget` counts proposed nodes (the root excluded); `max_depth` bounds
    path length; `branching` is the number of children a node may get (an int,
    or a list indexed by the parent's depth; depths past its end get none).

    mode="topk" (deterministic; greedy or sampling): best-first by cumulative
        draft probability (the product of draft probabilities along the path),
        a node's candidate children being its top-`branching` draft tokens.
        Each round admits the `width` best candidates of the frontier and
        expands (in one `expand` call) those that may still get children.
        `width=1` is exact best-first (the `tree_budget` highest-scoring nodes); a
        larger width trades a little of that for fewer draft passes (default
        ceil(tree_budget / max_depth): about one pass per level of a full-depth
        path).  Scores use the draft softmax at temperature 1 when greedy, else
        `probs_from_logits(logits, sampling)`.  Verification treats every child
        as a one-hot proposal, so any deterministic rule is exact.
    mode="sampled" (sampling only): see `_grow_sampled`; the children of a node
        are draws without replacement from its draft distribution, and how
        many there are is fixed in advance by (`branching`, `max_depth`,
        `tree_budget`) alone.
    """
    if mode not in ("topk", "sampled"):
        raise StagedSpecError(f"unknown tree mode {mode!r}: expected 'topk' or 'sampled'")
    if tree_budget < 0 or max_depth < 0:
        raise StagedSpecError(f"tree budget and depth must be >= 0, got {tree_budget} and {max_depth}")
    if isinstance(branching, int):
        branching = [branching] * max_depth
    branching = list(branching)[:max_depth]
    if any(b < 0 for b in branching):
        raise StagedSpecError(f"branching must be >= 0, got {branching}")
    if width is not None and width < 1:
        raise StagedSpecError(f"tree width must be >= 1, got {width}")
    tree = TokenTree([root_token], [-1])
    if mode == "sampled":
        if sampling.greedy:
            raise StagedSpecError("sampled trees need temperature > 0; use mode='topk' for greedy decoding")
        return _grow_sampled(tree, expand, sampling, generator, tree_budget, branching, proposer).depth_first()
    width = width or max(1, math.ceil(tree_budget / max(1, max_depth)))
    return _grow_topk(tree, expand, sampling, tree_budget, branching, width, proposer).depth_first()


def _expand_checked(tree: TokenTree, expand: Expand, nodes: list[int]) -> Tensor:
    logits = expand(tree, nodes)
    tree.draft_passes += 1
    if logits.dim() != 2 or logits.shape[0] != len(nodes):
        raise ValueError(f"expand returned logits of shape {tuple(logits.shape)} for {len(nodes)} nodes")
    return logits


def _grow_topk(
    tree: TokenTree,
    expand: Expand,
    sampling: SamplingParams,
    tree_budget: int,
    branching: list[int],
    width: int,
    proposer: str,
) -> TokenTree:
    """Best-first growth in rounds of `width` admissions (see `grow_tree`)."""
    depth = [0]
    score = [1.0]  # cumulative draft probability of each node
    # Candidates: (-score, depth, arrival, parent, token); ties favour shallow, then early.
    frontier: list[tuple[float, int, int, int, int]] = []
    arrivals = 0

    def can_have_children(node: int) -> bool:
        return depth[node] < len(branching) and branching[depth[node]] > 0

    to_expand = [0] if tree_budget > 0 and can_have_children(0) else []
    while to_expand or frontier:
        if to_expand:
            logits = _expand_checked(tree, expand, to_expand)
            if sampling.greedy:
                probs = logits.float().softmax(-1)
            else:
                probs = probs_from_logits(logits, sampling)
            most = max(branching[depth[node]] for node in to_expand)
            values, tokens = _on_host(*probs.topk(min(most, probs.shape[-1]), dim=-1))
            for node, vals, toks in zip(to_expand, values.tolist(), tokens.tolist()):
                k = branching[depth[node]]
                for q, tok in zip(vals[:k], toks[:k]):
                    if q > 0:  # a token the draft cannot produce is never worth a slot
                        heapq.heappush(frontier, (-score[node] * q, depth[node] + 1, arrivals, node, tok))
                        arrivals += 1
        quota = min(width, tree_budget - (len(tree) - 1))
        if quota <= 0:
            break
        admitted = []
        while frontier and len(admitted) < quota:
            neg_score, d, _, parent, tok = heapq.heappop(frontier)
            admitted.append(tree.add(parent, tok, proposer))
            depth.append(d)
            score.append(-neg_score)
        budget_left = tree_budget - (len(tree) - 1) > 0
        to_expand = [n for n in admitted if can_have_children(n)] if budget_left else []
    tree.scores = score
    return tree


def _grow_sampled(
    tree: TokenTree,
    expand: Expand,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    tree_budget: int,
    branching: list[int],
    proposer: str,
) -> TokenTree:
    """Level by level: each node's children are Gumbel-top-k draws from q = probs_from_logits(draft).

    Why the shape must not depend on the draws.  The verifier accepts the
    i-th child x of u with probability min(1, p(x)/q_i(x)), where q_i is q_u
    with the i-1 earlier siblings removed; this reproduces p exactly *because*
    x really is a draw from q_i.  That holds when the number of children is
    decided before they are drawn.  A rule that looks at the drawn values —
    keep drawing while the draws are likely, keep the candidates with the
    highest cumulative probability under a node budget, give a likely first
    child a second sibling — selects the draws, and the kept children are no
    longer distributed as q_i: e.g. "a second child only if the first draw was
    token a" makes the first child of a two-child node always a, and the
    acceptance rule then over- or under-emits a.  So the shape here is a fixed
    template computed from (`branching`, max depth, `tree_budget`) alone, filled
    breadth-first, parents in node order; the only deviation is that a node
    whose q has fewer nonzero tokens than its planned children gets only those
    (which depends on the path to it, never on the children drawn).

    `child_q[u]` keeps q_u, which the verifier needs.  Gumbel-top-k (the
    indices of the k largest log q + Gumbel noise, in decreasing order) yields
    k successive draws without replacement, in draw order, in one pass.
    """
    tree.sampled = True
    template = _sampled_template(tree_budget, branching)  # planned child counts per template node
    level = [(0, 0)]  # (tree node, template node) pairs of the current depth
    while level:
        parents = [(node, t) for node, t in level if template[t]]
        if not parents:
            break
        logits = _expand_checked(tree, expand, [node for node, _ in parents])
        q = probs_from_logits(logits, sampling)
        most = max(len(template[t]) for _, t in parents)
        order, support = _gumbel_top_k(q, most, generator)
        next_level = []
        for i, (node, t) in enumerate(parents):
            planned = template[t]
            tree.child_q[node] = q[i]
            for tok, child_t in zip(order[i][: min(len(planned), support[i])], planned):
                next_level.append((tree.add(node, tok, proposer), child_t))
        level = next_level
    return tree


def _on_host(values: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Top-k values (as float64) and their token ids on the CPU, in one device-to-host copy."""
    if values.device.type == "cpu":
        return values.double(), tokens
    both = torch.stack([values.double(), tokens.double()]).cpu()  # ids < 2^53: exact in float64
    return both[0], both[1].long()


def _gumbel_top_k(q: Tensor, k: int, generator: torch.Generator | None) -> tuple[list[list[int]], list[int]]:
    """Per row of q [n, V]: up to k draws without replacement, in draw order, and the support size.

    The indices of the k largest log q + Gumbel(0, 1) noise (Gumbel =
    -log Exp(1); -inf where q == 0).  Tokens without mass can never be drawn,
    so when top-k or top-p narrowed q, the noise is drawn for the support
    alone (found on q's device, brought back in one copy): 50 values instead
    of a whole vocabulary drawn on the CPU per row.
    """
    width = int((q > 0).sum(-1).max())
    if width >= q.shape[-1]:
        keys = q.log() - _exponential_noise(q, generator).log()
        order = keys.topk(min(k, q.shape[-1]), dim=-1).indices
        rows = torch.cat([order, (q > 0).sum(-1, keepdim=True)], -1).tolist()  # one copy: draws, then support
        return [r[:-1] for r in rows], [r[-1] for r in rows]
    values, tokens = _on_host(*q.topk(width, dim=-1))  # every token with mass; narrower rows end in zeros
    keys = values.log() - _exponential_noise(values, generator).log()
    picks = keys.topk(min(k, width), dim=-1).indices
    return tokens.gather(-1, picks).tolist(), (values > 0).sum(-1).tolist()


def _exponential_noise(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Exp(1) noise shaped like `like`, drawn on the generator's device (the loop's generator is a
    CPU one even when the draft runs on a GPU), floored above 0 so that its log is finite."""
    device = generator.device if generator is not None else like.device
    noise = torch.empty(like.shape, dtype=torch.float32, device=device).exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny).to(like.device)


def _sampled_template(tree_budget: int, branching: list[int]) -> list[list[int]]:
    """The planned tree: `template[t]` lists template node t's children (breadth-first indices).

    Nodes at depth d get `branching[d]` children each, in order, until the
    budget runs out; it depends on nothing else.
    """
    template: list[list[int]] = [[]]
    level, left = [0], tree_budget
    for b in branching:
        next_level = []
        for t in level:
            for _ in range(min(b, left)):
                template.append([])
                template[t].append(len(template) - 1)
                next_level.append(len(template) - 1)
                left -= 1
        level = next_level
        if not level or left == 0:
            break
    return template
