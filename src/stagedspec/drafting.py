"""A request's drafter, built from its method (`stagedspec.methods`), the loaded drafts and the speculation
settings: the one place the CLI's, the library's and the server's requests get theirs.

`fixed_drafter` runs a method at its configured sizes every step; `measured_drafter` gives `auto` (or a
method sized by measured costs) one drafter per arm, chosen each step by its policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Sequence

from stagedspec.auto import STAGE_SIZES, AutoDrafter, lookup_horizon, staged_lookup_length
from stagedspec.budget import AdaptiveBudget
from stagedspec.constraints.processor import ConstrainedOracle, LogitsProcessor
from stagedspec.drafters.base import Drafter
from stagedspec.drafters.feature import FeatureDrafter, FeatureStage
from stagedspec.drafters.lookup import LookupDrafter
from stagedspec.drafters.merged import MergedDrafter
from stagedspec.drafters.model import ModelDrafter
from stagedspec.errors import StagedSpecError
from stagedspec.generation import NoDrafter
from stagedspec.methods import method_named
from stagedspec.models.feature_draft import is_feature_draft
from stagedspec.models.transformer import Transformer
from stagedspec.runner import ModelOracle, RequestPasses, draft_cache_len
from stagedspec.speculation import SpeculationConfig
from stagedspec.stages import StageDrafter

if TYPE_CHECKING:
    from stagedspec.auto.policy import AutoPolicy
    from stagedspec.drafters.ngram import NgramModel
    from stagedspec.oracle import Oracle


@dataclass
class DraftParts:
    """What one request's drafter is built from: the loaded drafts and n-gram, the speculation settings, and
    the request's own cache length, logit processor and pass router."""

    draft_models: Sequence[Transformer]
    ngram: NgramModel | None
    speculation: SpeculationConfig
    max_len: int
    processor: LogitsProcessor | None = None
    passes: RequestPasses | None = None
    pass_seconds: Callable[[int], dict[int, float]] | None = None  # the adaptive tree budget's price list


def tree_drafter(model: Transformer, **kwargs: Any) -> Drafter:
    """The tree/chain drafter for `model`: a `FeatureDrafter` for a feature draft, else a `ModelDrafter`."""
    if is_feature_draft(model):
        return FeatureDrafter(model, **kwargs)
    return ModelDrafter(model, **kwargs)


def stage_chain(parts: DraftParts, below: Drafter, chain_length: int) -> Drafter:
    """The draft models as stages, top one first, each decoding speculatively against the one below (each
    stage's rows biased and masked by the request's processor, as the oracle's are)."""
    s, models = parts.speculation, parts.draft_models
    cache_len = draft_cache_len(parts.max_len, s.max_tree_budget)
    n = len(models)
    for i in reversed(range(n)):
        name = "draft" if n == 1 else f"draft{i + 1}"
        if is_feature_draft(models[i]):
            if i != 0:  # only the oracle computes the features it reads
                raise StagedSpecError("a feature draft can only be the top draft stage, right below the oracle")
            stage: Oracle = FeatureStage(models[i], cache_len, parts.passes)
        else:
            # A draft stage's rounding need not match anything: it keeps the cheaper, filled-width attention.
            stage = ModelOracle(models[i], cache_len, fixed_width=False, passes=parts.passes)
        if parts.processor is not None:
            stage = ConstrainedOracle(stage, parts.processor)
        below = StageDrafter(stage, below, name=name, chain_length=chain_length, branching=s.stage_branching)
    return below


def fixed_drafter(parts: DraftParts) -> Drafter:
    """The drafter of a method run at fixed sizes (every step drafts the configured sizes)."""
    s, processor = parts.speculation, parts.processor
    m = method_named(s.method)
    if not m.speculates:
        return NoDrafter()
    if m.drafts == "one":
        adaptive = None
        if "adaptive_budget" in m.size_fields and s.adaptive_budget:
            assert parts.pass_seconds is not None, "an adaptive tree budget needs the oracle's pass prices"
            adaptive = AdaptiveBudget(parts.pass_seconds(s.tree_budget + 1))
        return tree_drafter(parts.draft_models[0], method=s.method, tree_budget=s.tree_budget,
                            max_depth=s.tree_depth, branching=s.tree_branching, chain_length=s.chain_length,
                            max_len=parts.max_len, adaptive=adaptive, growth=s.tree_growth, processor=processor,
                            passes=parts.passes)
    below: Drafter = LookupDrafter(parts.ngram, s.context, chain_length=s.lookup_length, processor=processor)
    if not m.uses_drafts:
        return below
    below = stage_chain(parts, below, s.stage_length)
    if s.oracle_lookup and s.context:
        below = MergedDrafter(below, LookupDrafter(None, True, chain_length=s.merged_lookup_length,
                                                   processor=processor))
    return below


def measured_drafter(parts: DraftParts, policy: AutoPolicy) -> Drafter:
    """Every arm's drafter for `--method auto` or a measured method, sized per step by `policy` (see
    `stagedspec.auto`)."""
    s, processor = parts.speculation, parts.processor
    has_lookup = parts.ngram is not None or s.context
    lookup = (LookupDrafter(parts.ngram, s.context, chain_length=lookup_horizon(policy.arms), processor=processor)
              if has_lookup else None)
    arms: dict = {}
    for arm in policy.arms:
        if arm.kind == "ar":
            arms[arm] = (NoDrafter(), [])
        elif arm.kind == "lookup":
            arms[arm] = (lookup, [partial(lookup.resize, chain_length=arm.size)])
    copy_arms = [a for a in policy.arms if a.kind == "copy"]
    if copy_arms:  # the prompt-lookup chain alone (`stagedspec.auto.arms.COPY_SIZES`)
        copy = LookupDrafter(None, True, chain_length=max(a.size for a in copy_arms), processor=processor)
        for arm in copy_arms:
            arms[arm] = (copy, [partial(copy.resize, chain_length=arm.size)])
    tree_arms = [a for a in policy.arms if a.kind == "tree"]
    if tree_arms:
        biggest = max(tree_arms, key=lambda a: a.size)
        tree = tree_drafter(parts.draft_models[0], method="tree", tree_budget=biggest.size,
                            max_depth=max(a.tree_depth for a in tree_arms), branching=biggest.tree_branching,
                            max_len=parts.max_len, growth=s.tree_growth, processor=processor, passes=parts.passes)
        for arm in tree_arms:
            arms[arm] = (tree, [partial(tree.resize, tree_budget=arm.size, max_depth=arm.tree_depth,
                                        branching=arm.tree_branching)])
    stage_arms = [a for a in policy.arms if a.kind == "staged"]
    if stage_arms:
        below = (LookupDrafter(parts.ngram, s.context, chain_length=s.lookup_length, processor=processor)
                 if has_lookup else NoDrafter())
        top = stage_chain(parts, below, max(STAGE_SIZES))
        staged: Drafter = top
        merged_lookup = None
        if s.context:
            merged_lookup = LookupDrafter(None, True, processor=processor,
                                          chain_length=max(staged_lookup_length(a) for a in stage_arms))
            staged = MergedDrafter(top, merged_lookup)
        for arm in stage_arms:
            resizes = [partial(top.resize, chain_length=arm.size)]
            if merged_lookup is not None:
                resizes.append(partial(merged_lookup.resize, chain_length=staged_lookup_length(arm)))
            arms[arm] = (staged, resizes)
    drafter = AutoDrafter(policy, {a: arms[a] for a in policy.arms}, lookup=lookup)
    if not method_named(s.method).always_measured:
        drafter.name = f"{s.method} (measured)"  # its row in the stats' stages
    return drafter
