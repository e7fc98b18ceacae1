"""Token ids -> text pieces for a stream, cut at the first stop string.

A piece that could still be the start of a stop string is held back until
the next tokens decide it, so a client never sees text that a stop string
later takes back.  (The same rule as `Pipeline.generate`, kept here as an
object because the server feeds it one scheduler step at a time.)
"""

from __future__ import annotations

from typing import Sequence

from stagedspec.tokenizer import StreamDecoder


class StopTextStream:
    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()) -> None:  # noqa: ANN001 - Tokenizer
        self._decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
        self._stops = list(stop_strings)
        self._keep = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self.stopped = False  # a stop string was found; nothing more is emitted

    def push(self, tokens: Sequence[int]) -> str:
        """The text these tokens make final (maybe empty); sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        self._held += "".join(self._decoder.push(t) for t in tokens)
        cuts = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if cuts:
            out, self._held, self.stopped = self._held[: min(cuts)], "", True
            return out
        split = max(0, len(self._held) - self._keep)  # never a negative slice
        out, self._held = self._held[:split], self._held[split:]
        return out

    def finish(self) -> str:
        """Whatever is still held back, at the end of the generation."""
        if self.stopped:
            return ""
        out = self._held + self._decoder.flush()
        cuts = [i for i in (out.find(s) for s in self._stops) if i >= 0]
        if cuts:
            out, self.stopped = out[: min(cuts)], True
        self._held = ""
        return out
