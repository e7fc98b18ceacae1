"""`logit_bias` and `response_format` through the server, in process: honoured, exact, and 400 when bad."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from _exactness import assert_drafts_used  # noqa: E402
from _server import local_client, tiny_engine  # noqa: E402
from stagedspec.constraints import grammar_available  # noqa: E402
from stagedspec.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MSG, "max_tokens": 24, "temperature": 0}
COMP = {"model": "tiny", "prompt": "Hello the", "max_tokens": 12, "temperature": 0}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
needs_grammar = pytest.mark.skipif(not grammar_available(), reason="llguidance is not installed")


@pytest.fixture(scope="module")
def client(tmp_path_factory):  # noqa: ANN001, ANN201
    from stagedspec.auto import AutoPolicy, arms_for
    from stagedspec.costs import CostProfile

    engine = tiny_engine(tmp_path_factory.mktemp("constraints"))
    # `auto` on a hand-made profile where speculation looks nearly free: its arms take turns, so an identity of
    # `auto` with `ar` runs drafts on any machine (on measured costs it may choose `ar` throughout), and no
    # profile is measured
    flat = CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])
    engine.learned.set_policy("auto", AutoPolicy(arms_for(True, True), flat))
    with local_client(create_app(engine, log=lambda s: None)) as c:
        yield c


def post(client, endpoint: str, body: dict):  # noqa: ANN001, ANN201
    return client.post(f"/v1/{endpoint}", json=body)


def ids(response) -> list[int]:  # noqa: ANN001
    assert response.status_code == 200, response.text
    return response.json()["stagedspec"]["token_ids"]


def speculative_ids(response, method: str) -> list[int]:  # noqa: ANN001
    """`ids`, for a speculative method whose output is compared with `ar`'s: its drafts must have been accepted."""
    tokens = ids(response)
    assert_drafts_used(response.json()["stagedspec"], f"{method} through the server")
    return tokens


@pytest.mark.parametrize("endpoint, base", [("completions", COMP), ("chat/completions", CHAT)])
def test_logit_bias_is_honoured_and_every_method_agrees(client, endpoint: str, base: dict) -> None:  # noqa: ANN001
    plain = ids(post(client, endpoint, base))
    bias = {str(t): -100 for t in sorted(set(plain))[:3]}
    want = ids(post(client, endpoint, {**base, "logit_bias": bias, "speculation": {"method": "ar"}}))
    assert want != plain and not {int(t) for t in bias} & set(want)
    for method in ("tree", "lookup", "staged"):
        got = speculative_ids(post(client, endpoint, {**base, "logit_bias": bias, "speculation": {"method": method}}),
                              method)
        assert got == want, method


@pytest.mark.parametrize("bias, says", [
    ({"100000": 1}, "is not a token id"), ({"5": 101}, "[-100, 100]"), ({"x": 1}, "is not a token id"),
    ([1, 2], "must be an object"),
])
def test_bad_logit_bias_is_a_400(client, bias, says: str) -> None:  # noqa: ANN001
    r = post(client, "completions", {**COMP, "logit_bias": bias})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias" and says in err["message"], err


@needs_grammar
@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}],
                         ids=["json_object", "json_schema"])
def test_response_format_is_constrained_ar_for_every_method(client, fmt: dict) -> None:  # noqa: ANN001
    # A message with JSON in it: prompt lookup has text to copy, so `lookup` drafts (after "hi" it drafts
    # nothing the grammar lets through, and its identity with `ar` would compare `ar` with `ar`).
    body = {**CHAT, "messages": [{"role": "user", "content": '{"ok": true} {"ok": false} {"ok": true}'}],
            "max_tokens": 48, "response_format": fmt}
    want = post(client, "chat/completions", {**body, "speculation": {"method": "ar"}})
    assert want.status_code == 200, want.text
    text = want.json()["choices"][0]["message"]["content"]
    assert text.startswith("{")
    for method in ("tree", "lookup", "staged", "auto"):
        got = speculative_ids(post(client, "chat/completions", {**body, "speculation": {"method": method}}), method)
        assert got == ids(want), method


@needs_grammar
def test_json_schema_reply_parses_when_stop_is_favoured(client) -> None:  # noqa: ANN001
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    r = post(client, "chat/completions", {**CHAT, "max_tokens": 40, "response_format": fmt,
                                          "logit_bias": {"0": 30, "2": 30}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["message"]["content"])) == {"ok"}


@pytest.mark.parametrize("fmt, param", [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "frob": 1}}, "response_format.json_schema.frob"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
])
def test_bad_response_format_is_a_400_naming_it(client, fmt: dict, param: str) -> None:  # noqa: ANN001
    r = post(client, "chat/completions", {**CHAT, "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@needs_grammar
def test_schema_the_grammar_library_refuses_is_a_400(client) -> None:  # noqa: ANN001
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    r = post(client, "chat/completions", {**CHAT, "response_format": fmt})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format" and "bad JSON schema" in err["message"], err
    assert post(client, "chat/completions", CHAT).status_code == 200  # and the server goes on


def test_penalties_and_tools_stay_refused(client) -> None:  # noqa: ANN001
    for name, value in (("presence_penalty", 0.5), ("frequency_penalty", 1), ("tools", [{"type": "function"}])):
        r = post(client, "chat/completions", {**CHAT, name: value})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{name} is not supported")
