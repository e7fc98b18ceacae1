"""Stop strings: one rule (`stagedspec.stops`), and the library, the CLI and the server all cut by it.

The rule: cut where the earliest stop string begins, whatever the list order; hold back, while
streaming, only text that could still begin a stop string; check the decoder's final flush too.
The rule is tested on its own with chosen texts.  A tiny random model cannot be made to write a
chosen text, so each surface generates its text once without stops, and the stop strings are then
picked from that text (one pair of them ordered so that list order and earliest position disagree,
as stops ["b", "a"] on "xab"); every surface must give exactly the rule's cut of its own text.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from _tiny_models import save_tiny_hf, tiny_tokenizer
from stagedspec.errors import StagedSpecError
from stagedspec.stops import StopCutter, StopTextStream, cut_at_stop, first_stop
from stagedspec.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread", "shared_cost_cache")

PROMPT = "Hello"
NEW_TOKENS = 24
ABSENT = "\u2603"  # a snowman: never in the tiny byte-level model's text


# ---------------------------------------------------------------------------------------------- the rule alone


def test_the_earliest_stop_wins_whatever_the_list_order() -> None:
    assert cut_at_stop("xab", ["b", "a"]) == ("x", True)
    assert cut_at_stop("xab", ["a", "b"]) == ("x", True)
    assert first_stop("xab", ["b", "a"]) == 1
    assert first_stop("xab", ["c"]) is None


def test_overlapping_stops_cut_where_the_first_one_begins() -> None:
    assert cut_at_stop("xabc", ["ab", "b"]) == ("x", True)
    assert cut_at_stop("xabc", ["b", "ab"]) == ("x", True)
    assert cut_at_stop("xabcd", ["bc", "abc"]) == ("x", True)
    assert cut_at_stop("xbcd", ["abc", "bc"]) == ("x", True)


def test_no_stop_keeps_the_whole_text() -> None:
    assert cut_at_stop("hello", ["z", "hello!"]) == ("hello", False)
    assert cut_at_stop("hello", []) == ("hello", False)


def _streamed(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Feed `pieces` to a `StopCutter`, checking after each push that what it holds back is either
    nothing or the proper beginning of a stop string; (everything released, whether it stopped)."""
    cutter = StopCutter(stops)
    released, received = "", ""
    for piece in pieces:
        received += piece
        released += cutter.push(piece)
        if cutter.stopped:
            break
        held = received[len(released):]
        assert received.startswith(released)
        assert held == "" or any(len(s) > len(held) and s.startswith(held) for s in stops), (pieces, held)
    released += cutter.finish()
    return released, cutter.stopped


def _every_split(text: str) -> list[list[str]]:
    """Every way to cut `text` into consecutive non-empty pieces (2^(len-1) of them)."""
    out = []
    for cuts in itertools.product((False, True), repeat=max(0, len(text) - 1)):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                pieces.append(text[start:i])
                start = i
        out.append(pieces + [text[start:]])
    return out


STREAM_CASES = [
    ("xab", ["b", "a"]),  # list order and earliest position disagree
    ("xab", ["a", "b"]),
    ("xabc", ["ab", "b"]),  # overlapping: the longer begins first
    ("xabcd", ["abc", "bc"]),
    ("xbcd", ["abc", "bc"]),  # a stop's beginning that does not complete, then a shorter one inside it
    ("xabcd", ["abcd", "c"]),  # a stop found whole waits for a longer one that could begin before it
    ("xabce", ["abcd", "c"]),
    ("hello world", ["o w", "wor"]),  # stops that span pieces
    ("no stop here", ["zz", "ez"]),
    ("ends with ab", ["abc"]),  # the beginning of a stop at the very end: held, then released by `finish`
    ("aaab", ["aab"]),  # a held beginning that slides along before the stop completes
]


@pytest.mark.parametrize("text, stops", STREAM_CASES)
def test_streamed_pieces_cut_as_the_whole_text(text: str, stops: list[str]) -> None:
    expected = cut_at_stop(text, stops)
    for pieces in _every_split(text):
        assert _streamed(stops, pieces) == expected, pieces


def test_a_stop_found_whole_waits_only_while_a_longer_one_could_begin_before_it() -> None:
    c = StopCutter(["abcd", "c"])
    assert [c.push(ch) for ch in "xabc"] == ["x", "", "", ""] and not c.stopped
    assert c.push("e") == "ab" and c.stopped  # "abce" is no "abcd": the "c" decides the cut
    assert c.push("more") == "" and c.finish("and more") == ""


def test_a_stop_completed_by_the_final_flush_cuts() -> None:
    c = StopCutter(["ab"])
    assert c.push("xa") == "x"
    assert c.finish("b") == "" and c.stopped
    c = StopCutter(["b", "a"])
    assert c.finish("xab") == "x" and c.stopped  # everything arrives at the end: the same rule


def _tiny_tokenizer() -> Tokenizer:
    return Tokenizer(tiny_tokenizer(), eos_token_ids=[0])


def test_a_stop_in_the_decoders_final_flush_cuts() -> None:
    """The decoder holds back an incomplete UTF-8 character until the end; the stop string that ends in
    what the flush releases (a replacement character) must still cut."""
    tok = _tiny_tokenizer()
    ids = tok.encode("xa\u00e9")[:-1]  # "é" is two byte tokens: keep only the first
    s = StopTextStream(tok, ["a\ufffd"])
    assert "".join(s.push([t]) for t in ids) == "x" and not s.stopped
    assert s.finish() == "" and s.stopped


def test_the_token_stream_holds_back_a_possible_stop() -> None:
    tok = _tiny_tokenizer()
    ids = tok.encode("abcSTOPdef")
    s = StopTextStream(tok, ["STOP"])
    out = "".join(s.push([t]) for t in ids) + s.finish()
    assert out == "abc" and s.stopped
    s = StopTextStream(tok, ["STOPPER"])  # a stop string longer than all text so far is never half-emitted
    out = "".join(s.push([t]) for t in ids) + s.finish()
    assert out == "abcSTOPdef" and not s.stopped
    s = StopTextStream(tok, ["f", "cST"])  # several tokens per push, the earliest stop spanning them
    assert s.push(ids[:4]) == "ab" and s.push(ids[4:]) == "" and s.stopped


def test_empty_stop_strings_are_refused() -> None:
    for build in (lambda: StopCutter([""]), lambda: StopCutter(["a", ""]), lambda: cut_at_stop("x", [""]),
                  lambda: StopTextStream(_tiny_tokenizer(), ["b", ""])):
        with pytest.raises(StagedSpecError, match="stop strings must not be empty"):
            build()


# ------------------------------------------------------------------------------------------------ the surfaces


def stop_cases(text: str) -> list[list[str]]:
    """Stop lists for one generated text, the first ordered so that list order and position disagree."""
    p = next((i for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i), None)
    assert p is not None, f"the tiny model wrote {text!r}: no two characters first seen past its start"
    early = text[p:p + 2]  # two characters: the stop string spans two tokens (the tokenizer is byte-level)
    late = next((text[j:j + 2] for j in range(p + 1, len(text) - 1) if text.find(text[j:j + 2]) > p), None)
    assert late is not None, f"the tiny model wrote {text!r}: nothing first seen after {early!r}"
    assert cut_at_stop(text, [late, early]) == (text[:p], True)  # the earlier one, listed second, cuts
    return [
        [late, early],
        [text[p + 1:p + 3], text[p:p + 3]],  # overlapping, the longer one begins first
        [text[-3:] + ABSENT],  # begins at the text's end and never completes: held, then released
        [ABSENT],
    ]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stops") / "tiny-llama"
    save_tiny_hf("llama_gqa", folder)
    return folder


@pytest.mark.parametrize("method", ["ar", "tree"])
def test_the_library_cuts_by_the_rule(tiny_folder: Path, method: str) -> None:
    from stagedspec.models.draft_formats import truncated_copy
    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    model, tok = load_model(tiny_folder, dtype=torch.float32)
    drafts = [truncated_copy(model, 1)] if method == "tree" else []
    pipe = Pipeline(model, tok, drafts, SpeculationConfig(method=method, tree_budget=4))
    text = pipe.generate(PROMPT, max_new_tokens=NEW_TOKENS).text
    for stops in stop_cases(text):
        pieces: list[str] = []
        result = pipe.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_strings=stops, on_text=pieces.append)
        expected, hit = cut_at_stop(text, stops)
        assert result.text == expected and "".join(pieces) == expected, (stops, text)
        if hit:
            assert result.stats.finish_reason == "stop"
    with pytest.raises(StagedSpecError, match="must not be empty"):
        pipe.generate(PROMPT, max_new_tokens=2, stop_strings=["a", ""])


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from stagedspec.cli import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_cli_cuts_by_the_rule(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", PROMPT, "--oracle", str(tiny_folder), "--dtype", "fp32", "--method", "tree",
            "--draft", "layers:1", "--tree-budget", "4", "--max-new-tokens", str(NEW_TOKENS)]
    code, out, err = _cli([*base, "--json"], capsys)
    assert code == 0, err
    text = json.loads(out)["text"]
    cases = stop_cases(text)
    for stops in cases:
        flags = [arg for s in stops for arg in ("--stop", s)]
        code, out, err = _cli([*base, "--json", *flags], capsys)
        assert code == 0, err
        assert json.loads(out)["text"] == cut_at_stop(text, stops)[0], (stops, text)
    code, out, err = _cli([*base, *[arg for s in cases[0] for arg in ("--stop", s)]], capsys)  # streamed to stdout
    assert code == 0, err
    assert out == cut_at_stop(text, cases[0])[0] + "\n"


def test_the_cli_refuses_an_empty_stop_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["generate", "hi", "--oracle", "/no/such/model", "--stop", "a", "--stop", ""], capsys)
    assert code == 2 and "stop strings must not be empty" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def _server_text(client, body: dict) -> tuple[str, str]:  # noqa: ANN001 - a TestClient
    """(text, finish_reason) of one completion, read from the whole response or from its stream."""
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, reason = "", None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: "):])["choices"]:
                text += choice.get("text") or ""
                reason = choice.get("finish_reason") or reason
    return text, reason


def test_the_server_cuts_by_the_rule(tiny_folder: Path) -> None:
    pytest.importorskip("fastapi")
    from _server import local_client, tiny_engine
    from stagedspec.server.app import create_app

    engine = tiny_engine(tiny_folder.parent)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    with local_client(create_app(engine, log=lambda s: None)) as c:
        text, _ = _server_text(c, body)
        for stops in stop_cases(text):
            expected, hit = cut_at_stop(text, stops)
            for stream in (False, True):
                got = _server_text(c, {**body, "stop": stops, "stream": stream})
                assert got[0] == expected, (stops, stream, text)
                if hit:
                    assert got[1] == "stop"
        r = c.post("/v1/completions", json={**body, "stop": ["a", ""]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
