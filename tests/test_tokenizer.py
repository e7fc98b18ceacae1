"""Tokenizer: GGUF reconstruction, HF folders, chat templates, streaming detokenisation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _tiny_models import CHATML, make_hf_model, save_tiny_gguf, write_tiny_tokenizer
from stagedspec.errors import StagedSpecError
from stagedspec.tokenizer import StreamDecoder, Tokenizer, render_chat_template

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)  # O(2**n)\n",
    "The quick brown fox jumps over the lazy dog. It's 3.14159 and 1,000,000 people didn't agree!",
    "  leading  spaces,\ttabs\t\tand\n\n\nnewlines   ",
    "Café naïve résumé — 你好，世界 😀👍🏽 Ω≈ç√",
    "<|im_start|>user\nhi<|im_end|>\n",
]


# ---------------------------------------------------------------------- tiny, no real model
@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def tiny_gguf_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from gguf import GGUFReader

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    save_tiny_gguf(make_hf_model("llama_gqa"), path)
    return Tokenizer.from_gguf(GGUFReader(str(path)))


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_round_trip_and_gguf_agrees_with_folder(tiny_tok: Tokenizer, tiny_gguf_tok: Tokenizer, text: str) -> None:
    ids = tiny_tok.encode(text)
    assert tiny_tok.decode(ids) == text
    assert tiny_gguf_tok.encode(text) == ids


def test_special_tokens_and_conventions(tiny_tok: Tokenizer, tiny_gguf_tok: Tokenizer) -> None:
    for tok in (tiny_tok, tiny_gguf_tok):
        assert tok.encode("<|im_start|>") == [1]
        assert tok.bos_token_id == 1 and not tok.add_bos
        # EOS from the config first, then <|im_end|> because the ChatML template ends turns with it.
        assert tok.eos_token_ids == [0, 2]
        assert tok.decode([1, 2], skip_special_tokens=True) == ""


def test_digits_are_split_individually(tiny_gguf_tok: Tokenizer) -> None:
    pieces = [tiny_gguf_tok.decode([i]) for i in tiny_gguf_tok.encode("x 2024")]
    assert pieces == ["x", " ", "2", "0", "2", "4"]


def test_bos_is_prepended_only_when_configured(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.encode("hi")[0] == 1
    assert tok.encode("<|im_start|>hi").count(1) == 1  # a template that writes BOS itself: no double BOS


def test_bos_from_post_processor_when_config_is_silent(tmp_path: Path) -> None:
    """Llama-style tokenizer.json adds BOS in its post-processor; without `add_bos_token` we follow it."""
    from tokenizers import processors

    from _tiny_models import tiny_tokenizer

    inner = tiny_tokenizer()
    inner.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.add_bos and tok.encode("hi")[0] == 1 and tok.encode("hi").count(1) == 1


def test_save_and_reload(tiny_gguf_tok: Tokenizer, tmp_path: Path) -> None:
    tiny_gguf_tok.save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    assert again.encode(TEXTS[0]) == tiny_gguf_tok.encode(TEXTS[0])
    assert again.eos_token_ids == tiny_gguf_tok.eos_token_ids
    assert again.chat_template == tiny_gguf_tok.chat_template
    assert again.bos_token_id == tiny_gguf_tok.bos_token_id


def test_chat_template_rendering(tiny_tok: Tokenizer) -> None:
    assert tiny_tok.apply_chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = tiny_tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert out == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_template_raise_exception_and_sandbox() -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    with pytest.raises(StagedSpecError, match="first message must be user"):
        render_chat_template(strict, [{"role": "system", "content": "x"}])
    with pytest.raises(StagedSpecError, match="chat template error"):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(StagedSpecError, match="chat template error"):
        render_chat_template("{% for %}", [])


def test_model_without_template(tiny_tok: Tokenizer) -> None:
    bare = Tokenizer(tiny_tok.inner, eos_token_ids=[0])
    assert bare.apply_chat_template("raw prompt") == "raw prompt"
    with pytest.raises(StagedSpecError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_corrupt_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(StagedSpecError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(StagedSpecError, match="cannot read"):
        Tokenizer.from_folder(tmp_path)


def test_chat_template_jinja_file_is_used(tmp_path: Path) -> None:
    """transformers 5 saves the template as chat_template.jinja rather than in tokenizer_config.json."""
    write_tiny_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert Tokenizer.from_folder(tmp_path).chat_template == CHATML


# ---------------------------------------------------------------------- streaming
def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    return pieces + [dec.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_reassembles_text(tiny_tok: Tokenizer, text: str) -> None:
    pieces = _stream(tiny_tok, tiny_tok.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_back_partial_utf8(tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.encode("😀")  # four byte tokens for one character
    assert len(ids) == 4
    pieces = _stream(tiny_tok, ids)
    assert pieces[:3] == ["", "", ""] and pieces[3] == "😀" and pieces[4] == ""


def test_stream_decoder_does_not_hold_invalid_bytes_forever(tiny_tok: Tokenizer) -> None:
    lone = tiny_tok.encode("😀")[1]  # a continuation byte alone is never valid UTF-8
    dec = StreamDecoder(tiny_tok)
    pieces = [dec.push(lone) for _ in range(10)]
    assert any(pieces)
    assert "".join(pieces) + dec.flush() == "\ufffd" * 10


def test_stream_decoder_flush_returns_incomplete_tail(tiny_tok: Tokenizer) -> None:
    dec = StreamDecoder(tiny_tok)
    ids = tiny_tok.encode("a😀")
    assert dec.push(ids[0]) == "a"
    assert dec.push(ids[1]) == ""
    assert dec.flush() == "\ufffd"


# ---------------------------------------------------------------------- the real SmolLM2 tokenizer
@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    from stagedspec.models.default import default_model_dir

    return Tokenizer.from_folder(default_model_dir())


@pytest.mark.real_model
def test_smollm2_known_ids_and_conventions(smol: Tokenizer) -> None:
    # Anchors checked against transformers' own GGUF tokenizer conversion.
    assert smol.encode("<|im_start|>user\nhi<|im_end|>\n") == [1, 4093, 198, 6004, 2, 198]
    assert smol.encode(" 12345") == [216, 33, 34, 35, 36, 37]  # single digits, space on its own
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_ids, smol.add_bos) == (1, [2], False)
    rendered = smol.apply_chat_template("hi")
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip_and_stream(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    assert "".join(_stream(smol, ids)) == text


@pytest.mark.real_model
def test_smollm2_gguf_tokenizer_equals_cached_folder(smol: Tokenizer) -> None:
    from gguf import GGUFReader

    from stagedspec.models.default import default_gguf_path

    from_gguf = Tokenizer.from_gguf(GGUFReader(str(default_gguf_path())))
    for text in TEXTS:
        assert from_gguf.encode(text) == smol.encode(text)
    assert from_gguf.eos_token_ids == smol.eos_token_ids and from_gguf.chat_template == smol.chat_template


@pytest.mark.real_model
def test_smollm2_matches_transformers_on_cached_folder(smol: Tokenizer) -> None:
    """transformers reading our tokenizer.json/tokenizer_config.json agrees (what reference tests rely on)."""
    from transformers import AutoTokenizer

    from stagedspec.models.default import default_model_dir

    ref = AutoTokenizer.from_pretrained(default_model_dir())
    for text in TEXTS:
        assert smol.encode(text) == ref.encode(text, add_special_tokens=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert smol.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_tokenizer(smol: Tokenizer) -> None:
    """An independent rebuild: transformers' converter of the GGUF vocabulary (slow: ~10 s)."""
    from transformers import AutoTokenizer

    from stagedspec.models.default import default_gguf_path

    path = default_gguf_path()
    try:
        ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - unsupported in this transformers install
        pytest.skip(f"transformers cannot build a tokenizer from this GGUF: {exc}")
    for text in TEXTS:
        assert smol.encode(text) == ref.encode(text, add_special_tokens=False)
