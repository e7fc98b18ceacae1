"""`stagedspec export`: drafts written for transformers (hf) and vLLM (eagle, speculators).

The hf export must propose exactly what the native draft proposes (top-1 on the same inputs, 100%)
and, as transformers' assistant, leave greedy output token-identical.  The EAGLE layouts are checked
against the formats as read in their sources (commits named in `stagedspec.export.eagle`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stagedspec.cli import main
from stagedspec.models.draft import DraftModel, save_draft
from stagedspec.models.feature_draft import feature_draft_from
from stagedspec.models.loading import load_model
from stagedspec.tokenizer import tokenizer_fingerprint
from tests._tiny_models import save_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Move every own weight off its copied value, so a dropped or swapped tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _tiny_pair(tmp: Path, kind: str = "llama_gqa", feature: bool = False) -> tuple[Path, Path]:
    """(oracle folder, saved draft folder): a 1-layer draft with a restricted head of 97 tokens."""
    oracle_dir = tmp / f"oracle-{kind}"
    save_tiny_hf(kind, oracle_dir, seed=3)
    oracle, tok = load_model(str(oracle_dir), dtype=torch.float32)
    head = sorted(torch.randperm(oracle.config.vocab_size, generator=torch.Generator().manual_seed(1))[:97].tolist())
    draft = DraftModel(oracle, [1], head_tokens=head, dtype=torch.float32)
    _perturb(draft, 7)
    if feature:
        draft = feature_draft_from(draft, oracle)
        _perturb(draft, 8)
    draft_dir = tmp / ("feature-draft" if feature else "draft") / kind
    save_draft(draft.eval(), draft_dir, tokenizer_fingerprint(tok), dtype=torch.float32)
    return oracle_dir, draft_dir


def _export(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    rc = main(["export", *argv])
    return rc, capsys.readouterr().err


def _native(draft_dir: Path, oracle_dir: Path) -> DraftModel:
    from stagedspec.export.common import load_for_export

    return load_for_export(str(draft_dir), str(oracle_dir))[2]


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2"])
def test_hf_export_proposes_what_the_native_draft_proposes(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           kind: str) -> None:
    from transformers import AutoModelForCausalLM

    oracle_dir, draft_dir = _tiny_pair(tmp_path, kind)
    out = tmp_path / "hf"
    rc, err = _export(capsys, str(draft_dir), "--oracle", str(oracle_dir), "--format", "hf", "--out", str(out),
                      "--dtype", "fp32")
    assert rc == 0, err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(exported).__name__ == ("Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM")
    native = _native(draft_dir, oracle_dir)
    tokens = torch.randint(0, native.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = exported(tokens).logits
        ours = native.forward_train(tokens)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))  # 160 positions, 100%
    restricted = native.head_tokens
    assert torch.allclose(theirs[..., restricted], ours[..., restricted], atol=1e-4)
    assert bool(torch.isin(theirs.argmax(-1), restricted).all())


def test_hf_export_as_transformers_assistant_keeps_greedy_output(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    oracle_dir, draft_dir = _tiny_pair(tmp_path)
    out = tmp_path / "hf"
    assert _export(capsys, str(draft_dir), "--oracle", str(oracle_dir), "--format", "hf", "--out", str(out),
                   "--dtype", "fp32")[0] == 0
    oracle = AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    plain = oracle.generate(prompt, **kw)
    assisted = oracle.generate(prompt, assistant_model=assistant, **kw)
    assert plain.shape[1] == prompt.shape[1] + 24
    assert torch.equal(plain, assisted)


def _one_line_error(rc: int, err: str) -> str:
    assert rc == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stagedspec: error: "), err
    return lines[0]


def test_refuses_what_cannot_be_exported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    oracle_dir, draft_dir = _tiny_pair(tmp_path)
    _, feature_dir = _tiny_pair(tmp_path, feature=True)
    gemma_dir = tmp_path / "gemma"
    save_tiny_hf("gemma3", gemma_dir)
    cases = [
        (["layers:1", "--oracle", str(oracle_dir), "--format", "hf"], "oracle's own first layers"),
        ([str(draft_dir), "--oracle", str(gemma_dir), "--format", "hf"], "gemma3 oracle cannot be exported"),
        ([str(feature_dir), "--oracle", str(oracle_dir), "--format", "hf"], "--format eagle"),
        ([str(draft_dir), "--oracle", str(oracle_dir), "--format", "eagle"], "export it with --format hf"),
        ([str(feature_dir), "--oracle", str(oracle_dir), "--format", "eagle"], "--approximate"),
        ([str(feature_dir), "--oracle", str(oracle_dir), "--format", "speculators"], "--approximate"),
    ]
    capsys.readouterr()  # the tiny checkpoints' save progress bars
    for i, (argv, why) in enumerate(cases):
        out = tmp_path / f"refused-{i}"
        line = _one_line_error(*_export(capsys, *argv, "--out", str(out)))
        assert why in line, line
        assert not out.exists()  # refused before anything was written
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    line = _one_line_error(*_export(capsys, str(draft_dir), "--oracle", str(oracle_dir), "--format", "hf",
                                    "--out", str(taken)))
    assert "not an empty folder" in line


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_eagle_layout_matches_vllm_llama_eagle(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The names and shapes vLLM's `EagleLlamaForCausalLM` (llama_eagle.py at the named commit) loads."""
    from transformers import AutoConfig

    oracle_dir, feature_dir = _tiny_pair(tmp_path, feature=True)
    out = tmp_path / "eagle"
    rc, err = _export(capsys, str(feature_dir), "--oracle", str(oracle_dir), "--format", "eagle", "--out", str(out),
                      "--approximate", "--dtype", "fp32")
    assert rc == 0, err
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"] and cfg.num_hidden_layers == 1
    H, V = cfg.hidden_size, cfg.vocab_size
    D = cfg.head_dim
    t = _tensors(out / "model.safetensors")
    # vLLM's EAGLE LlamaModel: fc without bias, layer 0 without input_layernorm, no final norm; embed shared
    want = {"fc.weight": (H, 2 * H), "lm_head.weight": (V, H),
            "layers.0.post_attention_layernorm.weight": (H,),
            "layers.0.self_attn.q_proj.weight": (cfg.num_attention_heads * D, H),
            "layers.0.self_attn.k_proj.weight": (cfg.num_key_value_heads * D, H),
            "layers.0.self_attn.v_proj.weight": (cfg.num_key_value_heads * D, H),
            "layers.0.self_attn.o_proj.weight": (H, cfg.num_attention_heads * D),
            "layers.0.mlp.gate_proj.weight": (cfg.intermediate_size, H),
            "layers.0.mlp.up_proj.weight": (cfg.intermediate_size, H),
            "layers.0.mlp.down_proj.weight": (H, cfg.intermediate_size)}
    assert {k: tuple(v.shape) for k, v in t.items()} == want
    native = _native(feature_dir, oracle_dir)
    # concat order: vLLM's fc reads (embedding, hidden); ours (feature, embedding)
    assert torch.equal(t["fc.weight"][:, :H], native.fc.weight[:, H:])
    assert json.loads((out / "config.json").read_text())["stagedspec_export"]["approximate"]


def check_speculators_eagle_config(cfg: dict) -> None:
    """The EAGLE speculator config schema as read in vllm-project/speculators@1c2e0435
    (`EagleSpeculatorConfig`, `SpeculatorsConfig`, `VerifierConfig`, `GreedyTokenProposalConfig`), plus
    what vLLM's reader (speculators/base.py @ 94699746) requires."""
    assert cfg["speculators_model_type"] == "eagle"
    assert isinstance(cfg["speculators_version"], str)
    assert isinstance(cfg["architectures"], list) and "EagleSpeculator" in cfg["architectures"]
    assert cfg["transformer_layer_architecture"] in cfg["architectures"]
    layer = cfg["transformer_layer_config"]
    assert isinstance(layer, dict) and layer["model_type"] in ("llama", "qwen2")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert isinstance(layer[key], int) and layer[key] > 0
    assert isinstance(cfg["layernorms"], bool) and isinstance(cfg["fusion_bias"], bool)
    spec = cfg["speculators_config"]
    assert isinstance(spec["algorithm"], str)
    methods = spec["proposal_methods"]
    assert isinstance(methods, list) and methods
    for m in methods:
        assert m["proposal_type"] == "greedy"
        assert isinstance(m["speculative_tokens"], int) and m["speculative_tokens"] >= 1
        assert isinstance(m.get("verifier_accept_k", 1), int) and m.get("verifier_accept_k", 1) >= 1
        assert float(m.get("accept_tolerance", 0.0)) >= 0.0
    assert spec["default_proposal_method"] in [m["proposal_type"] for m in methods]
    verifier = spec["verifier"]
    assert isinstance(verifier["name_or_path"], str)
    assert isinstance(verifier["architectures"], list) and all(isinstance(a, str) for a in verifier["architectures"])


def test_speculators_config_and_weights(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    oracle_dir, feature_dir = _tiny_pair(tmp_path, feature=True)
    out = tmp_path / "speculators"
    rc, err = _export(capsys, str(feature_dir), "--oracle", str(oracle_dir), "--format", "speculators",
                      "--out", str(out), "--approximate", "--speculative-tokens", "3", "--verifier", "tiny/llama")
    assert rc == 0, err
    cfg = json.loads((out / "config.json").read_text())
    check_speculators_eagle_config(cfg)
    assert cfg["layernorms"] is True and cfg["fusion_bias"] is True
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]}
    names = set(_tensors(out / "model.safetensors"))
    # EagleSpeculator's own modules (embedding and head come from the verifier and are not saved)
    assert {"embedding_layernorm.weight", "fusion_fc.weight", "fusion_fc.bias", "pre_lm_head_layernorm.weight",
            "transformer.input_layernorm.weight", "transformer.self_attn.q_proj.weight",
            "transformer.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "layers.")) for n in names)
    with pytest.raises(AssertionError):
        check_speculators_eagle_config({**cfg, "speculators_config": {**cfg["speculators_config"],
                                                                      "default_proposal_method": "tree"}})


@pytest.mark.real_model
def test_real_default_draft_hf_export_top1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The shipped draft, exported: its top-1 proposals equal the native draft's on a code prompt (fp32)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    rc, err = _export(capsys, "default", "--format", "hf", "--out", str(out), "--dtype", "fp32")
    assert rc == 0, err
    from stagedspec.export.common import load_for_export

    _, tok, native = load_for_export("default", "default")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    text = ("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
            "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other than\n"
            "    given threshold.\n    \"\"\"\n    for idx, elem in enumerate(numbers):\n"
            "        for idx2, elem2 in enumerate(numbers):\n            if idx != idx2:\n"
            "                distance = abs(elem - elem2)\n                if distance < threshold:\n"
            "                    return True\n\n    return False\n")
    tokens = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits.argmax(-1), native.forward_train(tokens).argmax(-1))
