"""Drafting with a feature draft (`FeatureDraftModel`): as a tree/chain drafter, and as the top stage of `staged`.

Where the features come from.  The oracle (`ModelOracle.prepare_features`)
keeps the final hidden state of every token it caches, taken from the passes
it runs anyway: the prompt's, and each verification (the rows of the root and
the accepted path).  The loop hands the oracle to the drafter once per
request (`attach_oracle`, called by `iter_steps`); the drafter then reads
f_0..f_{n-1} when the committed context is x_0..x_n.  No extra oracle pass.

The draft's own cache.  Entry t holds the draft's keys for input
(f_{t-1}, x_t).  Entries fed by the oracle's own features are "real" and kept
across steps; entries fed by the draft's predicted features (tree nodes, and a
stage's own tokens) are dropped once the oracle has verified those positions,
and recomputed from the real features next time, as in EAGLE.  A position
the oracle has no feature for yet (the prompt under `bit_exact`, a toy oracle)
reads zeros: acceptance suffers, exactness never does, since the oracle
verifies every proposed token.

Tree nodes.  The root's input is (f_{n-1}, x_n); a node at depth d >= 1
reads its parent's output f̂ (the draft's prediction of the oracle's feature
there) with its own token, one draft pass per tree level.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from stagedspec.drafters.model import ModelDrafter
from stagedspec.errors import StagedSpecError
from stagedspec.models.feature_draft import is_feature_draft, widen_features
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.transformer import Transformer
from stagedspec.cache import KVCache
from stagedspec.runner import RequestPasses, StaticRunner, pass_mode
from stagedspec.tree import TokenTree


class FeatureInputs:
    """A feature draft's KV cache, the tokens its committed entries hold, and the oracle it reads features from."""

    def __init__(self, model: Transformer, cache: KVCache, runner: StaticRunner | None, passes: RequestPasses) -> None:
        """`runner`: run the passes through this static runner (whose cache is `cache`), else eagerly, through
        `passes` (the request's router)."""
        if not is_feature_draft(model):
            raise StagedSpecError("a feature drafter needs a feature draft (draft_config.json kind 'feature')")
        self.model, self.cache, self.runner, self.passes = model, cache, runner, passes
        self.tokens: list[int] = []  # the token of each committed cache entry
        self.real = 0  # leading committed entries whose input feature was the oracle's own
        self.source: Any = None  # the oracle: `committed_features` [m, H] are f_0..f_{m-1}
        p = model.embed.weight
        self.dtype, self.device = p.dtype, p.device

    def attach(self, oracle: Any) -> None:
        """Read features from `oracle` from now on (asking it to record them, and to run the prompt now)."""
        self.source = oracle
        # an oracle, not a drafter: only a `ModelOracle` (or one wrapping it) records features; a toy reads zeros
        prepare = getattr(oracle, "prepare_features", None)
        if prepare is not None:
            prepare(self.model.feature_taps)

    def reset(self) -> None:
        self.cache.reset()
        self.tokens, self.real = [], 0

    def sync(self, context: Sequence[int]) -> int:
        """Keep the committed entries that are real and agree with `context`; drop the rest. Returns how many."""
        keep, limit = 0, min(self.real, len(self.tokens), len(context))
        while keep < limit and self.tokens[keep] == context[keep]:
            keep += 1
        self.cache.truncate(keep)
        del self.tokens[keep:]
        self.real = keep
        return keep

    def oracle_inputs(self, start: int, end: int) -> tuple[Tensor, int]:
        """Input features [end - start, H] of positions start..end-1 (f_{p-1}; zeros at p = 0 and where the
        oracle has none yet) and how many leading positions got the oracle's own."""
        n = end - start
        out = torch.zeros(n, self.model.feature_width, dtype=self.dtype, device=self.device)
        feats = getattr(self.source, "committed_features", None) if self.source is not None else None
        m = 0 if feats is None else int(feats.shape[0])
        lo, hi = max(start, 1), min(end, m + 1)
        if hi > lo:
            out[lo - start:hi - start] = feats[lo - 1:hi - 1].to(device=self.device, dtype=self.dtype)
        return out, min(n, max(0, m + 1 - start))

    def run(self, tokens: list[int], features: Tensor, positions: Tensor, mask: Tensor | None,
            rows: slice | None) -> tuple[Tensor, Tensor]:
        """One draft pass, its entries committed at once: logits [n', V] and output features [n', H] of `rows`.
        `features` [n, H or feature_width]: a predicted feature (H wide) has no taps, which count as zeros."""
        features = widen_features(features, self.model.feature_width)
        spec = PassSpec(tree_mask=mask, logits_rows=rows, hidden="rows", features=features[None])
        # through the request's passes, so that the batched server runs it in one ragged pass with other requests'
        logits, hidden = self.passes.run_pass(self.model, self.runner, self.cache, tokens, positions, spec)
        assert hidden is not None
        self.cache.commit()
        return logits, hidden

    def catch_up(self, context: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Run what the cache lacks of `context` (its last token, the root, always): the root's logits and
        output feature, each [1, ...]."""
        keep = self.sync(context)
        if keep >= len(context):  # the root's logits are needed: run it again
            keep = self.sync(context[:-1])
        feats, n_real = self.oracle_inputs(keep, len(context))
        new = list(context[keep:])
        logits, hidden = self.run(new, feats, torch.arange(keep, len(context)), None, slice(-1, None))
        self.tokens.extend(new)
        self.real = keep + n_real
        return logits, hidden


class FeatureDrafter(ModelDrafter):
    """`ModelDrafter` (tree or chain) over a feature draft: the root reads the oracle's feature, deeper
    nodes their parent's predicted one."""

    supports_levels = False  # deeper nodes read their parent's predicted feature: built per node on the host

    def __init__(self, model: Transformer, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        if self.runner is not None:
            self.runner.keep_hidden = True
        self.inputs = FeatureInputs(model, self.cache, self.runner, self.passes)
        self._out: dict[int, Tensor] = {}  # output feature of each node of the tree being grown

    def attach_oracle(self, oracle: Any) -> None:
        self.inputs.attach(oracle)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        super().begin(prompt_ids)
        self.inputs.reset()

    def _root(self, context: Sequence[int]) -> Tensor:
        self.forward_passes += 1
        logits, hidden = self.inputs.catch_up(context)
        self._out = {0: hidden[-1]}
        return logits

    def _run_nodes(self, tree: TokenTree, nodes: list[int], positions: Tensor, mask: Tensor) -> Tensor:
        self.forward_passes += 1
        feats = torch.stack([self._out[tree.parents[x]] for x in nodes])
        logits, hidden = self.inputs.run([tree.tokens[x] for x in nodes], feats, positions, mask, None)
        self._out.update(zip(nodes, hidden))
        return logits


class FeatureStage:
    """A feature draft as a stage's oracle (`StageDrafter`): it scores the trees of the stage below.

    A tree of depth D costs D + 1 draft passes (one per level: a node needs
    its parent's output feature), against one for an independent draft; the
    stage's own accepted tokens keep their predicted features until the
    oracle above has verified them.
    """

    bit_exact = False  # the stage's passes, like every draft's, need not match one-token decoding

    def __init__(self, model: Transformer, max_len: int, passes: RequestPasses | None = None) -> None:
        """`passes`: the request this stage runs for (its router and runner leases; see `runner.RequestPasses`)."""
        passes = passes if passes is not None else RequestPasses()
        runner = None
        if pass_mode(model) != "eager":  # static-shape passes, CUDA graphs on a GPU (`stagedspec.runner`)
            runner = passes.acquire(model, max_len, self)
            runner.keep_hidden = True
        self.inputs = FeatureInputs(model, runner.cache if runner is not None else model.new_cache(max_len), runner,
                                    passes)
        self.forward_passes = 0
        self._lead: list[int] = []  # context tokens to run in front of the next root
        self._out: dict[int, Tensor] = {}  # output feature per position of this stage's own committed tokens
        self._tree: TokenTree | None = None
        self._base = 0  # cache length right after the root of the last scored tree
        self._slot: dict[int, int] = {}
        self._node_out: dict[int, Tensor] = {}

    def attach_oracle(self, oracle: Any) -> None:
        self.inputs.attach(oracle)

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        keep = self.inputs.sync(list(prompt_ids[:-1]))
        self._lead = list(prompt_ids[keep:-1])
        self._out = {}

    def score(self, tree: TokenTree) -> Tensor:
        inputs, cache = self.inputs, self.inputs.cache
        start = cache.length
        root_pos = start + len(self._lead)
        feats, n_real = inputs.oracle_inputs(start, root_pos + 1)
        if n_real <= len(self._lead) and root_pos - 1 in self._out:  # a root after this stage's own tokens
            feats[-1] = widen_features(self._out[root_pos - 1], feats.shape[-1])
        tokens = [*self._lead, tree.tokens[0]]
        self.forward_passes += 1
        root_logits, root_out = inputs.run(tokens, feats, torch.arange(start, root_pos + 1), None, slice(-1, None))
        inputs.tokens.extend(tokens)  # the lead and the root are kept whatever is accepted
        if inputs.real == start:
            inputs.real = start + n_real
        self._lead = []
        self._base = root_pos + 1
        self._tree = tree
        logits: dict[int, Tensor] = {0: root_logits[0]}
        self._node_out = {0: root_out[-1]}
        self._slot = {0: root_pos}
        depths = tree.depths
        for d in range(1, tree.depth + 1):
            nodes = [i for i in range(1, len(tree)) if depths[i] == d]
            first = cache.length
            mask = torch.zeros(len(nodes), first + len(nodes), dtype=torch.bool)
            mask[:, :self._base] = True
            for r, node in enumerate(nodes):
                self._slot[node] = first + r
                a = node
                while a > 0:
                    mask[r, self._slot[a]] = True
                    a = tree.parents[a]
            feats = torch.stack([self._node_out[tree.parents[x]] for x in nodes])
            self.forward_passes += 1
            rows, outs = inputs.run([tree.tokens[x] for x in nodes], feats, torch.full((len(nodes),), root_pos + d),
                                    mask, None)
            logits.update(zip(nodes, rows))
            self._node_out.update(zip(nodes, outs))
        return torch.stack([logits[i] for i in range(len(tree))])

    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root (already in place) and the accepted nodes' entries (levels lie in slot order)."""
        tree, cache = self._tree, self.inputs.cache
        assert tree is not None
        n_tree = cache.length - self._base
        cache.truncate(self._base)
        if accepted:
            cache.reserve(n_tree)
            cache.commit([self._slot[i] - self._base for i in accepted])
        self.inputs.tokens.extend(tree.tokens[i] for i in accepted)
        self._out[self._base - 1 + len(accepted)] = self._node_out[accepted[-1] if accepted else 0]
