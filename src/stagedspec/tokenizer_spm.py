"""SentencePiece-style vocabularies from GGUF metadata (`tokenizer.ggml.model == "llama"`), e.g. Gemma's.

A GGUF stores such a vocabulary as tokens, scores and token types, but no
merges.  SentencePiece's BPE encodes by repeatedly joining the adjacent pair
whose joined piece has the best score; the `tokenizers` library's BPE joins
the pair with the best *merge rank*.  So the merges are rebuilt from the
vocabulary: every way to cut a piece into two pieces that are themselves in
the vocabulary is a merge, ranked by the joined piece's rank.  For Gemma the
rank is the token's position in the file (its scores fall with the id for
ordinary tokens, but not for its added ones).

Details that matter for agreeing with the reference tokenizer:
- spaces are written as "▁" (U+2581) by a normalizer, with no space in
  front of the text unless the file asks for one (`add_space_prefix`);
- byte tokens `<0x..>` back any character the vocabulary lacks (byte
  fallback), and the decoder fuses them back into UTF-8;
- Gemma stores its runs of spaces ("  ", "   ", ...) with real spaces and
  marks them user-defined; they are spelled with "▁" here, so they are
  reached by merges like any other piece (as in the HF tokenizer);
- control tokens (`<bos>`, `<start_of_turn>`, ...) are special; other
  user-defined tokens ("\\n\\n", ...) are matched whole in the text.
"""

from __future__ import annotations

from typing import Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

from stagedspec.errors import StagedSpecError

SPACE = "\u2581"
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def build_spm_tokenizer(
    tokens: Sequence[str], types: Sequence[int] | None, *, add_space_prefix: bool, unk_id: int | None
) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the SentencePiece BPE model these tokens describe."""
    if not tokens:
        raise StagedSpecError("cannot build the tokenizer: the GGUF vocabulary is empty")
    types = list(types) if types is not None else [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise StagedSpecError(
            f"cannot build the tokenizer: {len(tokens)} GGUF tokens but {len(types)} token types"
        )
    pieces = [_spell(tok, t) for tok, t in zip(tokens, types)]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)  # a duplicate spelling keeps its first id, like SentencePiece
    if not any(t == _BYTE for t in types):
        raise StagedSpecError("cannot build the tokenizer: the GGUF vocabulary has no <0x..> byte tokens")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    bpe = models.BPE(vocab=vocab, merges=_merges(pieces, types, vocab), unk_token=unk, fuse_unk=True,
                     byte_fallback=True)
    backend = tokenizers.Tokenizer(bpe)
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [
        AddedToken(piece, special=(t == _CONTROL), normalized=False)
        for piece, t in zip(pieces, types)
        if t == _CONTROL or (t == _USER_DEFINED and SPACE not in piece)
    ]
    backend.add_tokens(added)  # they are in the vocabulary already, so their ids are kept
    return backend


def _spell(token: str, kind: int) -> str:
    """The piece as the BPE model sees it: a user-defined run of spaces is spelled with '▁'."""
    if kind == _USER_DEFINED and token and not token.strip(" "):
        return SPACE * len(token)
    return token


def _merges(pieces: list[str], types: list[int], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) cut of a normal piece into two vocabulary pieces, best joined piece first.

    Among cuts of the same piece, longer left parts come first (only the
    order between merges that can both apply matters, which is rare).
    """
    ranked: list[tuple[int, int, str, str]] = []
    for rank, (piece, kind) in enumerate(zip(pieces, types)):
        if kind not in (_NORMAL, _USER_DEFINED) or len(piece) < 2 or vocab.get(piece) != rank:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((rank, -cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]
