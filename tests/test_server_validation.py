"""Request checking, in process: bad input gets a 4xx naming its field, never a 5xx, and nothing is ignored.

Covered: lone surrogates (400 naming the string's field), JSON nested past the depth cap (refused before
parsing), roles, `n`, `speculation.tree_budget`, every field the server does not implement ("<field> is not
supported"), the fields accepted because they cannot change the output (the same tokens as without them),
and the server answering normally after all of it.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")

from _server import local_client, tiny_engine  # noqa: E402
from stagedspec.server.app import create_app  # noqa: E402
from stagedspec.server.schemas import MAX_JSON_DEPTH, nesting_depth_exceeds  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MSG, "max_tokens": 3, "temperature": 0}
COMP = {"model": "tiny", "prompt": "Hello the", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("validation"))


@pytest.fixture(scope="module")
def client(engine):
    with local_client(create_app(engine, log=lambda s: None)) as c:
        yield c


def post(client, endpoint: str, body):  # noqa: ANN001, ANN201
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(f"/v1/{endpoint}", content=raw, headers={"Content-Type": "application/json"})


def error_of(r, status: int = 400) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    r.content.decode("ascii")  # error bodies are ASCII JSON, whatever they quote
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
    return err


def raw_with(base: dict, tail: str) -> str:
    """`base` as JSON with `tail` (raw JSON text, e.g. one holding a \\ud800 escape) spliced in as more fields."""
    return json.dumps(base)[:-1] + ", " + tail + "}"


SURROGATES = [  # (endpoint, raw body, the field the error must name)
    ("chat/completions", raw_with({"model": "tiny", "max_tokens": 2}, '"messages": [{"role": "user", '
                                                                       '"content": "\\ud800"}]'),
     "messages[0].content"),
    ("chat/completions", raw_with({"model": "tiny", "max_tokens": 2}, '"messages": [{"role": "user", "content": '
                                                                       '[{"type": "text", "text": "a\\udfffb"}]}]'),
     "messages[0].content[0].text"),
    ("completions", raw_with({"model": "tiny", "max_tokens": 2}, '"prompt": "x\\udc00"'), "prompt"),
    ("completions", raw_with({"model": "tiny", "max_tokens": 2}, '"prompt": ["\\ud800"]'), "prompt[0]"),
    ("completions", raw_with(COMP, '"stop": ["ok", "\\ud83d"]'), "stop[1]"),
    ("completions", raw_with(COMP, '"\\ud800": 1'), '"\\ud800"'),
]


@pytest.mark.parametrize("endpoint,raw,param", SURROGATES, ids=[s[2] for s in SURROGATES])
def test_lone_surrogate_is_a_400_naming_the_field(client, endpoint, raw, param):
    err = error_of(post(client, endpoint, raw))
    assert err["param"] == param and "lone surrogate" in err["message"]


def test_deep_nesting_is_refused_before_parsing(client):
    for raw in ("[" * 100_000 + "]" * 100_000, "{" + '"a":{' * 100_000 + "}" * 100_001,
                raw_with(COMP, '"metadata": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))):
        err = error_of(post(client, "completions", raw))
        assert f"more than {MAX_JSON_DEPTH} levels deep" in err["message"] and err["param"] is None
    # an unterminated body of brackets and quotes is refused as quickly
    t0 = time.perf_counter()
    error_of(post(client, "completions", '{"a": ' + '\\"[' * 300_000))
    assert time.perf_counter() - t0 < 10


def test_nesting_depth_reads_brackets_outside_strings_only():
    deep = MAX_JSON_DEPTH
    assert not nesting_depth_exceeds(b"[" * deep + b"]" * deep)
    assert nesting_depth_exceeds(b"[" * (deep + 1) + b"]" * (deep + 1))
    assert nesting_depth_exceeds(b'{"a": ' + b"[" * (deep + 1))  # unclosed counts too
    text = json.dumps({"prompt": "[{" * 500 + '\\"[[' * 100}).encode()
    assert not nesting_depth_exceeds(text)
    assert not nesting_depth_exceeds(json.dumps({"prompt": list(range(5000))}).encode())
    assert not nesting_depth_exceeds(json.dumps({"messages": [{"role": "user", "content": "x"}] * 200}).encode())


BAD = [  # (endpoint, body, param, what the message says)
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant"),
    ("chat/completions", {**CHAT, "messages": [*MSG, {"role": "tool", "content": "42", "tool_call_id": "c"}]},
     "messages[1].role", "does not run tools"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
     "messages[0].name", "messages[0].name is not supported"),
    ("chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]},
                                               *MSG]}, "messages[0].tool_calls", "is not supported"),
    ("completions", {**COMP, "n": 0}, "n", "n must be 1"),
    ("completions", {**COMP, "n": 2}, "n", "n must be 1"),
    ("chat/completions", {**CHAT, "n": True}, "n", "n must be 1"),
    ("completions", raw_with(COMP, '"speculation": {"tree_budget": 1e6}'), "speculation.tree_budget",
     "'speculation.tree_budget' must be an integer"),
    ("completions", {**COMP, "speculation": {"tree_budget": 10**6}}, "speculation.tree_budget",
     "'speculation.tree_budget' must be at most"),
    ("completions", {**COMP, "speculation": {"tree_budget": 0}}, "speculation.tree_budget", ">= 1"),
    ("completions", {**COMP, "speculation": {"method": "tree", "depth": 3}}, "speculation.depth",
     "speculation.depth is not supported"),
    ("completions", {**COMP, "stream_options": {"include_usage": True, "chunk_size": 4}}, "stream_options.chunk_size",
     "stream_options.chunk_size is not supported"),
    ("completions", {**COMP, "stream_options": {"include_obfuscation": "yes"}}, "stream_options.include_obfuscation",
     "must be true or false"),
    ("chat/completions", {**CHAT, "user": 5}, "user", "user must be a string"),
    ("chat/completions", {**CHAT, "metadata": [1]}, "metadata", "metadata must be a JSON object"),
]


@pytest.mark.parametrize("endpoint,body,param,says", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_field_is_a_400_naming_it(client, endpoint, body, param, says):
    err = error_of(post(client, endpoint, body))
    assert err["param"] == param and says in err["message"], err


UNSUPPORTED = [  # (endpoint, field, a value the server cannot honour)
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat/completions", "tool_choice", "auto"),
    ("chat/completions", "functions", [{"name": "f"}]),
    ("chat/completions", "function_call", "auto"),
    ("chat/completions", "presence_penalty", 0.5),
    ("chat/completions", "frequency_penalty", -1),
    ("chat/completions", "logprobs", True),
    ("chat/completions", "top_logprobs", 2),
    ("chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat/completions", "modalities", ["text", "audio"]),
    ("chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("chat/completions", "reasoning_effort", "low"),
    ("chat/completions", "verbosity", "low"),
    ("chat/completions", "web_search_options", {}),
    ("chat/completions", "store", True),
    ("chat/completions", "service_tier", "flex"),
    ("chat/completions", "best_of", 1),  # a completions field
    ("chat/completions", "max_token", 5),  # a misspelt field is refused, not ignored
    ("chat/completions", "frobnicate", [1]),
    ("completions", "presence_penalty", 1),
    ("completions", "frequency_penalty", 0.1),
    ("completions", "best_of", 3),
    ("completions", "echo", True),
    ("completions", "suffix", "x"),
    ("completions", "logprobs", 0),  # 0 still asks for the chosen tokens' logprobs
    ("completions", "logprobs", 2),
    ("completions", "response_format", {"type": "text"}),  # a chat field
    ("completions", "tools", []),
    ("completions", "max_completion_tokens", 3),
    ("completions", "messages", MSG),
    ("completions", "repetition_penalty", 1.1),
]


@pytest.mark.parametrize("endpoint,name,value", UNSUPPORTED,
                         ids=[f"{e.split('/')[0]}-{n}-{i}" for i, (e, n, _) in enumerate(UNSUPPORTED)])
def test_unimplemented_field_is_refused_not_ignored(client, endpoint, name, value):
    err = error_of(post(client, endpoint, {**(CHAT if endpoint.startswith("chat") else COMP), name: value}))
    assert err["param"] == name and err["message"].startswith(f"{name} is not supported"), err


def test_odd_field_names_are_quoted_in_ascii(client):
    err = error_of(post(client, "completions", {**COMP, "max tokens\n\u00e9": 3}))
    assert err["param"] == '"max tokens\\n\\u00e9"' and err["message"] == f"{err['param']} is not supported"


NEUTRAL_CHAT = {"n": 1, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
                "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                "functions": [], "function_call": "none", "modalities": ["text"], "store": False,
                "service_tier": "auto", "user": "u-1", "metadata": {"k": "v"}, "parallel_tool_calls": True,
                "prompt_cache_key": "k", "safety_identifier": "s", "stream_options": {"include_obfuscation": False},
                "audio": None, "prediction": None, "frobnicate": None}
NEUTRAL_COMP = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logprobs": None, "presence_penalty": 0,
                "frequency_penalty": 0, "logit_bias": {}, "user": "u-1", "tools": None}


@pytest.mark.parametrize("endpoint,base,extra", [("chat/completions", CHAT, NEUTRAL_CHAT),
                                                 ("completions", COMP, NEUTRAL_COMP)], ids=["chat", "completions"])
def test_fields_that_cannot_change_the_output_are_accepted(client, endpoint, base, extra):
    plain = post(client, endpoint, base)
    with_them = post(client, endpoint, {**base, **extra})
    assert plain.status_code == with_them.status_code == 200, with_them.text
    assert plain.json()["stagedspec"]["token_ids"] == with_them.json()["stagedspec"]["token_ids"]


def test_assistant_reply_sent_back_as_the_client_dumps_it(client):
    """The `openai` client's `message.model_dump()` carries null/empty extras: accepted, same output."""
    first = post(client, "chat/completions", CHAT).json()["choices"][0]["message"]
    dumped = {**first, "refusal": None, "annotations": [], "audio": None, "function_call": None, "tool_calls": None}
    follow = [*MSG, first, {"role": "user", "content": "more"}]
    a = post(client, "chat/completions", {**CHAT, "messages": follow})
    b = post(client, "chat/completions", {**CHAT, "messages": [*MSG, dumped, {"role": "user", "content": "more"}]})
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["stagedspec"]["token_ids"] == b.json()["stagedspec"]["token_ids"]


def test_developer_role_is_rendered_as_system(client):
    as_system = post(client, "chat/completions", {**CHAT, "messages": [{"role": "system", "content": "be brief"}, *MSG]})
    as_developer = post(client, "chat/completions",
                        {**CHAT, "messages": [{"role": "developer", "content": "be brief"}, *MSG]})
    assert as_system.status_code == as_developer.status_code == 200
    assert as_system.json()["stagedspec"]["token_ids"] == as_developer.json()["stagedspec"]["token_ids"]


def test_memory_error_names_the_tree_budget_that_caused_it(engine):
    mem = engine.memory_model()
    fits = mem.request_kv(engine.cache_slots(3, 3, engine.speculation), engine.speculation.max_tree_budget, True)
    budget = mem.weights + mem.scratch + fits  # the default tree fits, a 100-node one does not
    with local_client(create_app(engine, max_memory=budget, log=lambda s: None, batch_passes=False)) as c:
        err = error_of(post(c, "completions", {**COMP, "speculation": {"tree_budget": 100}}))
        assert err["param"] == "speculation.tree_budget" and err["code"] == "memory_budget_exceeded"
        assert "lower speculation.tree_budget" in err["message"]
        assert post(c, "completions", COMP).status_code == 200


def test_server_still_answers_after_bad_input(client):
    r = post(client, "chat/completions", CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
