"""Stop strings: the one rule that the CLI, the library and the server all apply.

The rule: the output is the generated text cut where the earliest stop string
begins, whichever of the stop strings that is and wherever it sits in the
list.  With stops ["b", "a"] the text "xab" gives "x", the same as with
["a", "b"].  Two stop strings that begin at the same position cut at the same
place, so no tie needs breaking.  The text the decoder releases only at the end
of a generation (its final flush) is held to the same rule as every other piece.

Why one module: the same request must give the same text through every
surface.  Two copies of the rule drift apart in exactly the cases that are hard
to see (a cut at the first stop in list order instead of the earliest one, a
final flush left unchecked), and the CLI and the server then disagree.

Why the text is held back while streaming: a piece that could still be the
beginning of a stop string may be taken back by the tokens that follow, and a
client must never receive text that the rule later removes.  Text is released
as soon as no stop string can begin in it, and no later: the streamed pieces
are then always a prefix of the final output, and join up to exactly it.

Empty stop strings are refused (`StagedSpecError`): an empty string occurs
everywhere, so it would cut every output to nothing.
"""

from __future__ import annotations

from typing import Sequence

from stagedspec.errors import StagedSpecError
from stagedspec.tokenizer import StreamDecoder, Tokenizer


def checked_stops(stops: Sequence[str]) -> list[str]:
    """`stops` as a list, or a one-line `StagedSpecError` if one is empty or not a string."""
    out = list(stops)
    for s in out:
        if not isinstance(s, str):
            raise StagedSpecError(f"a stop string must be a string, got {type(s).__name__}")
        if not s:
            raise StagedSpecError("stop strings must not be empty (an empty one would match before any text)")
    return out


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string begins in `text` (None: none occurs); the list order plays no part."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The whole-text form of the rule: (`text` cut at its earliest stop string, whether one was found)."""
    cut = first_stop(text, checked_stops(stops))
    return (text, False) if cut is None else (text[:cut], True)


class StopCutter:
    """The rule applied to text that arrives in pieces; `push` returns what is decided, `finish` the rest.

    What it holds back is the shortest end of the text that still decides the cut: from the earliest
    position at which the text so far is the start of a stop string that has not arrived whole.  A
    stop string found whole is acted on only when no stop string that is still arriving could begin
    before it (stops ["abcd", "c"] on "abc": the "c" waits, since a "d" next would put the cut at the
    "a"), so the streamed cut is always the one the whole text would get.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = checked_stops(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""  # received, not yet released: it could still be (part of) a stop string
        self.stopped = False  # a stop string decided the cut; nothing more is released

    def push(self, text: str) -> str:
        """Add `text`; return the text this makes final (maybe empty).  Sets `stopped` once the cut is decided."""
        if self.stopped:
            return ""
        self._held += text
        cut = first_stop(self._held, self._stops)
        end = len(self._held) if cut is None else cut
        open_at = self._open_start(end)
        if cut is not None and open_at is None:
            out, self._held, self.stopped = self._held[:cut], "", True
            return out
        split = end if open_at is None else open_at
        out, self._held = self._held[:split], self._held[split:]
        return out

    def finish(self, text: str = "") -> str:
        """Add the last `text` (a decoder's final flush) and return everything still to be released, cut by the rule."""
        if self.stopped:
            return ""
        held, self._held = self._held + text, ""
        cut = first_stop(held, self._stops)
        if cut is None:
            return held
        self.stopped = True
        return held[:cut]

    def _open_start(self, end: int) -> int | None:
        """The earliest position before `end` from which the held text is the start of a longer stop string.

        Only the last `longest - 1` characters can start such a stop string, so only they are looked at."""
        n = len(self._held)
        for p in range(max(0, n - self._longest + 1), end):
            tail = self._held[p:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return p
        return None


class StopTextStream:
    """Token ids in, decided text out: a `StreamDecoder` (complete characters only) feeding a `StopCutter`.

    The server feeds it one scheduler step at a time and `Pipeline.generate` one accepted step at a
    time; both call `finish` at the end, which checks the decoder's final flush against the stop strings
    too (a character held back as incomplete can be the last of a stop string)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self._decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
        self._cutter = StopCutter(stops)

    @property
    def stopped(self) -> bool:
        """A stop string decided the cut; nothing more is emitted."""
        return self._cutter.stopped

    def push(self, tokens: Sequence[int]) -> str:
        """The text these tokens make final (maybe empty); sets `stopped` once a stop string decides the cut."""
        if self.stopped:
            return ""
        return self._cutter.push("".join(self._decoder.push(t) for t in tokens))

    def finish(self) -> str:
        """Whatever is still held back at the end of the generation, the decoder's flush included, cut by the rule."""
        if self.stopped:
            return ""
        return self._cutter.finish(self._decoder.flush())
