"""Server pieces that need no subprocess: the API key, /health while loading, admission by memory,
the stop-string stream, sizes, and the CLI's one-line errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from _server import tiny_model_folder  # noqa: E402
from stagedspec.errors import StagedSpecError  # noqa: E402
from stagedspec.models.loading import load_model  # noqa: E402
from stagedspec.pipeline import SpeculationConfig, truncated_copy  # noqa: E402
from stagedspec.server.app import create_app  # noqa: E402
from stagedspec.server.engine import Engine, parse_size  # noqa: E402
from stagedspec.server.text import StopTextStream  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model, tok = load_model(tiny_model_folder(tmp_path_factory.mktemp("inproc")), dtype=torch.float32)
    return Engine(model, tok, [truncated_copy(model, 1)], SpeculationConfig(method="tree"),
                  model_name="tiny", draft_names=["layers:1"])


BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}


def test_api_key_required(engine):
    with TestClient(create_app(engine, api_key="s3cret", log=lambda s: None)) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = c.post("/v1/completions", json=BODY, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers=headers).status_code == 401
        ok = c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
        assert c.get("/health").status_code == 200  # liveness needs no key


def test_health_503_while_loading(engine):
    release = threading.Event()

    def slow_loader() -> Engine:
        release.wait(10)
        return engine

    with TestClient(create_app(loader=slow_loader, log=lambda s: None)) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        release.set()
        deadline = time.monotonic() + 10
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.post("/v1/completions", json=BODY).status_code == 200


def test_failed_load_is_reported(engine):
    def broken() -> Engine:
        raise StagedSpecError("no such model folder")

    seen = []
    with TestClient(create_app(loader=broken, log=lambda s: None, on_load_error=seen.append)) as c:
        deadline = time.monotonic() + 10
        while not seen:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.get("/health")
        assert r.status_code == 503 and "no such model folder" in r.json()["error"]
    assert seen == ["no such model folder"]


def test_memory_budget_admission(engine):
    mem = engine.memory_model()
    one = mem.request_kv(engine.cache_slots(2, 3, engine.speculation), engine.speculation.max_nodes, True)
    budget = mem.weights + mem.scratch + one  # room for exactly one small request's KV
    with TestClient(create_app(engine, max_memory=budget, log=lambda s: None)) as c:
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 100})  # its KV can never fit
        assert r.status_code == 400 and r.json()["error"]["code"] == "memory_budget_exceeded"
        assert c.post("/v1/completions", json=BODY).status_code == 200
        assert "stagedspec_memory_budget_bytes %d" % budget in c.get("/metrics").text


def test_stop_text_stream_holds_back_a_possible_stop(engine):
    tok = engine.tokenizer
    ids = tok.encode("abcSTOPdef")
    s = StopTextStream(tok, ["STOP"])
    out = "".join(s.push([t]) for t in ids) + s.finish()
    assert out == "abc" and s.stopped
    s = StopTextStream(tok, ["STOPPER"])  # a stop string longer than all text so far is never half-emitted
    out = "".join(s.push([t]) for t in ids) + s.finish()
    assert out == "abcSTOPdef" and not s.stopped


def test_parse_size():
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5G") == int(1.5 * (1 << 30))
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1000") == 1000
    with pytest.raises(StagedSpecError):
        parse_size("lots")


def test_cli_serve_errors_in_one_line(capsys):
    from stagedspec.cli import main

    assert main(["serve", "--max-memory", "lots"]) == 2
    assert "stagedspec: error: bad size" in capsys.readouterr().err
