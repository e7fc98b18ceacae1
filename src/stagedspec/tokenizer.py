"""Text <-> token ids, chat templates and streaming detokenisation.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the fast Rust implementation) and
adds what a generator needs beyond ids: which ids end a reply, whether a BOS
is prepended, and the model's chat template.  It is built either from an
HF-format folder (`tokenizer.json` + `tokenizer_config.json`) or from the
metadata of a GGUF file, which stores the vocabulary and merges but no
`tokenizer.json`.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from stagedspec.errors import StagedSpecError, first_line
from stagedspec.tokenizer_spm import build_spm_tokenizer

IM_END = "<|im_end|>"
END_OF_TURN = "<end_of_turn>"  # Gemma's end of a chat turn
_MAX_HELD_TOKENS = 8

# How llama.cpp's `tokenizer.ggml.pre` names map onto a pre-tokenizer.  The
# StarCoder family (SmolLM, SmolLM2, ...) isolates every digit before the GPT-2
# split; Llama-3 and Qwen2 split with their own regex before the byte mapping.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell"}
_PLAIN_GPT2 = {"gpt-2", "gpt2", "default", ""}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_REGEX_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

# GGUF token types (llama.cpp's enum): control tokens are special, user-defined
# ones are added tokens that still appear in decoded text.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


class Tokenizer:
    """A model's tokenizer plus its generation conventions (BOS, EOS, chat template)."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self.inner = inner
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos and bos_token_id is not None
        self.eos_token_ids = _unique(list(eos_token_ids) + self._template_stop_ids())

    # ------------------------------------------------------------------ build
    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """Read `tokenizer.json` and the conventions spread over the HF side files.

        EOS ids are gathered from `tokenizer_config.json`, `generation_config.json`
        and `config.json`, because chat models often name a different stop token
        in each (e.g. `<|endoftext|>` in one, `<|im_end|>` in another) and a
        reply must end at any of them.
        """
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise StagedSpecError(f"no tokenizer.json in {folder}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust error type is not importable
            raise StagedSpecError(f"cannot read {tok_file}: {first_line(exc)}") from None
        tcfg = _read_json_if_exists(folder / "tokenizer_config.json")
        gen = _read_json_if_exists(folder / "generation_config.json")
        mcfg = _read_json_if_exists(folder / "config.json")

        template = tcfg.get("chat_template")
        if isinstance(template, list):  # several named templates: use the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        eos: list[int] = []
        eos += _ids_of(backend, [_token_content(tcfg.get("eos_token"))])
        eos += id_list(gen.get("eos_token_id")) + id_list(mcfg.get("eos_token_id"))
        eos += id_list(tcfg.get("stagedspec_eos_token_ids"))
        bos_ids = _ids_of(backend, [_token_content(tcfg.get("bos_token"))])
        bos = bos_ids[0] if bos_ids else first_id(mcfg.get("bos_token_id"))
        add_bos = tcfg.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(backend, bos)
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, chat_template=template, add_bos=bool(add_bos))

    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Rebuild the tokenizer from GGUF metadata (`tokenizer.ggml.*`).

        `tokenizer.ggml.model == "gpt2"` is byte-level BPE: the pre-tokenizer
        is chosen from `tokenizer.ggml.pre` so that text splits exactly as it
        did when the merges were learned (for SmolLM2: single digits, then the
        GPT-2 regex).  `"llama"` is a SentencePiece-style vocabulary with
        scores (Gemma, Llama-2): see `stagedspec.tokenizer_spm`.
        """
        meta = _GGUFMeta(reader)
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_spm(meta)
        if kind != "gpt2":
            raise StagedSpecError(
                f"cannot build the tokenizer: unsupported GGUF tokenizer type {kind!r} "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece-style)"
            )
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        merges: list[str] = meta.get("tokenizer.ggml.merges") or []
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        added = [
            AddedToken(tok, special=(t == _GGUF_CONTROL), normalized=False)
            for tok, t in zip(tokens, types)
            if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
        ]
        backend.add_tokens(added)  # ids already exist in the vocab, so they are kept
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = id_list(meta.get("tokenizer.ggml.eos_token_id")) + id_list(meta.get("tokenizer.ggml.eot_token_id"))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def _from_gguf_spm(cls, meta: "_GGUFMeta") -> "Tokenizer":
        """A SentencePiece-style GGUF vocabulary (tokens, scores, types; no merges)."""
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        backend = build_spm_tokenizer(
            tokens,
            meta.get("tokenizer.ggml.token_type"),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
        )
        eos = id_list(meta.get("tokenizer.ggml.eos_token_id")) + id_list(meta.get("tokenizer.ggml.eot_token_id"))
        # Gemma ends every turn with <end_of_turn>, and its own generation config stops there as well as at
        # <eos>; a GGUF records only one of them.
        eot = backend.token_to_id(END_OF_TURN)
        if eot is not None:
            eos.append(eot)
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),  # llama.cpp's default for this type
        )

    # ------------------------------------------------------------------ use
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (alias of `inner`)."""
        return self.inner

    def get_vocab(self) -> dict[str, int]:
        return self.inner.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) become their ids.

        A BOS id is prepended only when the model's tokenizer config asks for
        one and the text does not already begin with it (chat templates often
        write the BOS themselves).
        """
        ids = self.inner.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, prompt: str | list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's own Jinja template (sandboxed).

        A plain string is taken as one user message.  A model without a
        template gets a plain-string prompt back unchanged (base models are
        prompted with raw text); a message list needs a template.
        """
        if self.chat_template is None:
            if isinstance(prompt, str):
                return prompt
            raise StagedSpecError("this model has no chat template, so it cannot take a list of messages")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def save(self, folder: str | Path) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` that both we and transformers can load."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.inner.save(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
            "stagedspec_eos_token_ids": self.eos_token_ids,
        }
        if self.bos_token_id is not None:
            cfg["bos_token"] = self._token_text(self.bos_token_id)
        if self.eos_token_ids:
            cfg["eos_token"] = self._token_text(self.eos_token_ids[0])
            cfg["pad_token"] = cfg["eos_token"]
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")

    # ------------------------------------------------------------------ internals
    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.inner.id_to_token(token_id) or "")

    def _template_stop_ids(self) -> list[int]:
        """`<|im_end|>` ends a turn in ChatML templates, whatever the config calls EOS."""
        if self.chat_template and IM_END in self.chat_template:
            tid = self.inner.token_to_id(IM_END)
            if tid is not None:
                return [tid]
        return []


class StreamDecoder:
    """Turn a stream of token ids into text pieces as soon as they are complete.

    Decoding tokens one at a time is wrong in two ways: a multi-byte UTF-8
    character can be split over tokens (the partial text ends in U+FFFD), and
    some decoders treat the start of a sequence specially (leading-space
    stripping).  So each new piece is the difference between decoding a short
    window *with* and *without* the new tokens, and a piece ending in U+FFFD
    is held back until the character is complete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # window start: context for the next piece
        self._done = 0  # ids before this index have been emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        piece = self._pending_text()
        # A UTF-8 character spans at most 4 bytes, so a U+FFFD that survives
        # many more tokens is a genuinely invalid sequence: emit it rather
        # than hold the stream back forever.
        held = len(self._ids) - self._done
        if not piece or (piece.endswith("\ufffd") and held < _MAX_HELD_TOKENS):
            return ""
        self._start, self._done = self._done, len(self._ids)
        self._trim()
        return piece

    def flush(self) -> str:
        """Return whatever is still held back (even if incomplete) and reset."""
        piece = self._pending_text()
        self._ids, self._start, self._done = [], 0, 0
        return piece

    def _pending_text(self) -> str:
        dec = self.tokenizer.decode
        before = dec(self._ids[self._start : self._done], self.skip_special_tokens)
        after = dec(self._ids[self._start :], self.skip_special_tokens)
        return after[len(before) :]

    def _trim(self) -> None:
        """Drop ids that can no longer influence future pieces (keeps decoding O(1) per token)."""
        if self._start > 0:
            del self._ids[: self._start]
            self._done -= self._start
            self._start = 0


# Two fingerprints of a tokenizer's token -> id map.  Both identify the same thing, the vocabulary, but hash it
# in different encodings, so their values differ; each is recorded in files that outlive a process (drafts, the
# shipped ones included; n-gram files and their cache names), so neither encoding may change and neither can
# replace the other.


def tokenizer_fingerprint(tokenizer) -> str:  # noqa: ANN001 - any stagedspec Tokenizer
    r"""The first 16 hex digits of sha256 over "id\ttoken\n" lines in id order: what a distilled draft records.

    A draft's `draft_config.json` holds it (the shipped drafts in `assets/` included), `load_draft` compares it
    with the oracle's, `models.draft.bundled_draft_for` finds a shipped draft by it, and `distill`'s reply cache
    is keyed by it.  N-gram files record `vocab_fingerprint` instead."""
    vocab = tokenizer.inner.get_vocab() if hasattr(tokenizer, "inner") else tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode())
    return h.hexdigest()[:16]


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """sha256 (64 hex digits) of the JSON list of (token, id) pairs in id order: what an n-gram file records.

    An n-gram file is only valid for that exact map: `NgramModel.load` compares it, and the cached default
    n-gram's file name holds its first 12 digits (`drafters.ngram_files`).  Called with `tokenizer.get_vocab()`.
    Drafts record `tokenizer_fingerprint` instead."""
    items = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def render_chat_template(template: str, messages: list[dict[str, Any]], **context: Any) -> str:
    """Render an HF-style chat template in a sandboxed Jinja environment.

    The sandbox matters because templates ship inside downloaded model
    folders; `raise_exception` is the helper HF templates call to reject a
    conversation (e.g. roles out of order), surfaced here as a StagedSpecError.
    """
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise StagedSpecError(f"chat template rejected the conversation: {message}")

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(template).render(messages=messages, **context)
    except TemplateError as exc:
        raise StagedSpecError(f"chat template error: {first_line(exc)}") from None


# ---------------------------------------------------------------------- helpers
def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    name = (pre or "").lower()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if name in _PLAIN_GPT2:
        return byte_level
    if name in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
    raise StagedSpecError(f"unsupported GGUF pre-tokenizer {pre!r}")


class _GGUFMeta:
    """Typed access to a GGUFReader's key/value metadata."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise StagedSpecError(f"corrupt GGUF metadata {key!r}: {first_line(exc)}") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise StagedSpecError(f"GGUF file has no {key!r} metadata")
        return value


def _read_json_if_exists(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StagedSpecError(f"cannot read {path}: {first_line(exc)}") from None
    return data if isinstance(data, dict) else {}


def _token_content(tok: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _ids_of(backend: tokenizers.Tokenizer, tokens: list[str | None]) -> list[int]:
    ids = [backend.token_to_id(t) for t in tokens if t]
    return [i for i in ids if i is not None]


def id_list(value: Any) -> list[int]:
    """A config's token-id field (absent, one id, or a list of ids) as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def first_id(value: Any) -> int | None:
    """The first id of a config's token-id field, or None."""
    ids = id_list(value)
    return ids[0] if ids else None


def _unique(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def _post_processor_adds(backend: tokenizers.Tokenizer, bos: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (Llama-style), when the config does not say."""
    if bos is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == bos


