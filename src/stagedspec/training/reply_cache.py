"""A per-request cache of the oracle's replies for `distill`, written as each batch finishes.

Why per request: successive distillation rounds ask the oracle overlapping
sets of requests (another seed, more samples, more `--sample-from` sources).
A cache keyed by the whole request list regenerated every reply whenever
the list changed, which is tens of minutes on a CPU.  Keyed per request, a
round pays only for the requests no earlier round answered, and a sampling
run that is interrupted keeps every batch it finished.

The file is JSON lines, one `{"key": ..., "stream": [...]}` per reply,
appended and flushed as batches finish.  A line cut short by a crash is
skipped on reading; nothing else in the file is lost.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

from stagedspec.errors import StagedSpecError


class ReplyCache:
    """The oracle's replies (prompt + reply token streams) to requests, by request.

    A reply depends on the oracle (its tokenizer `fingerprint` stands for
    it), the reply cap `n_tokens` and whether replies were generated in
    batches (batched bf16 passes can round differently at near-ties), so
    these are part of every key: entries made under other settings stay in
    the file but are not used.
    """

    def __init__(self, path: Path, fingerprint: str, n_tokens: int, batched: bool) -> None:
        self.path = Path(path)
        self._salt = [fingerprint, n_tokens, "batched" if batched else "single"]
        self._streams: dict[str, list[int]] = {}
        self.skipped_lines = 0
        if self.path.is_dir():
            raise StagedSpecError(f"the oracle-reply cache {self.path} is a folder; give a file path")
        if self.path.is_file():
            self._read()

    def key(self, request: str) -> str:
        """The cache key of one request under this cache's settings."""
        return hashlib.sha256(json.dumps(self._salt + [request]).encode()).hexdigest()[:32]

    def get(self, request: str) -> list[int] | None:
        """The cached stream for `request`, or None."""
        return self._streams.get(self.key(request))

    def __contains__(self, request: str) -> bool:
        return self.key(request) in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, pairs: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Store replies and append them to the file at once (one flushed write per call)."""
        lines = []
        for request, stream in pairs:
            key = self.key(request)
            stream = [int(t) for t in stream]
            self._streams[key] = stream
            lines.append(json.dumps({"key": key, "stream": stream}, separators=(",", ":")))
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = self.path.is_file() and self.path.stat().st_size > 0 and not self._ends_with_newline()
        with self.path.open("a", encoding="utf-8") as f:
            f.write(("\n" if needs_newline else "") + "\n".join(lines) + "\n")
            f.flush()

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as f:
            f.seek(-1, 2)
            return f.read(1) == b"\n"

    def _read(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise StagedSpecError(f"cannot read the oracle-reply cache {self.path}: {exc.strerror or exc}") from None
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                key, stream = entry["key"], entry["stream"]
                if not isinstance(key, str) or not isinstance(stream, list) or not all(isinstance(t, int) for t in stream):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                self.skipped_lines += 1  # a line cut short by a crash, or not this cache's format
                continue
            self._streams[key] = stream


def legacy_streams(path: Path, legacy_key: str, n_requests: int) -> list[list[int]] | None:
    """The streams of an old whole-list cache (`oracle_samples.json`) if it was made for these requests.

    Older `distill` versions cached all replies under one key of the whole
    request list; a work folder made by them is still reused, not regenerated.
    """
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        streams = saved["streams"] if saved.get("key") == legacy_key else None
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    if not isinstance(streams, list) or len(streams) != n_requests:
        return None
    return streams
