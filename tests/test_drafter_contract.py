"""The drafter contract (`stagedspec.drafters.base.Drafter`): every drafter subclasses it, so the engine calls
its hooks directly, and `resize` takes only the knobs a drafter has."""

from __future__ import annotations

import pytest

from stagedspec.auto import AutoDrafter
from stagedspec.drafters.base import Drafter
from stagedspec.drafters.feature import FeatureDrafter
from stagedspec.drafters.lookup import LookupDrafter
from stagedspec.drafters.merged import MergedDrafter
from stagedspec.drafters.model import ModelDrafter
from stagedspec.errors import StagedSpecError
from stagedspec.generation import NoDrafter
from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.transformer import init_random
from stagedspec.server.pressure import CappedDrafter
from stagedspec.stages import StageDrafter


def tiny() -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position=64)
    return init_random(Transformer(cfg), seed=0, std=0.2).eval()


@pytest.mark.parametrize("cls", [NoDrafter, LookupDrafter, ModelDrafter, FeatureDrafter, StageDrafter, MergedDrafter,
                                 AutoDrafter, CappedDrafter])
def test_every_drafter_is_a_drafter(cls: type) -> None:
    assert issubclass(cls, Drafter)


def test_the_base_requires_begin_and_propose_and_its_hooks_do_nothing() -> None:
    with pytest.raises(TypeError):
        Drafter()  # type: ignore[abstract]

    class Plain(Drafter):
        def begin(self, prompt_ids):  # noqa: ANN001, ANN201
            pass

        def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
            raise NotImplementedError

    d = Plain()
    d.attach_oracle(object())
    d.verified(0.1)
    assert d.stage_telemetry() is None and d.forward_passes == 0
    assert dict(d.request_choices) == {} and d.tree_budget_cap is None
    # `auto`'s own members (its policy, the batched round it prices by) are not part of the contract
    assert not hasattr(d, "policy") and not hasattr(d, "shared_load")
    with pytest.raises(StagedSpecError, match="chain_length"):
        d.resize(chain_length=2)
    d.resize()  # nothing asked: nothing refused


def test_a_lookup_resizes_its_chains_and_refuses_tree_knobs() -> None:
    lookup = LookupDrafter(None, context=True, chain_length=4)
    lookup.resize(chain_length=2)
    assert lookup.chain_length == 2
    with pytest.raises(StagedSpecError, match="tree_budget"):
        lookup.resize(tree_budget=8)
    with pytest.raises(StagedSpecError, match=">= 1"):
        lookup.resize(chain_length=0)
    assert NoDrafter().stage_telemetry() == []  # no stage: no row in the stages table


def test_a_tree_draft_resizes_within_the_nodes_its_cache_was_built_for() -> None:
    tree = ModelDrafter(tiny(), method="tree", tree_budget=8, max_depth=4)
    tree.resize(tree_budget=4, max_depth=3)
    assert (tree.tree_budget, tree.max_depth) == (4, 3)
    tree.resize(tree_budget=8)
    with pytest.raises(StagedSpecError, match="8-node"):
        tree.resize(tree_budget=9)
    assert tree.tree_budget == 8  # a refused resize changes nothing


def test_a_tree_draft_resized_to_a_fan_proposes_the_root_s_children_in_one_pass() -> None:
    """`auto`'s `tree:3d1` arm: one level, three children of the root, from the catch-up pass alone."""
    from stagedspec.sampling import SamplingParams

    tree = ModelDrafter(tiny(), method="tree", tree_budget=8, max_depth=4, branching=2)
    tree.resize(tree_budget=3, max_depth=1, branching=3)
    assert tree.branching == 3
    context = [1, 2, 3, 4]
    tree.begin(context)
    passes = tree.forward_passes
    proposed = tree.propose(context, SamplingParams(), None, 8)
    assert len(proposed) == 4 and proposed.parents == [-1, 0, 0, 0]
    assert tree.forward_passes - passes == 1
    with pytest.raises(StagedSpecError, match=">= 1"):
        tree.resize(branching=0)


def test_a_stage_resizes_its_decoded_length() -> None:
    stage = StageDrafter(NoOracle(), NoDrafter(), chain_length=6)
    stage.resize(chain_length=2)
    assert stage.chain_length == 2
    with pytest.raises(StagedSpecError, match="max_depth"):
        stage.resize(max_depth=2)
    with pytest.raises(StagedSpecError, match="branching"):
        stage.resize(branching=2)


class NoOracle:
    """Never scored: the stage is only resized here."""

    forward_passes = 0
