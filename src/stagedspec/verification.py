"""Verifying a token tree against the oracle: which proposals survive, and the oracle's next token.

The oracle scored every node of the tree in one pass: row u of its logits is
its next-token distribution after the path to u.  Verification walks from the
root, at each node deciding among its children with one oracle decision, and
emits the accepted path plus one token of the oracle's own (the correction
when everything at a node is rejected, the bonus token at a leaf).

Greedy (temperature 0).  At u the oracle's token is t = argmax(row u).  If a
child carries t we move there, else t is emitted and we stop.  The output is
token for token the oracle's own greedy continuation.

Sampling.  We must emit tokens distributed exactly as the oracle's
p = probs_from_logits(row, sampling), step by step.  At node u, with children
x_1, x_2, ... tried in order (recursive rejection sampling, as in SpecInfer
and multi-draft speculative sampling):

- Deterministic tree (`sampled=False`; e.g. the draft's top-k): a child is a
  fixed proposal, a one-hot q on x.  Accept x with probability p(x); on
  rejection the event "the output is not x" has left p conditioned on it,
  p <- p with x zeroed, renormalised.  Trying x_1..x_k and finally drawing
  from what is left is the chain rule of p, so the emitted token is ~ p.
- Sampled tree (`sampled=True`): x_i was drawn from q_i, the draft's child_q[u]
  with x_1..x_{i-1} removed and renormalised (siblings are drawn without
  replacement).  Accept with probability min(1, p(x)/q_i(x)); on rejection
  p <- normalise(max(p - q_i, 0)) (the residual) and q_{i+1} = q_i with x
  zeroed, renormalised.  This is the speculative-sampling step of Leviathan
  et al. / Chen et al.: its output is ~ p for any q_i when x ~ q_i, and
  applying it to each sibling in turn, with the residual as the next target,
  keeps that true because each sibling is a fresh draw from q_{i+1} given the
  rejections so far.
- Mixed node (a sampled tree with `fixed` children merged in, e.g. prompt
  lookup on top of draft samples): the drawn children are tried first with
  the sampled rule; if all are rejected, the leftover distribution (the
  residual) is the exact target given those rejections, and the fixed
  children are tried against it with the deterministic rule.  The
  deterministic rule reproduces *any* target for *any* fixed proposals, so
  the fixed set may even depend on the draws (a fixed token equal to a drawn
  sibling is simply not added); trying fixed children first would not
  allow that, since the sampled rule needs a target chosen independently of
  its draws.
- On acceptance we move to the child and use *its* oracle row: one decision
  per node, shared by every branch through it, so a path is accepted with
  exactly the oracle's probability of emitting its tokens.  If every child is
  rejected (or u is a leaf) the next token is drawn from the current p.

In a deterministic tree a token the oracle cannot emit (p(x) = 0, e.g.
outside its top-k) is rejected without a draw and leaves p unchanged.  Every
random draw uses the caller's torch.Generator (draws happen on its device),
so a seeded run is reproducible.

What a tree's shape may depend on (the rule `--method auto` and the adaptive
budget live by).  Which configuration proposes a step (no speculation, a
lookup chain, a draft tree of some size, a stage chain of some length), how
big its tree is and where it is cut may depend on anything known before the
step's oracle pass: earlier steps (acceptance statistics, measured times,
the tokens emitted so far) and the drafts' own proposals for this step (a
lookup chain exists or not, the draft's scores).  It must never depend on
this step's oracle result: its logits, or the random draws verification
will make.  Given everything it may depend on, the tree is a fixed set of
proposals, and each rule above reproduces p for any such set, so the
emitted token is ~p whatever the history did to the shape.  A shape chosen
after peeking at the oracle (propose x only when x will be accepted) emits
x with probability p + (1 - p) p instead; tests/test_distribution_exactness.py
has that negative control, and chi-square configurations whose shape moves
with history.  Within a sampled tree, the number of draws must not depend
on the draws themselves either: see `stagedspec.tree._grow_sampled`.  Why a deterministic tree cannot use the
min(1, p/q) rule with the draft's softmax as q: its children are not draws
from q (the top-k token is proposed with probability 1, not q(x)), so the
acceptance probabilities no longer add up to p; the negative controls in
tests/test_distribution_exactness.py show this and three other classic
mistakes being caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from stagedspec.errors import StagedSpecError
from stagedspec.sampling import SamplingParams, greedy_tokens, inverse_cdf_rows, probs_from_logits, sample
from stagedspec.tree import TokenTree

# Residual mass below which a rejection is treated as (numerically) impossible.
_RESIDUAL_EPS = 1e-9


@dataclass
class VerifyResult:
    accepted: list[int]  # node indices along the accepted path, root excluded, in order
    next_token: int  # the oracle's own token after the accepted path (correction or bonus)
    # Sampled verification: the probability that the root's first child (the draft's favourite, unless it is a
    # fixed lookup proposal) was accepted, given the tree; None where not computed (greedy, where acceptance is
    # not random).  Its expectation is that child's acceptance rate, with none of the
    # noise of the one draw that decided it: `auto` learns from it at T > 0 (`AutoDrafter.verified`).
    first_accept: float | None = field(default=None, compare=False)


# A node rule: (p, child tokens, child_q or None, generator) -> (index of the accepted
# child or None, distribution to draw the next token from when None).
NodeRule = Callable[[Tensor, list[int], Tensor | None, torch.Generator | None], tuple[int | None, Tensor]]


def verify(
    tree: TokenTree, oracle_logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """The accepted path of `tree` and the next token, exact for the oracle's distribution."""
    if oracle_logits.dim() != 2 or oracle_logits.shape[0] != len(tree):
        raise ValueError(f"oracle logits of shape {tuple(oracle_logits.shape)} for a tree of {len(tree)} nodes")
    if sampling.greedy:
        return verify_greedy(tree, oracle_logits)
    if oracle_logits.is_cuda:  # one copy back instead of a sync per decision (measured dearer on a CPU)
        return verify_sampled(tree, oracle_logits, sampling, generator)
    rule = sampled_node_rule if tree.sampled else deterministic_node_rule
    return walk_tree(tree, oracle_logits, sampling, generator, rule)


def verify_greedy(tree: TokenTree, oracle_logits: Tensor) -> VerifyResult:
    """Follow the oracle's argmax through the tree (one argmax over all rows, no softmax)."""
    best = greedy_tokens(oracle_logits).tolist()
    kids = tree.children_lists()
    node, accepted = 0, []
    while True:
        t = best[node]
        nxt = next((c for c in kids[node] if tree.tokens[c] == t), None)
        if nxt is None:
            return VerifyResult(accepted, t)
        node = nxt
        accepted.append(node)


def verify_sampled(
    tree: TokenTree, oracle_logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """The node rules of `walk_tree`, decided for every node at once on the logits' device: one copy back.

    Why: walking node by node reads a probability, a uniform and a mass per
    sibling (`float(...)`), each a device-to-host sync on a GPU.  Here every
    node's rules run before the walk, as tensor operations batched over the
    nodes: sibling rank r of every node is decided together (the r-th child
    of each node sees its node's target after r rejections, exactly as in
    `sampled_node_rule` / `deterministic_node_rule`), each child gets its
    acceptance probability, and each node gets the token drawn from what is
    left of its p once all its children are rejected.  One uniform per child
    and one per node decide them; the accept bits and the drawn tokens come
    back in one copy, and the host walks the tree: at each node the first
    accepted child (in the rules' order) is taken, else the node's drawn
    token is emitted.

    Exactness: on the walked path each decision uses its own fresh uniform
    and the target it would have had in the walk (which depends only on the
    node's own earlier siblings being rejected), so the path's law is the
    walk's, which is the oracle's (module docstring).  Decisions off the
    path are computed and thrown away; they spend draws but never shape the
    output.  The draws (a uniform per node, then per child) are fixed in
    number by the tree's size, never by their values.

    On a CPU the walk is used instead: it turns only the walked rows into
    probabilities, and a 16-node tree over a 49k vocabulary took 0.3-1 ms
    walked against 7-21 ms batched (top-k 50 included), while a host read
    there costs nothing.
    """
    n = len(tree)
    kids = tree.children_lists()
    device = oracle_logits.device
    probs = probs_from_logits(oracle_logits, sampling).double()
    if tree.sampled:  # rules' order at a node: drawn children (sampled rule), then fixed ones (deterministic)
        order = [[c for c in ks if c not in tree.fixed] + [c for c in ks if c in tree.fixed] for ks in kids]
    else:
        order = kids
    parents = [u for u in range(n) if order[u]]
    # One uniform per node (its leftover draw), then one per child: drawn and copied over together.
    u = _uniforms(2 * n if parents else n, generator, device)
    u_final, u_child = u[:n], u[n:]
    leftover = probs
    decision = torch.zeros(n, dtype=torch.long, device=device)  # per child: 1 accepted, 2 no draft probability
    first = first_draft_child(tree, kids[0])  # its acceptance probability comes back in the same copy
    odds = torch.zeros(0, dtype=torch.float64, device=device)
    if parents:
        leftover, accept_prob, no_q = _decide_children(tree, order, parents, probs)
        decision = (u_child < accept_prob).long() + 2 * no_q.long()
        if first is not None:
            odds = accept_prob[first:first + 1]
    drawn = inverse_cdf_rows(leftover, u_final)
    packed = torch.cat([decision.double(), drawn.double(), odds]).tolist()  # token ids are exact in float64
    decided, tokens = [int(v) for v in packed[:n]], [int(v) for v in packed[n:2 * n]]
    first_accept = packed[2 * n] if len(packed) > 2 * n else None
    node, path = 0, []
    while True:
        nxt = None
        for c in order[node]:
            if decided[c] >= 2:  # as the walk would, fail only on a node it reaches
                raise StagedSpecError(f"sampled tree: node {c} was drawn but has no draft probability "
                                      f"(child_q of node {node} missing or zero there)")
            if decided[c]:
                nxt = c
                break
        if nxt is None:
            return VerifyResult(path, tokens[node], first_accept)
        node = nxt
        path.append(node)


def _decide_children(
    tree: TokenTree, order: list[list[int]], parents: list[int], probs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Every child's acceptance probability and every node's target once all its children are rejected.

    Works on the rows of `parents` (nodes with children), sibling rank by rank.
    Returns (leftover [n, V], accept probability per node index [n], and per
    node index whether it is a drawn child with zero draft probability, or
    whose parent has no `child_q`).

    Every index the ranks use (rows, tokens, child ids) is built on the host
    and sent over in one copy: a tensor made from a Python list on a GPU is a
    synchronous copy, and three per rank cost more than the rules' kernels.
    """
    n, device = len(tree), probs.device
    row_of = {u: i for i, u in enumerate(parents)}
    flat: list[int] = list(parents)
    groups: list[tuple[bool, int, int]] = []  # (drawn?, offset into flat, group size): rows, tokens, children
    for rank in range(max(len(order[u]) for u in parents)):
        at_rank = [(row_of[u], order[u][rank]) for u in parents if len(order[u]) > rank]
        drawn = [(i, c) for i, c in at_rank if tree.sampled and c not in tree.fixed]
        fixed = [(i, c) for i, c in at_rank if not (tree.sampled and c not in tree.fixed)]
        for is_drawn, group in ((True, drawn), (False, fixed)):
            if group:
                groups.append((is_drawn, len(flat), len(group)))
                flat += [i for i, _ in group] + [tree.tokens[c] for _, c in group] + [c for _, c in group]
    index = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
    parent_rows = index[: len(parents)]
    target = probs.index_select(0, parent_rows)  # [M, V]
    q = None
    if tree.sampled:
        rows = [tree.child_q[u].to(device, torch.float64) if u in tree.child_q else torch.zeros_like(probs[0])
                for u in parents]
        q = torch.stack(rows)
        q = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    accept_prob = torch.zeros(n, dtype=torch.float64, device=device)
    no_q = torch.zeros(n, dtype=torch.bool, device=device)
    for is_drawn, at, size in groups:
        rows, x, children = index[at:at + size], index[at + size:at + 2 * size], index[at + 2 * size:at + 3 * size]
        if is_drawn:
            _sampled_rank(target, q, rows, x, children, accept_prob, no_q)
        else:
            _deterministic_rank(target, rows, x, children, accept_prob)
    leftover = probs.clone()
    leftover.index_copy_(0, parent_rows, target)
    return leftover, accept_prob, no_q


def _sampled_rank(target: Tensor, q: Tensor, rows: Tensor, x: Tensor, children: Tensor,
                  accept_prob: Tensor, no_q: Tensor) -> None:
    """`sampled_node_rule`'s step for one drawn sibling `x` of each of `rows` (in place); `no_q` where q(x) = 0."""
    t, qr = target[rows], q[rows]
    px, qx = t.gather(1, x[:, None])[:, 0], qr.gather(1, x[:, None])[:, 0]
    accept_prob[children] = (px / qx.clamp_min(1e-300)).clamp_max(1.0)
    no_q[children] = qx <= 0
    r = (t - qr).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    target[rows] = torch.where(mass > _RESIDUAL_EPS, r / mass.clamp_min(_RESIDUAL_EPS), t)
    qr = qr.scatter(1, x[:, None], 0.0)
    q_mass = qr.sum(-1, keepdim=True)
    q[rows] = torch.where(q_mass > 0, qr / q_mass.clamp_min(torch.finfo(torch.float64).tiny), qr)


def _deterministic_rank(target: Tensor, rows: Tensor, x: Tensor, children: Tensor, accept_prob: Tensor) -> None:
    """`deterministic_node_rule`'s step for one fixed sibling `x` of each of `rows`, in place."""
    t = target[rows]
    px = t.gather(1, x[:, None])[:, 0]
    accept_prob[children] = px
    rest = t.scatter(1, x[:, None], 0.0)
    mass = rest.sum(-1, keepdim=True)
    keep = (px[:, None] <= 0) | (mass <= _RESIDUAL_EPS)  # p(x) = 0: no draw, p unchanged; mass ~ 0: see below
    target[rows] = torch.where(keep, t, rest / mass.clamp_min(_RESIDUAL_EPS))


def walk_tree(
    tree: TokenTree,
    oracle_logits: Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    rule: NodeRule,
) -> VerifyResult:
    """Descend from the root, letting `rule` decide at each node with that node's oracle p.

    Rows are converted to probabilities lazily: only the nodes on the walked
    path are ever needed.
    """
    kids = tree.children_lists()
    node, accepted = 0, []
    first_accept = None
    while True:
        p = probs_from_logits(oracle_logits[node], sampling).double()
        if node == 0:
            first_accept = first_child_acceptance(tree, kids[0], p)
        drawn = [c for c in kids[node] if c not in tree.fixed]
        fixed = [c for c in kids[node] if c in tree.fixed]
        q = tree.child_q.get(node) if tree.sampled else None
        if tree.sampled and drawn and q is None:
            raise StagedSpecError(f"sampled tree: node {node} has children but no child_q")
        choice, leftover = rule(p, [tree.tokens[c] for c in drawn], q, generator) if drawn else (None, p)
        if choice is not None:
            node = drawn[choice]
        elif fixed:
            choice, leftover = deterministic_node_rule(leftover, [tree.tokens[c] for c in fixed], None, generator)
            node = fixed[choice] if choice is not None else node
        if choice is None:
            return VerifyResult(accepted, _draw(leftover, generator), first_accept)
        accepted.append(node)


def first_draft_child(tree: TokenTree, root_kids: list[int]) -> int | None:
    """The root's first child if it is the draft's (any child of a tree of fixed proposals; a drawn one of a
    sampled tree), else None: the first its node's rules try, so its acceptance probability is unconditional."""
    if not root_kids or (tree.sampled and root_kids[0] in tree.fixed):
        return None
    return root_kids[0]


def first_child_acceptance(tree: TokenTree, root_kids: list[int], p: Tensor) -> float | None:
    """The probability the node rules accept the root's first child, given its token and the oracle's `p` at the
    root: p(x) for a fixed (one-hot) proposal, min(1, p(x) / q(x)) for one drawn from q.  None where the first
    child is a fixed lookup proposal of a sampled tree (not the draft's) or the root has none."""
    child = first_draft_child(tree, root_kids)
    if child is None:
        return None
    x = tree.tokens[child]
    if not tree.sampled:
        return float(p[x])
    q = tree.child_q.get(0)
    if q is None:
        return None
    q = q.to(p.device, torch.float64)
    qx = float(q[x]) / float(q.sum())
    return min(1.0, float(p[x]) / qx) if qx > 0 else None


def deterministic_node_rule(
    p: Tensor, tokens: list[int], q: Tensor | None, generator: torch.Generator | None
) -> tuple[int | None, Tensor]:
    """Fixed proposals (one-hot q): accept x w.p. p(x); on rejection condition p on "not x"."""
    for i, x in enumerate(tokens):
        px = float(p[x])
        if px > 0 and _uniform(generator) < px:
            return i, p
        if px > 0:
            rest = p.clone()
            rest[x] = 0.0
            mass = float(rest.sum())
            # mass ~ 0 means p(x) ~ 1, so this rejection had probability ~ 0.
            p = rest / mass if mass > _RESIDUAL_EPS else p
    return None, p


def sampled_node_rule(
    p: Tensor, tokens: list[int], q: Tensor | None, generator: torch.Generator | None
) -> tuple[int | None, Tensor]:
    """Siblings drawn without replacement from q: min(1, p/q) acceptance, residual max(p - q, 0)."""
    assert q is not None
    q = q.to(p.device, torch.float64)
    q = q / q.sum()
    for i, x in enumerate(tokens):
        qx, px = float(q[x]), float(p[x])
        if qx <= 0:
            raise StagedSpecError(f"sampled tree: token {x} has zero draft probability at its parent")
        if _uniform(generator) < min(1.0, px / qx):
            return i, p
        p = residual(p, q)
        q = q.clone()
        q[x] = 0.0
        q_mass = float(q.sum())
        if q_mass <= 0:  # every token q could produce was drawn: no further sibling can exist
            break
        q = q / q_mass
    return None, p


def residual(p: Tensor, q: Tensor) -> Tensor:
    """normalise(max(p - q, 0)), the oracle's distribution given that a draw from q was rejected.

    Its mass equals the probability of that rejection, sum_x q(x)(1 - min(1, p/q)),
    i.e. TV(p, q).  A mass of ~0 therefore means p ~ q, where a rejection happens
    with probability ~0 (exactly 0 when p == q: then p/q >= 1 wherever q > 0 and
    u < 1 always accepts); we keep p then rather than divide 0 by 0.  The
    distribution used on an event of probability <= eps moves the output
    distribution by at most eps in total variation, so this is exact up to
    floating-point rounding, like every other step.
    """
    r = (p - q).clamp_min(0.0)
    mass = float(r.sum())
    return r / mass if mass > _RESIDUAL_EPS else p


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """`n` uniforms from `generator`, on `device`.

    The loop's generator lives on the CPU (it also draws the drafts' tokens),
    while the logits may be on a GPU: draw where the generator is, then copy
    (a few hundred bytes, asynchronous to the host's next line).
    """
    source = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, dtype=torch.float64, device=source).to(device, non_blocking=True)


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def _draw(probs: Tensor, generator: torch.Generator | None) -> int:
    return sample(probs, generator)
