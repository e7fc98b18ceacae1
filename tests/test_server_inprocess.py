"""Server pieces that need no subprocess: the API key, /health while loading, admission by memory,
sizes, and the CLI's one-line errors (stop strings: test_stops.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("fastapi")

from _server import local_client, tiny_engine  # noqa: E402
from stagedspec.errors import StagedSpecError  # noqa: E402
from stagedspec.pipeline import SpeculationConfig  # noqa: E402
from stagedspec.server.app import create_app  # noqa: E402
from stagedspec.pipeline import Pipeline  # noqa: E402
from stagedspec.sampling import SamplingParams  # noqa: E402
from stagedspec.server.engine import Engine, parse_size  # noqa: E402
from stagedspec.server.scheduler import Job, Scheduler  # noqa: E402
from stagedspec.server.schemas import APIError  # noqa: E402
from stagedspec.request_plan import plan_request  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("inproc"))


BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}


def test_api_key_required(engine):
    with local_client(create_app(engine, api_key="s3cret", log=lambda s: None)) as c:
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

    with local_client(create_app(loader=slow_loader, log=lambda s: None)) as c:
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
    with local_client(create_app(loader=broken, log=lambda s: None, on_load_error=seen.append)) as c:
        deadline = time.monotonic() + 10
        while not seen:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.get("/health")
        assert r.status_code == 503 and "no such model folder" in r.json()["error"]
    assert seen == ["no such model folder"]


def test_memory_budget_admission(engine):
    mem = engine.memory_model()
    one = mem.request_kv(engine.cache_slots(2, 3, engine.speculation), engine.speculation.max_tree_budget, True)
    budget = mem.weights + mem.scratch + one  # room for exactly one small request's KV
    # interleaved steps: tree scratch is counted once, so the rest is KV only
    with local_client(create_app(engine, max_memory=budget, log=lambda s: None, batch_passes=False)) as c:
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 100})  # its KV can never fit
        assert r.status_code == 400 and r.json()["error"]["code"] == "memory_budget_exceeded"
        assert c.post("/v1/completions", json=BODY).status_code == 200
        assert "stagedspec_memory_budget_bytes %d" % budget in c.get("/metrics").text


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


def job(prompt_ids, max_tokens=8, spec=None, temperature=0.0, seed=None):  # noqa: ANN001, ANN201
    plan = plan_request(list(prompt_ids), max_new_tokens=max_tokens, context=2048,
                        speculation=spec or SpeculationConfig(method="tree"), temperature=temperature, seed=seed)
    return Job(plan, lambda ev: None)


def kv_of(engine, j: Job) -> int:  # noqa: ANN001
    spec = j.plan.speculation
    mem = engine.memory_model()
    return mem.request_kv(engine.cache_slots(len(j.plan.prompt_ids), j.plan.max_new_tokens, spec),
                          spec.max_tree_budget, True)


def test_memory_pressure_shrinks_tree_budgets_in_steps_and_regrows(engine):
    """Admission under a small budget: a newcomer shrinks running trees a level (half the nodes) at a time,
    newest first, only as far as it needs; leftovers go back oldest first; a finish restores full trees."""
    spec = engine.speculation
    N = spec.max_tree_budget  # 12: levels cap 12 (full), 6, 3, 1, 0 (root-only); rows charged = nodes + 2
    assert N == 12
    jobs = [job([5 + i, 6, 7], max_tokens=8) for i in range(4)]
    for j in jobs:
        j.kv_bytes = kv_of(engine, j)
    probe = Scheduler(engine, max_batch=4)
    r = probe.row_bytes
    assert probe._charge(jobs[0], 0) - probe._charge(jobs[0], 4) == 12 * r  # noqa: SLF001
    # a, b, c fit with full trees; d's KV fits too, but its root-only pass needs 14 rows more than are left
    full = sum(probe._charge(j, 0) for j in jobs[:3])  # noqa: SLF001
    budget = probe.base_bytes + full + jobs[3].kv_bytes + 2 * r - 14 * r
    sched = Scheduler(engine, max_batch=4, max_memory=budget)
    for j in jobs[:3]:
        sched.submit(j)

    def admit() -> list[int]:
        with sched._cond:  # noqa: SLF001
            joining = sched._admit()  # noqa: SLF001
            sched._publish()  # noqa: SLF001
        for jn in joining:
            sched._start(jn.job, jn.level)  # noqa: SLF001
        with sched._cond:  # noqa: SLF001
            sched._publish()  # noqa: SLF001
        return [run.level for run in sched._running]  # noqa: SLF001

    try:
        assert admit() == [0, 0, 0]
        sched.submit(jobs[3])
        # d needs 14 rows: c (newest) gives 6 + 3 + 2 + 1 down to root-only, then b 6 (full -> half);
        # the 4 rows left over go back oldest first: b's next level (6) does not fit, c gets 1 + 2, d 1
        levels = admit()
        assert levels == [0, 1, 2, 3]
        assert [run.switch.cap for run in sched._running] == [None, 6, 3, 1]  # noqa: SLF001
        assert sched._free() >= 0  # noqa: SLF001
        assert sched.metrics.tree_levels == {1: 1, 2: 1, 3: 1} and sched.metrics.trees_off == 0
        text = sched.metrics.render()
        assert 'stagedspec_requests_tree_shrunk{level="2"} 1' in text
        assert "stagedspec_requests_speculation_off 0" in text
        # a finishes: everyone grows back, oldest first, to full trees
        sched._finish(sched._running[0], "completed")  # noqa: SLF001
        assert admit() == [0, 0, 0]
        assert sched.metrics.tree_levels == {}
        in_use = sum(sched._charge(run.job, 0) for run in sched._running)  # noqa: SLF001
        assert sched._kv_in_use == in_use  # noqa: SLF001
    finally:
        for run in list(sched._running):  # noqa: SLF001
            sched._finish(run, "cancelled")  # noqa: SLF001
    assert sched._kv_in_use == 0  # noqa: SLF001


def test_memory_pressure_never_shrinks_a_seeded_sampled_request(engine):
    """A seeded sampled request's sample depends on its trees, and it must equal its solo run: under pressure
    it keeps its full tree, the others shrink for it, and a newcomer that would need it to shrink waits."""
    # b and c: seeded, sampled
    jobs = [job([5 + i, 6, 7], max_tokens=8, **(dict(temperature=1.0, seed=7) if i in (1, 2) else {}))
            for i in range(4)]
    for j in jobs:
        j.kv_bytes = kv_of(engine, j)
    probe = Scheduler(engine, max_batch=4)
    r = probe.row_bytes
    full = sum(probe._charge(j, 0) for j in jobs[:3])  # noqa: SLF001
    # d needs 14 rows more than are left; only a (greedy) may shrink, and its 12 rows are not enough
    budget = probe.base_bytes + full + jobs[3].kv_bytes + 2 * r - 14 * r
    sched = Scheduler(engine, max_batch=4, max_memory=budget)
    for j in jobs:
        sched.submit(j)
    try:
        with sched._cond:  # noqa: SLF001
            joining = sched._admit()  # noqa: SLF001
        assert [(jn.job is j, jn.level) for jn, j in zip(joining, jobs)] == [(True, 0)] * 3
        assert list(sched._waiting) == [jobs[3]]  # noqa: SLF001 - d waits: b and c keep their trees
        # a seeded sampled newcomer is admitted only at its full tree: the greedy a shrinks for it
        e = job([9, 6, 7], max_tokens=8, temperature=1.0, seed=3)
        e.kv_bytes = kv_of(engine, e)
        assert sched._floor(e) == 0 and sched._floor(jobs[0]) > 0  # noqa: SLF001
        # one whose full tree could never fit is told so (400), not served on a shrunk tree
        tight = Scheduler(engine, max_batch=1, max_memory=probe.base_bytes + probe._charge(e, 4))  # noqa: SLF001
        with pytest.raises(APIError, match="runs its full tree"):
            tight.submit(e)
    finally:
        with sched._cond:  # noqa: SLF001
            for jn in joining:
                sched._kv_in_use -= sched._charge(jn.job, jn.level)  # noqa: SLF001


def test_capped_drafter_cuts_every_tree_to_its_level():
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.server.pressure import CappedDrafter

    lookup = LookupDrafter(None, True, chain_length=6)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    capped = CappedDrafter(lookup, max_tree_budget=12)
    capped.begin(prompt)
    greedy = SamplingParams(temperature=0.0)
    sizes = []
    for level in range(5):
        capped.level = level
        sizes.append(len(capped.propose(prompt, greedy, None, 16)) - 1)
    assert sizes == [6, 6, 3, 1, 0]
    assert capped.skipped_steps == 1 and dict(capped.level_steps) == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}


def test_batched_memory_pressure_shrinks_running_trees_and_output_stays_exact(engine):
    """b's tree shrinks (two levels) while it runs, so that c can join with a root-only tree; a request that
    cannot fit even root-only is refused.  Greedy fp32 outputs equal the solo runs; the stats show the levels."""
    spec = engine.speculation
    probe = Scheduler(engine, max_batch=3)
    prompts = [engine.tokenizer.encode("Hello the"), engine.tokenizer.encode("in the in"), [5, 6, 7, 8]]
    a, b, c = job(prompts[0], 24), job(prompts[1], 24), job(prompts[2], 8)
    for j in (a, b, c):
        j.kv_bytes = kv_of(engine, j)
    r = probe.row_bytes
    floor = probe._charge(c, 4)  # noqa: SLF001
    with pytest.raises(APIError, match="does not fit"):  # not even its KV and a root-only pass fit
        Scheduler(engine, max_batch=2, max_memory=probe.base_bytes + floor - 1).submit(job(prompts[2]))
    # a and b with full trees, then c needs 9 rows more than are left: b (newest running) gives 6 + 3
    budget = probe.base_bytes + probe._charge(a, 0) + probe._charge(b, 0) + floor - 9 * r  # noqa: SLF001
    sched = Scheduler(engine, max_batch=3, max_memory=budget, round_pause=0.02)
    events: list[list] = [[], [], []]
    done = threading.Semaphore(0)
    for i, j in enumerate((a, b, c)):
        def deliver(ev, i=i):  # noqa: ANN001, ANN202
            events[i].append(ev)
            if ev[0] in ("done", "error"):
                done.release()
        j.deliver = deliver
    sched.submit(a)
    sched.submit(b)
    sched.start()
    try:
        deadline = time.monotonic() + 30
        while not (events[0] and events[1]):  # both are decoding
            assert time.monotonic() < deadline
            time.sleep(0.005)
        sched.submit(c)
        for _ in range(3):
            assert done.acquire(timeout=60), "a request never finished"
    finally:
        sched.stop()
    infos = [ev[-1][2] for ev in events]
    assert [ev[-1][0] for ev in events] == ["done", "done", "done"]
    assert set(infos[0]["tree_levels"]) == {"0"}
    assert "2" in infos[1]["tree_levels"] and infos[1]["tree_caps"]["2"] == 3  # shrunk to a quarter, mid-request
    assert infos[2]["speculation_off_steps"] > 0
    assert sched.metrics.requests["completed"] == 3 and sched.metrics.queued == 0
    for p, j, info in zip(prompts, (a, b, c), infos):
        solo = Pipeline(engine.model, engine.tokenizer, engine.draft_models, spec).generate(
            p, max_new_tokens=j.plan.max_new_tokens)
        assert info["token_ids"] == solo.token_ids
    assert sched.metrics.ragged_passes > 0 and sched.metrics.ragged_segments > sched.metrics.ragged_passes


def test_batched_pass_error_reaches_the_request_not_the_server(engine, monkeypatch):
    import stagedspec.server.batching as batching

    def broken(model, segments, pad=False):  # noqa: ANN001, ANN202
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


@pytest.fixture(scope="module")
def feature_engine(engine):
    from stagedspec.models.feature_draft import FeatureDraftModel

    torch.manual_seed(0)
    draft = FeatureDraftModel(engine.model, 1)
    with torch.no_grad():  # not the identity-like start: the fused features must matter
        draft.fc.weight.add_(0.05 * torch.randn_like(draft.fc.weight))
    return Engine(engine.model, engine.tokenizer, [draft], SpeculationConfig(method="tree"), model_name="tiny",
                  draft_names=["feature"])


@pytest.mark.parametrize("method", ["tree", "staged"])
def test_feature_draft_passes_join_the_ragged_passes(feature_engine, method, monkeypatch):
    """5 concurrent requests with a feature (EAGLE-style) draft: each request's greedy fp32 output equals its solo
    run, and the draft's passes (input: fc(oracle feature, embedding)) ran batched, several requests a pass."""
    import stagedspec.server.batching as batching

    eng = feature_engine
    draft = eng.draft_models[0]
    seen: dict[str, list[int]] = {"draft": [], "oracle": []}
    real = batching.forward_ragged

    def counting(model, segments, pad=False):  # noqa: ANN001, ANN202
        if model is draft:
            assert all(s.spec.features is not None and s.spec.wants_hidden for s in segments)
        seen["draft" if model is draft else "oracle"].append(len(segments))
        return real(model, segments, pad=pad)

    monkeypatch.setattr(batching, "forward_ragged", counting)
    spec = SpeculationConfig(method=method)
    prompts = [eng.tokenizer.encode(t) for t in ("Hello the", "in the in", "def f(x):", "1 2 3 4", "the cat sat")]
    sched = Scheduler(eng, max_batch=5)
    jobs = [job(p, max_tokens=12, spec=spec) for p in prompts]
    sched.start()
    try:
        events = run_jobs(sched, jobs)
    finally:
        sched.stop()
    infos = [ev[-1][2] for ev in events]
    assert [ev[-1][0] for ev in events] == ["done"] * 5
    for i, (p, info) in enumerate(zip(prompts, infos)):
        solo = Pipeline(eng.model, eng.tokenizer, [draft], spec).generate(p, max_new_tokens=12)
        assert info["token_ids"] == solo.token_ids, f"request {i} differs from its solo run"
        # the same proposals as alone: the served draft reads the oracle's hidden states too
        assert info["tokens_by_stage"] == dict(Counter(solo.stats.token_origins))
    draft_calls = sum(row["forward_passes"] for info in infos for row in info["stages"] if row["stage"] == "draft")
    # every draft pass of a round with others went through a ragged pass (a request alone in its round runs
    # its passes as plain ones: `Scheduler._round`) ...
    assert draft_calls >= sum(seen["draft"]) > draft_calls // 2
    assert len(seen["draft"]) < draft_calls and max(seen["draft"]) >= 4  # ... which carried several requests
    assert max(seen["oracle"]) >= 4  # the oracle's passes (hidden states recorded for the draft) too
    assert sum(info["tokens_by_stage"].get("draft", 0) for info in infos) > 0


def test_batched_auto_prices_steps_by_the_shared_round_and_stays_exact(engine, monkeypatch, private_cost_cache):
    """With batched passes, `auto`'s greedy requests see the round they share (`auto.SharedLoad`: the other
    requests, their rows and the measured round), built from finished rounds only; a seeded sampled request
    is priced alone (its draws must be its solo run's).  Every output equals its solo run."""
    import dataclasses

    from stagedspec.auto import AutoPolicy, SharedLoad
    from stagedspec.learned_state import LearnedState

    seen: list[tuple[int, SharedLoad | None]] = []
    real = AutoPolicy.choose

    def choose(self, sampling, lookup_lengths, max_tree_budget=None, load=None, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append((0 if sampling.greedy else 1, load))
        return real(self, sampling, lookup_lengths, max_tree_budget, load, **kw)

    monkeypatch.setattr(AutoPolicy, "choose", choose)
    eng = dataclasses.replace(engine, learned=LearnedState(), speculation=SpeculationConfig(method="auto"))
    spec = SpeculationConfig(method="auto")
    prompts = [engine.tokenizer.encode(p) for p in ("Hello the", "in the in", "def f(x):", "1 2 3 4")]
    jobs = [job(p, 10 + 3 * i, spec) for i, p in enumerate(prompts)]
    seeded = job(prompts[0], 12, spec, temperature=1.0, seed=5)
    sched = Scheduler(eng, max_batch=5)
    sched.start()
    try:
        events = run_jobs(sched, [*jobs, seeded])
    finally:
        sched.stop()
    shared = [load for kind, load in seen if kind == 0 and load is not None and load.others]
    assert shared and all(load.seconds > 0 and load.tokens > 0 for load in shared)
    assert max(load.others for load in shared) == 4 and any(load.oracle_rows > 0 for load in shared)
    assert all(load is None for kind, load in seen if kind == 1)  # the seeded request: priced alone
    for j, ev in zip([*jobs, seeded], events):
        assert ev[-1][0] == "done"
        solo = Pipeline(engine.model, engine.tokenizer, engine.draft_models, spec).generate(
            j.plan.prompt_ids, max_new_tokens=j.plan.max_new_tokens, sampling=j.plan.sampling, seed=j.plan.seed)
        assert ev[-1][2]["token_ids"] == solo.token_ids


def test_the_model_answers_to_the_names_a_user_would_try(engine):
    """Its id, and the spec the server was started with (`"model": "default"` was a 404); replies still name the
    id, and another name is still a 404."""
    import dataclasses

    started = dataclasses.replace(engine, model_aliases=("default", "SmolLM2-135M-Instruct"))
    with local_client(create_app(started, log=lambda s: None)) as c:
        for name in ("tiny", "default", "SmolLM2-135M-Instruct"):
            r = c.post("/v1/completions", json=BODY | {"model": name})
            assert r.status_code == 200 and r.json()["model"] == "tiny", name
            assert c.get(f"/v1/models/{name}").json()["id"] == "tiny"
        r = c.post("/v1/completions", json=BODY | {"model": "qwen2.5-coder-1.5b"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
