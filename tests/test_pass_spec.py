"""`PassSpec` and `RequestPasses.run_pass`: one record describes a pass, and every path returns the same thing.

The dispatcher chooses between a static-shape runner and an eager pass (routed or straight to the model).
Whatever it chooses, a caller gets logits [T', V] of `logits_rows` and, when asked, hidden states: of those
rows ("rows") or of every row ("all").  Checked on a plain model and on a feature draft (which reads input
features), against the model's own `forward`.
"""

from __future__ import annotations

import pytest
import torch

from stagedspec.models.config import ModelConfig
from stagedspec.models.feature_draft import FeatureDraftModel
from stagedspec.models.pass_spec import PLAIN, PassSpec
from stagedspec.models.transformer import Transformer, init_random
from stagedspec.runner import RequestPasses, StaticRunner

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=24, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=256)
    return init_random(Transformer(cfg), seed=seed, std=0.3).eval()


def test_a_spec_names_its_hidden_states_from_a_closed_set() -> None:
    assert PLAIN.hidden == "none" and not PLAIN.wants_hidden
    assert PassSpec(hidden="all").wants_hidden
    with pytest.raises(ValueError, match="PassSpec.hidden must be one of"):
        PassSpec(hidden=True)  # type: ignore[arg-type]  # the old bool form of `return_hidden`
    spec = PassSpec(logits_rows=slice(1, None))
    assert spec.but(hidden="rows").logits_rows == slice(1, None) and spec.hidden == "none"


def test_a_static_pass_takes_its_mask_as_an_argument_not_in_the_spec() -> None:
    m = tiny(0)
    cache = m.new_cache(16)
    tokens, positions, slots = torch.tensor([[1, 2]]), torch.arange(2), torch.arange(2)
    mask = torch.zeros(2, cache.slots, dtype=torch.bool)
    with pytest.raises(ValueError, match="not `spec.tree_mask`"):
        m.forward_static(tokens, positions, slots, mask, cache, PassSpec(tree_mask=torch.ones(2, 2, dtype=torch.bool)))


@pytest.mark.parametrize("hidden", ["none", "rows", "all"])
@pytest.mark.parametrize("feature", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_run_pass_returns_what_forward_returns_on_every_path(hidden: str, feature: bool, static: bool) -> None:
    oracle = tiny(1)
    model = FeatureDraftModel(oracle, 1, None).eval() if feature else oracle
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 24, (6,), generator=g).tolist()
    tokens = torch.randint(0, 24, (4,), generator=g).tolist()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    positions = torch.tensor([6, 7, 7, 8])
    feats = torch.randn(1, 4, H, generator=g) if feature else None
    spec = PassSpec(tree_mask=tree, logits_rows=slice(1, None), hidden=hidden, features=feats)

    with torch.inference_mode():
        ref_cache = model.new_cache(64)
        model(torch.tensor([prompt]), torch.arange(6), ref_cache,
              PassSpec(features=torch.zeros(1, 6, H) if feature else None))
        ref_cache.commit()
        ref = model(torch.tensor([tokens]), positions, ref_cache, spec)

        passes = RequestPasses()
        runner = StaticRunner(model, 64) if static else None
        if runner is not None:
            runner.keep_hidden = hidden != "none"
        cache = runner.cache if runner is not None else model.new_cache(64)
        prompt_spec = PassSpec(features=torch.zeros(1, 6, H) if feature else None)
        passes.run_pass(model, runner, cache, prompt, torch.arange(6), prompt_spec)
        cache.commit()
        logits, states = passes.run_pass(model, runner, cache, tokens, positions, spec)

    ref_logits, ref_states = (ref[0][0], ref[1][0]) if hidden != "none" else (ref[0], None)
    assert logits.shape == ref_logits.shape == (3, 24)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    if hidden == "none":
        assert states is None
    else:
        assert states is not None and states.shape == (3 if hidden == "rows" else 4, H)
        torch.testing.assert_close(states, ref_states, rtol=1e-4, atol=1e-5)
