"""Property-based fuzz of the request schema, in process: whatever JSON a client sends, no 5xx.

Each example starts from a valid request and replaces, adds or drops a few fields with random JSON
(plausible values of the field's own kind, values of every other kind, lone surrogates, NaN, huge
integers, and fields the server does not implement).  Every answer must be 200, 400 or 404 in the
OpenAI error shape, and a streamed answer must carry no server error event.  Most examples stop at
validation; the ones that pass generate at most 3 tokens of the tiny model, so the whole run stays
within seconds.  Afterwards the server answers a plain request.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from _server import local_client, tiny_engine  # noqa: E402
from stagedspec.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 3  # a request that passes validation generates this many tokens at most

LEAVES = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
          | st.sampled_from(["\ud800", "a\udfffb", "", "text", "none", "user", "tiny", "tree", "ar", "\x00"]))
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=10)

ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", "", "USER"])
TEXT_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8) | JSON})
MESSAGE = st.fixed_dictionaries({"role": ROLES | JSON},
                                optional={"content": st.text(max_size=16) | st.lists(TEXT_PART, max_size=2) | JSON,
                                          "name": JSON, "tool_calls": JSON, "refusal": JSON})
SPECULATION = st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["ar", "tree", "chain", "lookup", "staged", "bogus"]) | JSON,
    "draft": st.sampled_from(["layers:1", "other"]) | JSON,
    "tree_budget": st.integers(-2, 200) | JSON, "extra": JSON})
SMALL_INT = st.integers(-2, MAX_TOKENS)

COMMON: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from(["tiny", "other"]) | JSON,
    "max_tokens": SMALL_INT | JSON,
    "temperature": st.floats(-1, 3) | st.floats() | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": st.integers(-5, 500) | JSON,
    "seed": st.integers(-(2**64), 2**64) | JSON,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON,
                                                          "include_obfuscation": JSON, "other": JSON}) | JSON,
    "speculation": SPECULATION | JSON,
    "n": st.integers(-1, 3) | JSON,
    "user": st.text(max_size=8) | JSON,
    "logit_bias": st.dictionaries(st.text(max_size=4), st.integers(-100, 100), max_size=2) | JSON,
    "presence_penalty": st.floats(-2, 2) | JSON,
    "frequency_penalty": st.floats(-2, 2) | JSON,
    "logprobs": JSON,
}
FIELDS = {
    False: {**COMMON, "prompt": st.text(max_size=24) | st.lists(st.integers(-5, 400), max_size=8)
            | st.lists(st.text(max_size=8) | st.lists(st.integers(0, 300), max_size=4), max_size=2) | JSON,
            "best_of": JSON, "echo": JSON, "suffix": JSON},
    True: {**COMMON, "messages": st.lists(MESSAGE, max_size=3) | JSON, "max_completion_tokens": SMALL_INT | JSON,
           "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}) | JSON,
           "tools": JSON, "tool_choice": JSON, "top_logprobs": JSON, "metadata": JSON, "store": JSON,
           "modalities": JSON},
}
BASE = {False: {"model": "tiny", "prompt": "Hello the", "max_tokens": 2},
        True: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


@st.composite
def requests(draw: Any, chat: bool) -> dict[str, Any]:
    """A valid request with a few fields replaced by random values, a few dropped and a few unknown ones added."""
    fields = FIELDS[chat]
    body = dict(BASE[chat])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        body.pop(name, None)
    body.update(draw(st.dictionaries(st.text(max_size=10), JSON, max_size=1)))
    return bounded(body, chat)


def bounded(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Keep real generation short: a max_tokens that would pass validation is at most `MAX_TOKENS`."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value < 10**6:
            body[name] = MAX_TOKENS
    if chat and not any(isinstance(body.get(n), int) for n in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = MAX_TOKENS  # chat's default is the rest of the context
    return body


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("fuzz"))
    with local_client(create_app(engine, log=lambda s: None)) as c:
        yield c


def check_answer(r, body: dict[str, Any]) -> None:  # noqa: ANN001
    assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    elif body.get("stream") is True:
        assert '"server_error"' not in r.text and r.text.rstrip().endswith("data: [DONE]"), (r.text, body)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_random_requests_never_get_a_5xx(client, chat, private_cost_cache):
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"

    @FUZZ
    @given(body=requests(chat))
    def run(body: dict[str, Any]) -> None:
        raw = json.dumps(body)  # NaN and infinities go out as Python's json writes them, as some clients do
        check_answer(client.post(endpoint, content=raw, headers={"Content-Type": "application/json"}), body)

    run()
    plain = client.post(endpoint, json=bounded(dict(BASE[chat]), chat))
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] in ("stop", "length")
