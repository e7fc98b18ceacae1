"""`stagedspec serve` through the official `openai` client and raw HTTP, on a tiny model.

One server subprocess on 127.0.0.1 serves the whole module (a tiny random
Llama, a 1-layer truncated draft, fp32).  Covered: completions and chat,
streamed and whole; streamed text equal to whole text at temperature 0;
finish_reason exactly once; usage that adds up and the include_usage chunk;
stop strings; cancellation of a client that disconnects; every bad input's
status and error shape, with the server still answering afterwards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from _server import ServerProcess, tiny_model_folder  # noqa: E402

MODEL = "tiny-llama"
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tiny_model_folder(tmp_path_factory.mktemp("serve"))
    srv = ServerProcess(["--oracle", str(folder), "--draft", "layers:1", "--method", "tree", "--dtype", "fp32",
                         "--max-batch", "4"], env={"STAGEDSPEC_SERVE_ROUND_PAUSE": "0.01"})
    yield srv
    log = srv.stop()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    yield c
    c.close()


def stream_completion(client, **kw):  # noqa: ANN001, ANN201
    """(text, finish_reasons, usage chunks, the stagedspec extension) of a streamed completion."""
    text, reasons, usages, ext = "", [], [], None
    for chunk in client.completions.create(model=MODEL, stream=True, **kw):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            text += choice.text
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
                ext = chunk.model_extra["stagedspec"]
    return text, reasons, usages, ext


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base + "/health", timeout=TIMEOUT).status_code == 200


def test_completion_streamed_equals_whole(client):
    whole = client.completions.create(model=MODEL, prompt="Hello the world", max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.id and whole.created and whole.model == MODEL
    assert len(whole.choices) == 1 and whole.choices[0].finish_reason in ("stop", "length")
    ext = whole.model_extra["stagedspec"]
    u = whole.usage
    assert u.completion_tokens == len(ext["token_ids"]) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert ext["method"] == "tree" and ext["mean_accepted_length"] >= 1
    assert sum(ext["tokens_by_stage"].values()) == u.completion_tokens

    text, reasons, usages, sext = stream_completion(client, prompt="Hello the world", max_tokens=12, temperature=0,
                                                    stream_options={"include_usage": True})
    assert text == whole.choices[0].text
    assert reasons == [whole.choices[0].finish_reason]
    assert len(usages) == 1 and usages[0].model_dump() == u.model_dump()
    assert sext["token_ids"] == ext["token_ids"]

    # without include_usage: no usage chunk
    _, reasons, usages, _ = stream_completion(client, prompt="Hello the world", max_tokens=5, temperature=0)
    assert len(reasons) == 1 and usages == []


def test_chat_streamed_equals_whole(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the the in"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion"
    msg = whole.choices[0].message
    assert msg.role == "assistant"
    text, reasons, usage, roles = "", [], None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    assert text == msg.content
    assert roles == ["assistant"]
    assert reasons == [whole.choices[0].finish_reason]
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_sampled_with_seed_repeats(client):
    kw = dict(model=MODEL, prompt="in the", max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 50, "speculation": {"method": "ar"}})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.model_extra["stagedspec"]["token_ids"] == b.model_extra["stagedspec"]["token_ids"]
    assert a.model_extra["stagedspec"]["method"] == "ar"
    # The seed decided the draws: a server that ignored it would repeat these tokens under other seeds too.
    others = [client.completions.create(**{**kw, "seed": s}).model_extra["stagedspec"]["token_ids"] for s in (8, 9)]
    assert any(o != a.model_extra["stagedspec"]["token_ids"] for o in others), "seeds 7, 8 and 9 gave the same tokens"


def test_stop_string_cuts_text(client):
    full = client.completions.create(model=MODEL, prompt="Hello the world", max_tokens=12, temperature=0)
    text = full.choices[0].text
    if len(text) < 4:
        pytest.skip("the tiny model's greedy text is too short to cut")
    stop = text[2:4]
    cut = client.completions.create(model=MODEL, prompt="Hello the world", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed, reasons, _, _ = stream_completion(client, prompt="Hello the world", max_tokens=12, temperature=0,
                                                stop=stop)
    assert streamed == cut.choices[0].text and reasons == ["stop"]


def wait_for(predicate, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_cancels_and_next_is_served(server, client):
    cancelled = 'requests_total{outcome="cancelled"}'
    before = server.metric(cancelled) if "cancelled" in httpx.get(server.base + "/metrics").text else 0
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 120, "temperature": 1.0, "seed": 1, "stream": True,
            "speculation": {"method": "ar"}}
    with httpx.Client(timeout=TIMEOUT) as h:
        with h.stream("POST", server.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk read, then hang up mid-stream
    assert wait_for(lambda: server.metric(cancelled) == before + 1), "the request was not cancelled"
    assert wait_for(lambda: server.metric("requests_running") == 0)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


BAD = [  # (endpoint, raw body, status, param or None, code or None)
    ("completions", "{bad", 400, None, None),
    ("completions", "[1, 2]", 400, None, None),
    ("completions", {"model": MODEL}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": 123}, 400, "prompt", None),
    ("completions", {"prompt": "hi"}, 400, "model", None),
    ("completions", {"model": 5, "prompt": "hi"}, 400, "model", None),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature", None),
    ("completions", '{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL, 400, "temperature", None),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("completions", {"model": MODEL, "prompt": "hi", "top_k": -1}, 400, "top_k", None),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": 5}, 400, "stop", None),
    ("completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", None),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 1}, 400, "logprobs", None),
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo", None),
    ("completions", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix", None),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 500}, 400, "max_tokens",
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "hi " * 200, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": {"method": "bogus"}}, 400,
     "speculation.method", None),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": {"draft": "other"}}, 400,
     "speculation.draft", None),
    ("completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x" * (2 << 20)}, 413, None, "request_too_large"),
    ("chat/completions", {"model": MODEL}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0]", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "max_tokens", None),
    ("chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL, 400,
     "messages[0].content", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400,
     "tools", None),
    ("completions", "[" * 100_000 + "]" * 100_000, 400, None, None),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", None),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": {"tree_budget": 10**6}}, 400,
     "speculation.tree_budget", None),
]


@pytest.mark.parametrize("endpoint,body,status,param,code", BAD,
                         ids=[f"{i}-{b[0]}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_error_shape(server, endpoint, body, status, param, code):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.base}/v1/{endpoint}", content=raw, headers={"Content-Type": "application/json"},
                   timeout=TIMEOUT)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code


def test_openai_client_sees_errors_and_server_goes_on(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)
    assert "n must be 1" in str(e.value)
    r = httpx.get(server.base + "/v1/nowhere", timeout=TIMEOUT)
    assert r.status_code == 404 and "error" in r.json()
    # a field the server does not implement is refused, not ignored; one that cannot change the output is accepted
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       presence_penalty=0.5)
    assert "presence_penalty is not supported" in str(e.value)
    refused = httpx.post(server.base + "/v1/completions", timeout=TIMEOUT,
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0, "frobnicate": [1]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "frobnicate"
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, n=1, user="u",
                                   presence_penalty=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_real_http_refuses_other_hosts_origins_and_non_json(server):
    """The checks hold through uvicorn too (the in-process tests cover them in detail)."""
    url = server.base + "/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    r = httpx.post(url, json=body, headers={"Host": f"rebound.example:{server.port}"}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    r = httpx.post(url, json=body, headers={"Origin": "https://evil.example"}, timeout=TIMEOUT)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(url, content=json.dumps(body), headers={"Content-Type": "text/plain"}, timeout=TIMEOUT)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(url, json=body, headers={"Host": f"localhost:{server.port}"}, timeout=TIMEOUT)
    assert r.status_code == 200


def test_metrics_text(server):
    text = httpx.get(server.base + "/metrics", timeout=TIMEOUT).text
    for name in ("requests_running", "requests_queued", "tokens_generated_total", "oracle_passes_total",
                 "mean_accepted_length", "stage_tokens_total", "stage_seconds_total", "memory_in_use_bytes"):
        assert f"# TYPE stagedspec_{name} " in text, name
    assert server.metric("tokens_generated_total") > 0
    assert server.metric("memory_in_use_bytes") > 0


def test_bench_serve_smoke(server, tmp_path, capsys):
    from stagedspec.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello the\n\nin the in\n\ndef f(x):\n")
    args = ["bench-serve", "--url", server.base + "/v1", "--prompts", str(prompts), "--concurrency", "1,2",
            "--requests", "2", "--max-tokens", "4"]
    assert main([*args, "--json"]) == 0
    levels = json.loads(capsys.readouterr().out)["levels"]
    assert [(lv["method"], lv["concurrency"]) for lv in levels] == [
        ("server default", 1), ("server default", 2), ("ar", 1), ("ar", 2)]
    assert all(lv["tokens"] > 0 and lv["tokens_per_second"] > 0 and lv["mean_accepted_length"] >= 1
               for lv in levels)
    assert main([*args, "--methods", "tree,ar", "--chat"]) == 0
    out = capsys.readouterr().out
    assert "speculation on (tree) vs off (ar)" in out and "agg tok/s" in out


def test_bench_serve_soak_counts_requests_and_reads_resident_memory(server, tmp_path, capsys):
    """A short soak (3 s, bounded): requests keep flowing, /metrics reports the server's resident memory,
    and the verdict is a pass when nothing failed and memory stayed within the tolerance."""
    from stagedspec.bench.serve import soak_verdict
    from stagedspec.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello the\n\nin the in\n")
    args = ["bench-serve", "--url", server.base + "/v1", "--prompts", str(prompts), "--concurrency", "2",
            "--max-tokens", "4", "--soak-minutes", "0.05", "--soak-sample", "0.5", "--soak-tolerance", "0.5"]
    rc = main([*args, "--json"])
    soak = json.loads(capsys.readouterr().out)["soak"]
    assert soak["errors"] == 0 and soak["requests"] >= 2 and soak["tokens"] > 0
    assert len(soak["rss_samples"]) >= 2 and all(rss > 10 * 2**20 for _, rss in soak["rss_samples"])
    assert rc == (0 if soak["passed"] else 1) and soak["passed"] == (soak["growth"] <= 0.5)
    assert soak_verdict([(0.0, 100), (5.0, 200), (6.0, 210), (9.0, 205)], warmup=2.0, tolerance=0.05) == (200, 210, 0.05)
    assert soak_verdict([(0.0, 100), (5.0, 200), (6.0, 211)], warmup=2.0, tolerance=0.05)[2] > 0.05


def test_bench_serve_runs_the_same_levels_against_llama_server(server, tmp_path, monkeypatch, capsys):
    """`--llamacpp`: llama-server's levels (here a stand-in: this test's own server behind the launcher's
    interface) are labelled, started with -np = the top concurrency, stopped, and set beside ours."""
    import stagedspec.bench.llamacpp as llamacpp
    from stagedspec.cli import main

    started = []

    class StandIn:
        def __init__(self, binary, model, flags, threads, context, parallel):  # noqa: ANN001
            started.append((Path(model).suffix, list(flags), threads, context, parallel))
            self.url, self.closed = server.base + "/v1", False

        def log_tail(self, lines: int) -> list[str]:
            return []

        def close(self) -> None:
            started.append("closed")

    monkeypatch.setattr(llamacpp, "LlamaServer", StandIn)
    monkeypatch.setattr(llamacpp, "bin_dir", lambda: tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello the\n\nin the in\n")
    args = ["bench-serve", "--url", server.base + "/v1", "--prompts", str(prompts), "--concurrency", "1,2",
            "--requests", "2", "--max-tokens", "4", "--methods", "ar", "--llamacpp", str(gguf),
            "--llamacpp-draft", str(gguf), "--llamacpp-threads", "1"]
    assert main([*args, "--json"]) == 0
    levels = json.loads(capsys.readouterr().out)["levels"]
    assert [(lv["method"], lv["concurrency"]) for lv in levels] == [
        ("ar", 1), ("ar", 2), ("llama-server", 1), ("llama-server", 2), ("llama-server -md", 1),
        ("llama-server -md", 2)]
    assert all(lv["tokens"] > 0 for lv in levels)
    assert started[0] == (".gguf", [], 1, 4096, 2) and started[1] == "closed"
    assert started[2][1][:2] == ["-md", str(gguf)] and started[3] == "closed"
    assert main(args) == 0
    assert "ar vs llama-server -md, aggregate tokens/s" in capsys.readouterr().out
    monkeypatch.setattr(llamacpp, "bin_dir", lambda: None)
    assert main(args) == 2
    assert "llama.cpp is not built" in capsys.readouterr().err


def test_bench_serve_without_a_server(capsys):
    from _server import free_port

    from stagedspec.cli import main

    assert main(["bench-serve", "--url", f"http://127.0.0.1:{free_port()}/v1", "--prompts", __file__]) == 2
    assert "cannot reach a server" in capsys.readouterr().err


def test_waiting_client_that_goes_away_is_cancelled(server):
    cancelled = 'requests_total{outcome="cancelled"}'
    before = server.metric(cancelled) if "cancelled" in httpx.get(server.base + "/metrics").text else 0
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 120, "temperature": 1.0, "seed": 2,
            "speculation": {"method": "ar"}}
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up while it waits
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    assert wait_for(lambda: server.metric(cancelled) == before + 1), "the request was not cancelled"
    assert wait_for(lambda: server.metric("requests_running") == 0)
