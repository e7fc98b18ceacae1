"""The per-request oracle-reply cache of `distill` (`stagedspec.training.reply_cache`, `cached_oracle_samples`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

import stagedspec.training.distill
from stagedspec.cli.distill import LEGACY_SAMPLES_NAME, cached_oracle_samples
from stagedspec.errors import StagedSpecError
from stagedspec.training.reply_cache import ReplyCache


class FakeOracleSampler:
    """Stands in for `stagedspec.training.distill.oracle_samples`: a request's stream is its characters' codes.

    It records every request it is asked, and can fail after `fail_after` batches (an interrupted run).
    """

    def __init__(self, fail_after: int | None = None) -> None:
        self.asked: list[str] = []
        self.fail_after = fail_after

    def __call__(self, oracle: Any, tokenizer: Any, prompts: list[str], n_tokens: int, progress: bool = True,
                 batch_size: int = 1, on_batch: Any = None) -> list[list[int]]:
        out = []
        for b, lo in enumerate(range(0, len(prompts), batch_size)):
            if self.fail_after is not None and b >= self.fail_after:
                raise KeyboardInterrupt
            chunk = list(range(lo, min(lo + batch_size, len(prompts))))
            streams = [stream_of(prompts[i], n_tokens) for i in chunk]
            self.asked += [prompts[i] for i in chunk]
            if on_batch is not None:
                on_batch(chunk, streams)
            out += streams
        return out


def stream_of(request: str, n_tokens: int) -> list[int]:
    return [ord(c) for c in request] + [n_tokens]


@pytest.fixture()
def sampler(monkeypatch: pytest.MonkeyPatch) -> FakeOracleSampler:
    fake = FakeOracleSampler()
    monkeypatch.setattr(stagedspec.training.distill, "oracle_samples", fake)
    return fake


def replies(requests: list[str], cache: Path, batch_size: int = 2, n_tokens: int = 7) -> list[list[int]]:
    return cached_oracle_samples(None, None, requests, n_tokens, cache, "fp", progress=False, batch_size=batch_size)


def test_only_requests_without_a_cached_reply_go_to_the_oracle(sampler: FakeOracleSampler, tmp_path: Path) -> None:
    cache = tmp_path / "replies.jsonl"
    first = ["a", "b", "c"]
    assert replies(first, cache) == [stream_of(r, 7) for r in first]
    assert sampler.asked == first
    sampler.asked.clear()
    second = ["c", "d", "a", "e", "d"]  # overlaps the first round; "d" twice
    assert replies(second, cache) == [stream_of(r, 7) for r in second]
    assert sampler.asked == ["d", "e"]  # each new request once
    sampler.asked.clear()
    assert replies(second, cache) == [stream_of(r, 7) for r in second] and sampler.asked == []
    assert len(cache.read_text().splitlines()) == 5


def test_other_settings_do_not_reuse_replies(sampler: FakeOracleSampler, tmp_path: Path) -> None:
    cache = tmp_path / "replies.jsonl"
    replies(["a", "b"], cache)
    sampler.asked.clear()
    replies(["a", "b"], cache, n_tokens=9)  # another reply cap
    replies(["a", "b"], cache, batch_size=1)  # one at a time instead of batched
    assert sampler.asked == ["a", "b", "a", "b"]
    assert cached_oracle_samples(None, None, ["a"], 7, cache, "other-oracle", progress=False) and sampler.asked[-1] == "a"


def test_an_interrupted_run_keeps_its_finished_batches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "replies.jsonl"
    requests = ["a", "b", "c", "d", "e"]
    monkeypatch.setattr(stagedspec.training.distill, "oracle_samples", FakeOracleSampler(fail_after=2))
    with pytest.raises(KeyboardInterrupt):
        replies(requests, cache)
    with cache.open("a") as f:
        f.write('{"key": "cut sho')  # and the process died in the middle of a write
    again = FakeOracleSampler()
    monkeypatch.setattr(stagedspec.training.distill, "oracle_samples", again)
    assert replies(requests, cache) == [stream_of(r, 7) for r in requests]
    assert again.asked == ["e"]  # the two finished batches (4 replies) were kept
    store = ReplyCache(cache, "fp", 7, batched=True)
    assert len(store) == 5 and store.skipped_lines == 1  # the broken line is skipped, the later ones read


def test_an_old_whole_list_cache_is_imported(sampler: FakeOracleSampler, tmp_path: Path) -> None:
    requests = ["x", "y"]
    key = hashlib.sha256(json.dumps(["fp", 7, requests, 2]).encode()).hexdigest()[:16]
    (tmp_path / LEGACY_SAMPLES_NAME).write_text(json.dumps({"key": key, "streams": [[1, 2], [3]]}))
    assert replies(requests, tmp_path / "replies.jsonl") == [[1, 2], [3]] and sampler.asked == []
    assert replies(["z", "x"], tmp_path / "replies.jsonl") == [stream_of("z", 7), [1, 2]] and sampler.asked == ["z"]


def test_a_folder_is_not_a_cache_file(tmp_path: Path) -> None:
    with pytest.raises(StagedSpecError, match="is a folder"):
        ReplyCache(tmp_path, "fp", 7, batched=True)
