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
from stagedspec.pipeline import Pipeline  # noqa: E402
from stagedspec.sampling import SamplingParams  # noqa: E402
from stagedspec.server.engine import Engine, parse_size  # noqa: E402
from stagedspec.server.scheduler import Job, Scheduler  # noqa: E402
from stagedspec.server.schemas import APIError  # noqa: E402
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
    # interleaved steps: tree scratch is counted once, so the rest is KV only
    with TestClient(create_app(engine, max_memory=budget, log=lambda s: None, batch_passes=False)) as c:
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


def run_jobs(sched: Scheduler, jobs: list[Job], timeout: float = 60) -> list[list]:
    """Submit `jobs` at once to a started scheduler; each job's events, once all are done."""
    events: list[list] = [[] for _ in jobs]
    done = threading.Semaphore(0)
    for i, job in enumerate(jobs):
        def deliver(ev, i=i):  # noqa: ANN001, ANN202
            events[i].append(ev)
            if ev[0] in ("done", "error"):
                done.release()
        job.deliver = deliver
    for job in jobs:
        sched.submit(job)
    for _ in jobs:
        assert done.acquire(timeout=timeout), "a request never finished"
    return events


def job(prompt_ids, max_tokens=8, spec=None):  # noqa: ANN001, ANN201
    return Job(list(prompt_ids), max_tokens, SamplingParams(temperature=0.0), None, [],
               spec or SpeculationConfig(method="tree"), lambda ev: None)


def test_batched_memory_pressure_shrinks_trees_instead_of_queueing(engine):
    """Room for two requests' KV but one request's tree rows: both run at once, one without its tree,
    and greedy outputs still equal the solo runs; a request that cannot fit even without a tree is refused."""
    spec = engine.speculation
    probe = Scheduler(engine, max_batch=2)
    prompts = [engine.tokenizer.encode("Hello the"), engine.tokenizer.encode("in the in")]
    a, b = job(prompts[0]), job(prompts[1])
    for j in (a, b):
        j.kv_bytes = probe.memory.request_kv(engine.cache_slots(len(j.prompt_ids), 8, spec), spec.max_nodes, True)
    full, bare = probe._charge(a, True), probe._charge(a, False)  # noqa: SLF001
    assert bare < full
    budget = probe.base_bytes + full + probe._charge(b, False) + (full - bare) // 2  # noqa: SLF001
    with pytest.raises(APIError, match="does not fit"):  # not even its KV and a root-only pass fit
        Scheduler(engine, max_batch=2, max_memory=probe.base_bytes + bare - 1).submit(job(prompts[0]))
    sched = Scheduler(engine, max_batch=2, max_memory=budget)
    sched.start()
    try:
        events = run_jobs(sched, [a, b])
    finally:
        sched.stop()
    infos = [ev[-1][2] for ev in events]
    assert [ev[-1][0] for ev in events] == ["done", "done"]
    assert sorted(info["speculation_off_steps"] > 0 for info in infos) == [False, True]
    assert sched.metrics.requests["completed"] == 2 and sched.metrics.queued == 0
    for p, info in zip(prompts, infos):
        solo = Pipeline.from_loaded(engine.model, engine.tokenizer, engine.draft_models, spec).generate(
            p, max_new_tokens=8)
        assert info["token_ids"] == solo.token_ids
    assert sched.metrics.ragged_passes > 0 and sched.metrics.ragged_segments > sched.metrics.ragged_passes


def test_batched_pass_error_reaches_the_request_not_the_server(engine, monkeypatch):
    import stagedspec.server.batching as batching

    def broken(model, segments):  # noqa: ANN001, ANN202
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(batching, "forward_ragged", broken)
    sched = Scheduler(engine, max_batch=2)
    sched.start()
    try:
        events = run_jobs(sched, [job([5, 6, 7]), job([8, 9])])
        assert [ev[-1][:2] for ev in events] == [("error", 500), ("error", 500)]
        assert "kernel exploded" in events[0][-1][2]
        monkeypatch.undo()
        events = run_jobs(sched, [job([5, 6, 7], max_tokens=3)])  # the server still serves
        assert events[0][-1][0] == "done"
    finally:
        sched.stop()
