"""Quantised weights (`stagedspec.models.quant`): codes, row independence, loading and errors.

The real-model checks (the default GGUF's Q4_1 codes recovered, int4
speculation identical to int4 `ar`) are marked `real_model`.
"""

from __future__ import annotations

import pytest
import torch

from _exactness import assert_drafts_used
from stagedspec.errors import StagedSpecError
from stagedspec.models.config import ModelConfig
from stagedspec.kernels.native import native_kernels
from stagedspec.models.quant import INT4_GROUP, Int4Linear, Int8Linear, check_quant, quantize_model
from stagedspec.models.transformer import Transformer, init_random


def _q4_1_weight(out_f: int, in_f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight made the way Q4_1 makes one: per group of 32, offset = min and scale = (max - min) / 15,
    so every group holds codes 0 and 15.  Returns (weight, codes, scale per group)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_f // INT4_GROUP
    codes = torch.randint(0, 16, (out_f, groups, INT4_GROUP), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(out_f, groups, 1, generator=g) * 0.02 + 0.001).half().float()
    # a group's min is its offset; weights are roughly centred, so min ~ -7.5 scale
    offset = ((-7.5 + torch.randn(out_f, groups, 1, generator=g)) * scale).half().float()
    w = codes.float() * scale + offset
    return w.reshape(out_f, in_f), codes.reshape(out_f, in_f), scale.reshape(out_f, groups)


def test_int4_recovers_q4_1_codes() -> None:
    """Every value lands on its own code: the error is the bf16 rounding of scale and offset, far below a step."""
    w, _, scale = _q4_1_weight(64, 128)
    layer = Int4Linear(w, None)
    err = (layer.dequantized() - w).abs().reshape(64, -1, INT4_GROUP).amax(-1)
    assert (err < scale / 4).all()


def test_int4_and_int8_match_their_dequantised_weights() -> None:
    w = torch.randn(96, 64) * 0.05
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    for layer, tolerance in ((Int4Linear(w, None), 0.1), (Int8Linear(w, None), 0.01)):  # ~ half a step
        ref = x.float() @ layer.dequantized().t()
        assert torch.allclose(layer(x).float(), ref, atol=2e-2, rtol=2e-2)
        assert (layer.dequantized() - w).abs().max() < tolerance * w.abs().max()


@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear])
def test_quantised_rows_do_not_depend_on_their_neighbours(kind) -> None:  # noqa: ANN001
    """Speculation verifies k rows at once; each row must equal what a lone row would give, bit for bit."""
    layer = kind(torch.randn(256, 128) * 0.05, torch.randn(256) * 0.01)
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    full = layer(x)
    for start, rows in [(0, 1), (3, 2), (17, 5), (39, 1), (8, 32)]:
        assert torch.equal(layer(x[start:start + rows]), full[start:start + rows])


def _tiny_llama() -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=128, norm_eps=1e-5, rope_theta=10000.0,
                      tie_embeddings=True)
    return init_random(Transformer(cfg), seed=3).eval().requires_grad_(False)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_model_runs_and_streams_fewer_bytes(mode: str) -> None:
    ref = _tiny_llama()
    dense_bytes = ref.to(torch.bfloat16).num_bytes()
    model = quantize_model(_tiny_llama(), mode)
    assert model.head_q is not None and model.embed.weight.dtype == torch.bfloat16
    assert model.num_bytes() < dense_bytes
    ids = torch.tensor([[5, 9, 33, 2, 200]])
    with torch.inference_mode():
        logits = model(ids, torch.arange(5), model.new_cache(16))
        dense = ref(ids, torch.arange(5), ref.new_cache(16))
    assert logits.shape == (1, 5, 320)
    assert torch.corrcoef(torch.stack([logits.float().flatten(), dense.float().flatten()]))[0, 1] > 0.9


def test_bad_quant_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import stagedspec.models.quant as quant

    with pytest.raises(StagedSpecError, match="unknown quantisation"):
        check_quant("q3", torch.bfloat16, "cpu")
    with pytest.raises(StagedSpecError, match="bf16 or fp32"):
        check_quant("int4", torch.float16, "cpu")
    monkeypatch.setattr(quant, "native_kernels", lambda: None)  # PyTorch's fallback computes in bf16 only
    with pytest.raises(StagedSpecError, match="--dtype bf16"):
        check_quant("int4", torch.float32, "cpu")
    with pytest.raises(StagedSpecError, match="CPU kernels only"):
        check_quant("int8", torch.bfloat16, "cuda")
    check_quant("none", torch.float32, "cuda")


def test_cli_rejects_quant_with_fp32_on_the_fallback_kernels(capsys, monkeypatch) -> None:  # noqa: ANN001
    import stagedspec.models.quant as quant
    from stagedspec.cli import main

    monkeypatch.setattr(quant, "native_kernels", lambda: None)
    assert main(["generate", "hi", "--quant", "int4", "--dtype", "fp32"]) == 2
    assert "--dtype bf16" in capsys.readouterr().err


# --- the real default model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def int4_default():  # noqa: ANN201
    from stagedspec.models.loading import load_model

    return load_model("default", quant="int4")


@pytest.mark.real_model
def test_default_gguf_runs_on_its_own_q4_codes(int4_default) -> None:  # noqa: ANN001
    """The default model's Q4_1 layers come back as their GGUF codes: a quarter of the layer bytes."""
    import gguf

    from stagedspec.models.default import default_gguf_path

    model, _ = int4_default
    reader = gguf.GGUFReader(str(default_gguf_path()))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    blocks = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).float()  # [576, 1536]
    layer = model.layers[0].mlp.w_down
    assert isinstance(layer, Int4Linear)
    g = blocks.reshape(blocks.shape[0], -1, INT4_GROUP)
    step = ((g.amax(-1) - g.amin(-1)) / 15).clamp_min(1e-8)
    err = (layer.dequantized() - blocks).abs().reshape_as(g).amax(-1)
    assert (err < step / 4).all()
    assert model.num_bytes() < 100e6


@pytest.mark.real_model
@pytest.mark.parametrize("method, kw", [
    ("chain", dict(method="chain", chain_length=3)),
    ("lookup", dict(method="lookup", ngram=None, lookup_length=3)),
    ("staged", dict(method="staged", ngram=None, stage_length=2, tree_budget=3, lookup_length=2)),
    ("tree", dict(method="tree", tree_budget=6, tree_depth=3, tree_branching=2)),  # branches off the first-child chain
])
def test_int4_speculation_reproduces_int4_ar_bit_exact(int4_default, method: str, kw: dict) -> None:  # noqa: ANN001
    """Exactness is with respect to the int4 oracle; with `bit_exact` it is bit for bit, trees included.

    The draft is the shipped one, as `--draft default` loads it on an int4 oracle: the oracle's first two layers
    with a restricted head had none of its chains accepted on these prompts (the identity then tested nothing)."""
    from stagedspec.bench.prompts import chat_instruction, humaneval_prompts
    from stagedspec.pipeline import Pipeline, SpeculationConfig, load_draft_model

    model, tok = int4_default
    prompts = [tok.encode(tok.apply_chat_template(chat_instruction(p))) for p in humaneval_prompts(2)]
    ar = Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))
    ar.bit_exact = True
    draft = load_draft_model("default", model, tok, torch.bfloat16, "cpu")
    pipe = Pipeline(model, tok, [draft], SpeculationConfig(**kw))
    pipe.bit_exact = True
    runs = []
    for ids in prompts[:1] if method == "tree" else prompts:  # a tree: one prompt (~25 s on two busy cores)
        runs.append(pipe.generate(ids, max_new_tokens=40))
        assert runs[-1].token_ids == ar.generate(ids, max_new_tokens=40).token_ids
    assert_drafts_used(runs, f"{method} on int4")


@pytest.mark.real_model
def test_cli_staged_on_int4_with_the_shipped_draft(capsys) -> None:  # noqa: ANN001
    """The main job's command: a saved (bf16) draft loads on top of a quantised oracle, and with
    --bit-exact the output is int4 `ar`'s.  Its sizes are named (fixed sizing): measured sizes chose `ar` on
    every step of this 24-token reply, and the identity would then have compared `ar` with `ar`."""
    import json

    from stagedspec.cli import main

    common = ["generate", "Write a function that reverses a string.", "--chat", "--quant", "int4", "--bit-exact",
              "--max-new-tokens", "24", "--json"]
    assert main([*common, "--method", "staged", "--draft", "default", "--stage-length", "3"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert staged["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) > 0
    assert_drafts_used(staged, "staged on int4 (CLI)")


def test_dequantized_copy_gives_float_layers() -> None:
    from torch import nn

    from stagedspec.models.quant import dequantized_copy

    model = quantize_model(_tiny_llama(), "int4")
    block = dequantized_copy(model.layers[0])
    assert isinstance(block.attn.wqkv, nn.Linear) and isinstance(model.layers[0].attn.wqkv, Int4Linear)
    assert torch.equal(block.attn.wqkv.weight.float(), model.layers[0].attn.wqkv.dequantized().to(torch.bfloat16).float())


def test_quantize_draft_makes_an_int8_draft_that_streams_fewer_bytes() -> None:
    from stagedspec.models.draft import DraftModel
    from stagedspec.models.quant import quantize_draft

    oracle = quantize_model(_tiny_llama(), "int4")
    draft = DraftModel(oracle, layers=[0], head_tokens=torch.arange(64)).eval().requires_grad_(False)
    before = draft.num_bytes()
    quantize_draft(draft, oracle)
    assert isinstance(draft.layers[0].mlp.w_up, Int8Linear) and isinstance(draft.head_q, Int8Linear)
    assert draft.num_bytes() < before
    with torch.inference_mode():
        logits = draft(torch.tensor([[5, 9]]), torch.arange(2), draft.new_cache(8))
    assert logits.shape == (1, 2, 320) and torch.isinf(logits[0, 0, 64:]).all()  # the restricted head, expanded


def test_a_feature_draft_runs_its_rows_of_the_oracles_head_as_int4() -> None:
    """A head of the oracle's own rows (`--head-from-oracle`) is the biggest part of a feature draft's pass: on
    the native kernels `quantize_draft` keeps it in int4, the rest of the draft in int8."""
    from stagedspec.models.feature_draft import FeatureDraftModel
    from stagedspec.models.quant import quantize_draft

    oracle = quantize_model(_tiny_llama(), "int4")
    draft = FeatureDraftModel(oracle, 1, torch.arange(0, 320, 2), head_from_oracle=True).eval().requires_grad_(False)
    rows = draft.head.weight.detach().float().clone()
    quantize_draft(draft, oracle)
    head_type = Int4Linear if native_kernels() is not None else Int8Linear
    assert isinstance(draft.head_q, head_type) and isinstance(draft.layers[0].mlp.w_up, Int8Linear)
    assert (draft.head_q.dequantized() - rows).abs().max() <= rows.abs().max() / 7  # a 4-bit grid per group of 32
    with torch.inference_mode():
        logits = draft(torch.tensor([[5, 9]]), torch.arange(2), draft.new_cache(8))
    assert logits.shape == (1, 2, 320) and torch.isinf(logits[0, 0, 1::2]).all()  # the oracle's rows, expanded


@pytest.mark.real_model
def test_library_callers_may_ask_for_auto_quantisation() -> None:
    """`quant="auto"` means what `--quant auto` means: the default GGUF runs quantised on a CPU."""
    from stagedspec.models.loading import load_model
    from stagedspec.models.quant import describe_weights, resolve_quant

    assert resolve_quant("auto", "default", "cuda") == "none"
    model, _ = load_model("default", dtype=torch.bfloat16, quant="auto")
    assert describe_weights(model).startswith("int4 x 120 layers")
