"""Feature taps: a feature draft that also reads the inputs of some oracle layers (EAGLE-3's low and mid features).

- The oracle side: with `ModelRuntime.feature_taps` set, a pass that returns
  hidden states appends each tapped layer's normalised input, on every pass
  path (eager layer by layer, the native stack run in parts, static, ragged),
  and the logits do not change.
- The draft side: taps fused as f + tap_fc(taps), tap_fc starting at zero, so
  a trained draft grown with taps computes what it did; predicted features
  (no taps) count as zero taps, in training's unrolled steps as at inference.
- Exactness: tree, chain and staged with a tapped draft emit `ar`'s tokens,
  with the drafts proven used, eager and static.
- Files and training: save/load keeps the taps, EAGLE-1 exports refuse them,
  `distill --feature-taps` trains tap_fc from zero and resumes to the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _exactness import assert_bit_identical, assert_drafts_used
from stagedspec.drafters.feature import FeatureDrafter, FeatureStage
from stagedspec.drafters.lookup import LookupDrafter
from stagedspec.errors import StagedSpecError
from stagedspec.generation import speculative_generate
from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.draft import CONFIG_NAME, save_draft
from stagedspec.models.draft_loading import load_draft
from stagedspec.models.feature_draft import FeatureDraftModel, oracle_taps, with_taps
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.ragged import Segment, forward_ragged
from stagedspec.models.transformer import init_random
from stagedspec.request import generate_ar
from stagedspec.runner import ModelOracle, set_pass_mode
from stagedspec.stages import StageDrafter
from stagedspec.training.distill import DistillConfig, distill
from stagedspec.training.feature import shift_features

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

TAPS = (1, 2)


def tiny(seed: int, layers: int = 4, vocab: int = 24, intermediate: int = 64) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=intermediate, max_position=256)
    return init_random(Transformer(cfg), seed=seed, std=0.3).eval()


def tapped_draft(oracle: Transformer, seed: int, head: list[int] | None = None) -> FeatureDraftModel:
    """An untrained tapped draft with every weight perturbed, tap_fc included, so it depends on the taps."""
    draft = FeatureDraftModel(oracle, 1, head, taps=TAPS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        draft.tap_fc.weight.add_(0.3 * torch.randn(draft.tap_fc.weight.shape, generator=g))
    return draft.eval()


def layer_inputs(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's normalised input in a plain causal pass, by forward hooks on the norms."""
    seen: list[torch.Tensor] = []
    hooks = [layer.attn_norm.register_forward_hook(lambda _m, _i, out: seen.append(out)) for layer in model.layers]
    try:
        with torch.no_grad():
            model(tokens, torch.arange(tokens.shape[1]), model.new_cache(tokens.shape[1]))
    finally:
        for h in hooks:
            h.remove()
    return seen


# ---------------------------------------------------------------------- the oracle's passes
def test_hidden_states_carry_the_tapped_layers_normalised_inputs() -> None:
    oracle = tiny(1)
    tokens = torch.randint(0, 24, (1, 9), generator=torch.Generator().manual_seed(1))
    inputs = layer_inputs(oracle, tokens)
    H = oracle.config.hidden_size
    with torch.no_grad():
        plain_logits, plain_h = oracle(tokens, torch.arange(9), oracle.new_cache(9), PassSpec(hidden="all"))
        with oracle_taps(oracle, TAPS):
            logits, h = oracle(tokens, torch.arange(9), oracle.new_cache(9), PassSpec(hidden="all"))
            rows_logits, rows_h = oracle(tokens, torch.arange(9), oracle.new_cache(9),
                                         PassSpec(hidden="rows", logits_rows=slice(-2, None)))
            no_hidden = oracle(tokens, torch.arange(9), oracle.new_cache(9))
    assert oracle.runtime.feature_taps == ()  # restored
    assert h.shape == (1, 9, H * 3) and rows_h.shape == (1, 2, H * 3)
    assert torch.equal(logits, plain_logits) and torch.equal(h[..., :H], plain_h) and torch.equal(no_hidden, logits)
    for i, t in enumerate(TAPS):
        torch.testing.assert_close(h[..., H * (i + 1):H * (i + 2)], inputs[t], rtol=0, atol=0)
    assert torch.equal(rows_h, h[:, -2:])
    torch.testing.assert_close(rows_logits, logits[:, -2:], rtol=1e-5, atol=1e-5)  # a 2-row head rounds its own way


def test_the_native_stack_runs_in_parts_with_the_same_bits(isa_kernels) -> None:  # noqa: ANN001
    """A quantised oracle's one-call stack, split at the taps: the same logits to the bit, and the taps equal
    the layer-by-layer path's."""
    from stagedspec.models.quant import quantize_model

    model = quantize_model(tiny(2, intermediate=64), "int4", torch.float32, isa_kernels)
    assert model.runtime.native_stack is not None
    tokens = torch.randint(0, 24, (1, 7), generator=torch.Generator().manual_seed(2))
    spec = PassSpec(hidden="all", tree_mask=torch.ones(7, 7, dtype=torch.bool).tril_())
    with torch.inference_mode():
        whole_logits, whole_h = model(tokens, torch.arange(7), model.new_cache(16), spec)
        with oracle_taps(model, TAPS):
            parts_logits, parts_h = model(tokens, torch.arange(7), model.new_cache(16), spec)
            stack, model.runtime.native_stack = model.runtime.native_stack, None
            by_layer_logits, by_layer_h = model(tokens, torch.arange(7), model.new_cache(16), spec)
            model.runtime.native_stack = stack
    H = model.config.hidden_size
    assert_bit_identical(parts_logits, whole_logits, f"{isa_kernels.name}: the stack in parts")
    assert_bit_identical(parts_h[..., :H], whole_h, f"{isa_kernels.name}: final features")
    assert_bit_identical(parts_h, by_layer_h, f"{isa_kernels.name}: taps, stack in parts against layer by layer")
    assert_bit_identical(by_layer_logits, whole_logits, f"{isa_kernels.name}: layer by layer")


def test_static_and_ragged_passes_carry_the_taps() -> None:
    oracle = tiny(3)
    T = 6
    tokens = torch.randint(0, 24, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), oracle_taps(oracle, TAPS):
        ref_logits, ref_h = oracle(tokens, torch.arange(T), oracle.new_cache(16), PassSpec(hidden="all"))
        cache = oracle.new_cache(16)
        mask = torch.zeros(T, cache.slots, dtype=torch.bool)
        mask[:, :T] = torch.ones(T, T, dtype=torch.bool).tril_()
        s_logits, s_h = oracle.forward_static(tokens, torch.arange(T), torch.arange(T), mask, cache,
                                              PassSpec(hidden="rows"))
        (r_logits, r_h), = forward_ragged(oracle, [Segment(tokens, torch.arange(T), oracle.new_cache(16),
                                                           PassSpec(hidden="all"))])
    torch.testing.assert_close(s_h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r_h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r_logits, ref_logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- the draft
def test_a_draft_grown_with_taps_computes_what_it_did_until_trained() -> None:
    oracle = tiny(4)
    draft = FeatureDraftModel(oracle, 1).eval()
    with torch.no_grad():
        for p in draft.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, 24, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, f = oracle(tokens, torch.arange(10), oracle.new_cache(10), PassSpec(hidden="all"))
        before = draft.unrolled_hidden(tokens, shift_features(f), 3)
        grown = with_taps(draft, oracle, TAPS)
        assert grown.feature_width == 3 * 32 and not grown.tap_fc.weight.any()
        with oracle_taps(oracle, TAPS):
            _, wide = oracle(tokens, torch.arange(10), oracle.new_cache(10), PassSpec(hidden="all"))
        after = grown.unrolled_hidden(tokens, shift_features(wide), 3)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    with pytest.raises(StagedSpecError, match="feature taps must be distinct layers in 1..3"):
        FeatureDraftModel(oracle, 1, taps=[0, 2])
    with pytest.raises(StagedSpecError, match="already reads taps"):
        with_taps(grown, oracle, [3])


def test_unrolled_steps_equal_chain_nodes_with_taps_at_the_root_only() -> None:
    """Step 0 reads the taps (the oracle's), steps j >= 1 read predicted features: zero taps, as a tree node."""
    oracle = tiny(5)
    draft = tapped_draft(oracle, 5)
    T, root = 12, 5
    tokens = torch.randint(0, 24, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with oracle_taps(oracle, TAPS):
            _, f = oracle(tokens, torch.arange(T), oracle.new_cache(T), PassSpec(hidden="all"))
        outs = draft.unrolled_hidden(tokens, shift_features(f), 3)
        cache = draft.new_cache(T)
        _, h = draft(tokens[:, :root + 1], torch.arange(root + 1), cache,
                     PassSpec(hidden="rows", features=shift_features(f)[:, :root + 1]))
        cache.commit()
        torch.testing.assert_close(h[0, -1], outs[0][0, root], rtol=1e-5, atol=1e-5)
        parent = h[0, -1]
        for j in (1, 2):
            _, h = draft(tokens[:, root + j:root + j + 1], torch.tensor([root + j]), cache,
                         PassSpec(hidden="rows", features=parent[None, None]))
            cache.commit()
            torch.testing.assert_close(h[0, 0], outs[j][0, root + j], rtol=1e-5, atol=1e-5)
            parent = h[0, 0]


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_tree_chain_and_staged_with_taps_greedy_equal_ar(mode: str) -> None:
    runs: dict[str, list] = {}
    for seed in range(4):
        oracle = tiny(10 + seed)
        set_pass_mode(oracle, mode)
        prompt = torch.randint(0, 24, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = generate_ar(oracle, prompt, max_new_tokens=40).token_ids
        draft = tapped_draft(oracle, seed, None if seed % 2 else list(range(0, 24, 2)))
        set_pass_mode(draft, mode)
        drafters = {
            "tree": FeatureDrafter(draft, tree_budget=8, max_depth=4, branching=2, max_len=300),
            "chain": FeatureDrafter(draft, method="chain", chain_length=4, max_len=300),
            "staged": StageDrafter(FeatureStage(draft, 300), LookupDrafter(None, True, chain_length=4),
                                   chain_length=3, branching=2),
        }
        for name, drafter in drafters.items():
            oracle_run = ModelOracle(oracle, 300)
            out = speculative_generate(oracle_run, drafter, prompt, max_new_tokens=40)
            assert out.token_ids == ref, f"seed {seed}, {name}, {mode} passes"
            assert oracle_run.committed_features.shape[-1] == 3 * 32  # the taps were recorded and read
            runs.setdefault(name, []).append(out)
    for name, outs in runs.items():
        assert_drafts_used(outs, f"{name} with taps ({mode} passes)")


# ---------------------------------------------------------------------- files and training
def test_save_load_keeps_the_taps_and_eagle_exports_refuse_them(tmp_path: Path) -> None:
    from stagedspec.export.eagle import check_exportable

    oracle = tiny(6)
    draft = tapped_draft(oracle, 6, list(range(0, 24, 3)))
    for dtype in ("int8", torch.float32):  # int8 codes of tap_fc, and fp32 for an exact comparison below
        save_draft(draft, tmp_path / "d", "fp", dtype=dtype)
        assert json.loads((tmp_path / "d" / CONFIG_NAME).read_text())["feature_taps"] == list(TAPS)
        loaded = load_draft(tmp_path / "d", oracle, expected_fingerprint="fp")
        assert loaded.feature_taps == TAPS
    feats = torch.randn(1, 3, 96)
    with torch.no_grad():
        a = draft(torch.tensor([[1, 2, 3]]), torch.arange(3), draft.new_cache(4), PassSpec(features=feats))
        b = loaded(torch.tensor([[1, 2, 3]]), torch.arange(3), loaded.new_cache(4), PassSpec(features=feats))
    assert torch.equal(a, b)
    with pytest.raises(StagedSpecError, match="read the final hidden state alone"):
        check_exportable(loaded, "eagle", approximate=True)
    cfg = json.loads((tmp_path / "d" / CONFIG_NAME).read_text())
    cfg["feature_taps"] = [9]
    (tmp_path / "d" / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(StagedSpecError, match="corrupt draft .*feature taps must be distinct layers"):
        load_draft(tmp_path / "d", oracle)


def test_distill_with_taps_trains_them_from_zero_and_resumes(tmp_path: Path) -> None:
    from stagedspec.sampling import SamplingParams
    from stagedspec.training.distill import oracle_continuation

    oracle = tiny(7, vocab=64)
    g = torch.Generator().manual_seed(1)
    corpus = [[i] + oracle_continuation(oracle, [i], 100, SamplingParams(temperature=1.0), g) for i in range(12)]

    def cfg(out: Path, **kw: object) -> DistillConfig:
        base = dict(kind="feature", layers=1, tokens=16 * 48, seq_len=16, batch_size=4, lr=3e-3, teacher_top_k=16,
                    eval_every=4, eval_windows=8, heldout_fraction=0.1, checkpoint_every=4, out=str(out),
                    fingerprint="fp", ttt_steps=2, feature_taps=[1, 2], save_dtype="float32")
        base.update(kw)
        return DistillConfig(**base)

    plain = distill(oracle, None, corpus, cfg(tmp_path / "plain", feature_taps=None), progress=False)
    straight = distill(oracle, None, corpus, cfg(tmp_path / "a", init_from=str(tmp_path / "plain"), tokens=16 * 24),
                       progress=False)
    assert straight.feature_taps == TAPS and straight.tap_fc.weight.abs().sum() > 0
    assert straight.training_meta["history"][0]["heldout_kl"] == pytest.approx(
        plain.training_meta["history"][-1]["heldout_kl"], rel=1e-4)  # grown with taps: the same draft at step 0
    assert oracle.runtime.feature_taps == ()
    distill(oracle, None, corpus, cfg(tmp_path / "b", init_from=str(tmp_path / "plain"), tokens=16 * 24),
            progress=False, stop_after_steps=2)
    resumed = distill(oracle, None, corpus, cfg(tmp_path / "b", init_from=str(tmp_path / "plain"), tokens=16 * 24),
                      resume=True, progress=False)
    for name, value in straight.own_state_dict().items():
        assert torch.equal(resumed.own_state_dict()[name], value), name
    with pytest.raises(StagedSpecError, match="feature taps apply to feature drafts only"):
        cfg(tmp_path / "c", kind="independent", ttt_steps=1)


def test_the_taps_fc_learns_at_its_own_rate() -> None:
    from stagedspec.training.distill import _param_groups

    oracle = tiny(8)
    draft = FeatureDraftModel(oracle, 1, taps=TAPS)
    params = draft.trainable_parameters()
    assert len(_param_groups(draft, params, 1.0)) == 1  # one rate for all: one group
    groups = _param_groups(draft, params, 0.5, 10.0)
    scales = {g["lr_scale"]: {id(p) for p in g["params"]} for g in groups}
    assert scales[5.0] == {id(draft.tap_fc.weight)} and scales[0.5] == {id(p) for p in draft.fc.parameters()}
    assert sum(len(g["params"]) for g in groups) == len(params)
