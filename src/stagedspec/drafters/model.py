"""A small transformer as the drafter (one speculation stage).

The draft keeps its own static KV cache holding the committed context.  Each
proposal first runs the context tokens it has not seen (the last step's
accepted path and bonus token, usually 1-5 tokens, in one pass), then grows a
tree with `grow_tree`, one draft forward per round of expansions.  Tree nodes
are cached temporarily, each seeing only its ancestors through a full-width
mask, and dropped afterwards; the accepted ones come back as context next
time, which costs nothing extra because that pass is needed anyway.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor

from stagedspec.budget import AdaptiveBudget
from stagedspec.constraints.processor import LogitsProcessor
from stagedspec.drafters.base import Drafter, check_size
from stagedspec.errors import StagedSpecError
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.transformer import Transformer
from stagedspec.runner import RequestPasses, draft_cache_len, pass_mode
from stagedspec.sampling import SamplingParams
from stagedspec.tree import TokenTree, grow_tree
from stagedspec.tree_levels import grow_levels

DRAFT_METHODS = ("tree", "chain")  # the shapes a draft model grows: a best-first tree, or one chain
GROWTHS = ("auto", "best-first", "levels")


class ModelDrafter(Drafter):
    """Proposes trees ("tree", best-first) or chains ("chain") from a draft model.

    Subclasses change what a pass reads (`FeatureDrafter` adds the oracle's
    hidden states) through `_root` and `_run_nodes`; the tree growth, the
    cache bookkeeping and the adaptive budget stay here.

    Trees grow best-first on the host (`tree.grow_tree`), or level by level
    on the device (`tree_levels.grow_levels`, `growth="levels"`): the same
    kind of tree with one copy back instead of one per draft pass.  "auto"
    picks levels where a copy back waits for the device (CUDA) and best-first
    on a CPU, where reading a result costs nothing.
    """

    supports_levels = True  # a subclass whose passes need per-node inputs it cannot build on the device: False

    def __init__(
        self,
        model: Transformer,
        *,
        method: str = "tree",
        tree_budget: int = 16,
        max_depth: int = 6,
        branching: int = 4,
        chain_length: int = 4,
        width: int | None = None,
        name: str = "draft",
        max_len: int | None = None,
        adaptive: AdaptiveBudget | None = None,
        growth: str = "auto",
        processor: LogitsProcessor | None = None,
        passes: RequestPasses | None = None,
    ) -> None:
        """`adaptive`: cut each tree to the number of best nodes that maximises expected tokens per
        second (see `stagedspec.budget`); `tree_budget` is then the most it may keep.  `processor`: a request's
        logit bias and grammar (`stagedspec.constraints`), applied to every draft row by its node's path,
        so the draft proposes under the masks the oracle is scored with; trees then grow best-first.  `passes`:
        the request this drafter runs for (its router and runner leases; see `runner.RequestPasses`)."""
        if method not in DRAFT_METHODS:
            raise StagedSpecError(f"unknown draft method {method!r}: use 'tree' or 'chain'")
        for label, value in (("tree budget", tree_budget), ("tree depth", max_depth), ("chain length", chain_length),
                             ("branching", branching)):
            if value < 1:
                raise StagedSpecError(f"{label} must be >= 1, got {value}")
        self.model = model
        self.passes = passes if passes is not None else RequestPasses()
        self.method = method
        self.tree_budget, self.max_depth, self.branching = tree_budget, max_depth, branching
        self.chain_length, self.width, self.name = chain_length, width, name
        self.max_len = max_len or model.config.max_position
        self.node_room = self.max_tree_budget  # tree nodes the cache keeps slots for: `resize` stays within them
        self.runner = None
        if pass_mode(model) != "eager":  # static-shape passes, CUDA graphs on a GPU (`stagedspec.runner`)
            self.runner = self.passes.acquire(model, draft_cache_len(self.max_len, self.node_room), self)
            self.cache = self.runner.cache
        else:
            self.cache = model.new_cache(draft_cache_len(self.max_len, self.node_room))
        self.device = model.embed.weight.device
        self.forward_passes = 0
        self.adaptive = adaptive if method == "tree" else None
        if growth not in GROWTHS:
            raise StagedSpecError(f"unknown tree growth {growth!r}: use one of {', '.join(GROWTHS)}")
        if growth == "levels" and (self.runner is None or not self.supports_levels):
            raise StagedSpecError("tree growth 'levels' needs static-shape passes (CUDA, or --static-passes on a "
                                  "CPU) and a draft whose passes read tokens only")
        if growth == "auto":
            growth = "levels" if self.runner is not None and self.supports_levels and self.device.type == "cuda" \
                else "best-first"
        self.growth = growth
        self.processor = processor
        self._last_step: tuple[int, float] | None = None  # (context length, predicted tokens) of the last tree

    @property
    def max_tree_budget(self) -> int:
        return self.chain_length if self.method == "chain" else self.tree_budget

    def resize(self, *, chain_length: int | None = None, tree_budget: int | None = None,
               max_depth: int | None = None, branching: int | None = None) -> None:
        """`tree_budget`, `max_depth` and `branching`: a tree's nodes, depth and children per node (`--method
        auto`'s `tree:n` arms); `chain_length`: a chain's length.  The cache was sized for the nodes this drafter
        was built with, so no resize may ask for more."""
        for label, value in (("tree budget", tree_budget), ("tree depth", max_depth), ("chain length", chain_length),
                             ("branching", branching)):
            check_size(label, value)
        nodes = tree_budget if self.method == "tree" else chain_length
        if nodes is not None and nodes > self.node_room:
            raise StagedSpecError(f"a draft built for {self.node_room}-node trees cannot propose {nodes} nodes")
        if tree_budget is not None:
            self.tree_budget = tree_budget
        if max_depth is not None:
            self.max_depth = max_depth
        if branching is not None:
            self.branching = branching
        if chain_length is not None:
            self.chain_length = chain_length

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.cache.reset()
        self._last_step = None

    def _run(self, tokens: list[int], positions: Tensor, mask: Tensor | None, rows: slice | None) -> Tensor:
        """One draft pass (`positions` on the host), its entries committed at once."""
        self.forward_passes += 1
        logits, _ = self.passes.run_pass(self.model, self.runner, self.cache, tokens, positions,
                                         PassSpec(tree_mask=mask, logits_rows=rows))
        self.cache.commit()
        return logits

    def _root(self, context: Sequence[int]) -> Tensor:
        """Run the context tokens the cache lacks (the root last); the root's logits [1, V]."""
        seen = self.cache.length
        if seen >= len(context):  # never happens in the loop; keeps the root's logits honest
            self.cache.truncate(len(context) - 1)
            seen = self.cache.length
        new = list(context[seen:])
        return self._run(new, torch.arange(seen, len(context)), None, slice(-1, None))

    def _run_nodes(self, tree: TokenTree, nodes: list[int], positions: Tensor, mask: Tensor) -> Tensor:
        """One pass over tree `nodes` (each seeing the context and its ancestors through `mask`); logits [n, V]."""
        return self._run([tree.tokens[x] for x in nodes], positions, mask, None)

    def propose(
        self, context: Sequence[int], sampling: SamplingParams, generator: torch.Generator | None, max_tokens: int
    ) -> TokenTree:
        t_start = time.perf_counter()
        if self.adaptive is not None and self._last_step is not None:
            # The context grew by the accepted nodes plus the oracle's own token.
            last_len, predicted = self._last_step
            self.adaptive.observe(predicted, max(0, len(context) - last_len - 1))
        root_logits = self._root(context)  # catch up with the committed context (its last token is the root)
        base = self.cache.length  # == len(context); the root sits at slot base - 1
        slot = {0: base - 1}
        depth_of = {0: 0}

        def expand(tree: TokenTree, nodes: list[int]) -> Tensor:
            if nodes == [0]:
                return root_logits
            start = self.cache.length
            n = len(nodes)
            mask = torch.zeros(n, start + n, dtype=torch.bool)
            mask[:, :base] = True
            rows, cols = [], []  # each node's ancestors' slots, set in one indexed write
            for r, node in enumerate(nodes):
                slot[node] = start + r
                depth_of[node] = depth_of[tree.parents[node]] + 1
                a = node
                while a > 0:
                    rows.append(r)
                    cols.append(slot[a])
                    a = tree.parents[a]
            mask[rows, cols] = True
            positions = torch.tensor([base - 1 + depth_of[x] for x in nodes])
            return self._run_nodes(tree, nodes, positions, mask)

        if self.processor is not None:
            raw_expand, processor = expand, self.processor

            def expand(tree: TokenTree, nodes: list[int]) -> Tensor:  # noqa: F811 - the same pass, constrained
                return processor.rows(context, tree, nodes, raw_expand(tree, nodes))

        depth = max(1, min(self.max_depth if self.method == "tree" else self.chain_length, max_tokens))
        if self.method == "chain":
            k = min(self.chain_length, depth)
            if sampling.greedy:
                tree = grow_tree(context[-1], expand, sampling=sampling, generator=generator, mode="topk",
                                 tree_budget=k, max_depth=k, branching=1, width=1, proposer=self.name)
            else:
                tree = grow_tree(context[-1], expand, sampling=sampling, generator=generator, mode="sampled",
                                 tree_budget=k, max_depth=k, branching=[1] * k, proposer=self.name)
        elif self.growth == "levels" and self.processor is None:  # levels read raw rows on the device
            def run_level(tokens: Tensor, level: int, tree_mask: Tensor) -> Tensor:
                self.forward_passes += 1
                logits = self.runner.run_on_device(tokens, base - 1 + level, tree_mask, base)
                self.cache.commit()
                return logits

            # Levels 1..depth-1 are expanded `width` nodes each; their cache entries must fit the `tree_budget`
            # slots the cache keeps for a tree (`draft_cache_len`).
            width = max(1, min(self.width or -(-self.tree_budget // depth), self.tree_budget // max(1, depth - 1)))
            tree = grow_levels(context[-1], root_logits, run_level, sampling=sampling, tree_budget=self.tree_budget,
                               max_depth=depth, width=width, branching=self.branching, proposer=self.name)
        else:
            tree = grow_tree(context[-1], expand, sampling=sampling, generator=generator, mode="topk",
                             tree_budget=self.tree_budget, max_depth=depth, branching=self.branching, width=self.width,
                             proposer=self.name)
        self.cache.truncate(base)
        if self.adaptive is not None:
            keep = self.adaptive.choose(tree.scores[1:], time.perf_counter() - t_start)
            tree = tree.best_prefix(keep)
            self._last_step = (len(context), sum(tree.scores[1:]))
        return tree
