"""Exactness under continuous batching: 8 concurrent streams, each equal to its solo run.

Eight requests of different prompts and lengths start at staggered times and
stream concurrently through `AsyncOpenAI`; each one's token ids and text must
equal what `Pipeline.generate` produces for the same request alone, in this
process, for `ar`, `tree`, `staged` and `auto`, greedy and seeded sampling, in
fp32 (seeded there without the equality: fp32 batched passes are not
row-exact, so the fp32 server does not claim it, and the test holds it to
saying so in `/v1/models`; every other check of those requests is strict); in
bf16 for `staged`; with `--bit-exact` for `ar`, `tree` and `staged`; and with
the oracle's weight format forced to int4 and to int8 (`--quant`, the native
kernels) for `ar`, `tree` and `staged`.  The
server batches the requests' passes (ragged passes: they share the matmuls,
each attends over its own cache); the interleaved scheduler
(`--no-batch-passes`) is checked too.  See docs/serving.md, "Batched passes".
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from _server import ServerProcess, tiny_model_folder  # noqa: E402

from stagedspec.models.draft_formats import truncated_copy  # noqa: E402
from stagedspec.models.loading import load_model  # noqa: E402
from stagedspec.pipeline import Pipeline, SpeculationConfig  # noqa: E402
from stagedspec.sampling import SamplingParams  # noqa: E402

MODEL = "tiny-llama"
PROMPTS = ["Hello the", "in the in", "def f(x):", "1 2 3 4", "the cat sat", "import os", "<p>hi", "zzz"]

pytestmark = pytest.mark.usefixtures("one_thread")  # the server runs one thread too: same kernels


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("serve-exact"))


@pytest.fixture(scope="module")
def server_env(shared_cost_cache, isolated_cache_env):  # noqa: ANN001, ANN201
    """The servers' environment: they and this process's solo runs read cost profiles from one folder."""
    return {**isolated_cache_env, "STAGEDSPEC_SERVE_ROUND_PAUSE": "0.01"}


@contextlib.contextmanager
def one_torch_thread():  # noqa: ANN201
    """Load models as the servers run them, on one thread.

    Why: the fp32 kernel plan and the cost profile are keyed by the thread count (`hardware.fingerprint`).
    A solo model loaded at the machine's thread count gets the plan timed for that count, whose kernels can
    round the last bit of a logit differently from the one-thread server's, and a seeded sample near a
    boundary then differs (seen in about one run in ten on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pin_cost_profile(folder, dtype: str, quant: str) -> None:  # noqa: ANN001
    """Measure the cost profile a server of this configuration and its solo runs price arms by, and write it
    where both read it, before the server starts.

    Why: `auto` and measured sizing price arms by the machine's cost profile, and a seeded request's sample
    depends on the arms chosen.  Left to each process, the server and this test process measure a profile of
    their own, and one measured while the machine is busy is used for that process only and not cached
    (`profiling.load_or_measure`): the two then price by different timings and a seeded `auto` request chooses
    other arms than its solo run.  One written profile gives both the same prices."""
    from stagedspec import costs, profiling
    from stagedspec.paths import write_text_atomic

    with one_torch_thread():
        # the models as the server loads them (a quantised oracle's draft is planned and formatted there)
        pipe = Pipeline.load(str(folder), "layers:1", speculation=SpeculationConfig(method="tree"), dtype=dtype,
                             quant=quant)
        path = costs.profile_path(profiling.profile_key(pipe.model, pipe.draft_models, "cpu"))
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            profile = profiling.measure_profile(pipe.model, pipe.draft_models, "cpu", quiet=True)
            write_text_atomic(path, profile.to_json())


def start_server(folder, env: dict[str, str], dtype: str, *extra: str):  # noqa: ANN001, ANN201
    quant = extra[extra.index("--quant") + 1] if "--quant" in extra else "none"
    pin_cost_profile(folder, dtype, quant)
    srv = ServerProcess(["--oracle", str(folder), "--draft", "layers:1", "--method", "tree", "--dtype", dtype,
                         "--max-batch", "8", *extra], env=env)
    yield srv
    log = srv.stop()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def server(folder, server_env):  # noqa: ANN001, ANN201
    yield from start_server(folder, server_env, "fp32")


@pytest.fixture(scope="module")
def server_bf16(folder, server_env):  # noqa: ANN001, ANN201
    yield from start_server(folder, server_env, "bf16")


@pytest.fixture(scope="module")
def server_bit_exact(folder, server_env):  # noqa: ANN001, ANN201
    yield from start_server(folder, server_env, "bf16", "--bit-exact")


@pytest.fixture(scope="module")
def server_interleaved(folder, server_env):  # noqa: ANN001, ANN201
    yield from start_server(folder, server_env, "fp32", "--no-batch-passes")


# A case's request extension and the solo configuration it must equal.  The servers start with no size flag,
# so tree and staged requests run measured sizing (`SpeculationConfig.sizing`) unless they name a tree_budget.
FIXED_TREE_BUDGET = 6


def request_of(case: str) -> dict:
    if case == "tree-fixed":
        return {"method": "tree", "tree_budget": FIXED_TREE_BUDGET}
    return {"method": case}


def solo_spec(case: str) -> SpeculationConfig:
    if case == "tree-fixed":
        return SpeculationConfig(method="tree", tree_budget=FIXED_TREE_BUDGET)
    return SpeculationConfig(method=case, sizing="measured")


def solo_runner(folder, dtype: torch.dtype, bit_exact: bool = False):  # noqa: ANN001, ANN201
    with one_torch_thread():
        model, tok = load_model(folder, dtype=dtype)
        draft = truncated_copy(model, 1)

    def run(case: str, prompt: str, max_tokens: int, sampling: SamplingParams, seed: int | None):  # noqa: ANN202
        pipe = Pipeline(model, tok, [draft], solo_spec(case))
        pipe.bit_exact = bit_exact
        out = pipe.generate(prompt, max_new_tokens=max_tokens, sampling=sampling, seed=seed)
        return out.token_ids, out.text

    return run


@pytest.fixture(scope="module")
def solo(folder):
    return solo_runner(folder, torch.float32)


async def one_stream(client, i: int, case: str, temperature: float):  # noqa: ANN001, ANN201
    await asyncio.sleep(0.03 * i)  # staggered arrivals: requests join a running batch
    t0 = time.monotonic()
    text, ext = "", None
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPTS[i], max_tokens=6 + 5 * i, temperature=temperature, seed=100 + i, stream=True,
        extra_body={"speculation": request_of(case)})
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            if choice.finish_reason is not None:
                ext = chunk.model_extra["stagedspec"]
    return text, ext, (t0, time.monotonic())


def exactness_claim(server) -> dict:  # noqa: ANN001
    """What the server says in `/v1/models` about a request's output against its solo run."""
    import httpx

    return httpx.get(server.base + "/v1/models", timeout=10).json()["data"][0]["stagedspec"]


def test_fp32_server_says_its_batched_passes_are_not_row_exact(server):
    """fp32 batched passes run the fp32 kernel plan (`models.matmul_plan`) at the pass's total row count, which can
    round a logit's last bit differently from the solo pass's; a seeded draw that falls that close to a boundary
    then differs (seen for `auto`, request 4, token 6, in about one run in ten on 2 cores: 182 or 290 either way).
    The server must say so, and say what makes it exact, rather than let the README's guarantee mislead."""
    claim = exactness_claim(server)
    assert claim["exact_under_batching"] == {"greedy": False, "seeded": False}, claim
    note = claim["note"]
    assert "float32 oracle are not row-exact" in note and "--quant" in note and "--no-batch-passes" in note, note


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ar", "tree", "tree-fixed", "staged", "auto"])
def test_eight_concurrent_streams_equal_solo_runs(server, solo, method, temperature):
    """Greedy fp32 output equals the solo runs in every run, although the server claims it only for row-exact
    passes: held strictly.  A seeded fp32 sample is held to its solo run only where `/v1/models` claims it (it
    does not, `test_fp32_server_says_its_batched_passes_are_not_row_exact`); every other check is strict."""
    claimed = exactness_claim(server)["exact_under_batching"]["seeded"]
    check_concurrent_equals_solo(server, solo, method, temperature, equal=temperature == 0.0 or claimed)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_bf16_concurrent_streams_equal_solo_runs(server_bf16, folder, temperature):
    check_concurrent_equals_solo(server_bf16, solo_runner(folder, torch.bfloat16), "staged", temperature)


@pytest.mark.parametrize("method", ["ar", "tree", "staged"])
def test_bit_exact_concurrent_streams_equal_solo_runs(server_bit_exact, folder, method):
    check_concurrent_equals_solo(server_bit_exact, solo_runner(folder, torch.bfloat16, bit_exact=True), method, 0.0)


@pytest.mark.parametrize("method", ["ar", "staged"])
def test_interleaved_scheduler_still_equals_solo_runs(server_interleaved, solo, method):
    check_concurrent_equals_solo(server_interleaved, solo, method, 1.0, batched=False)


def check_concurrent_equals_solo(server, solo, method: str, temperature: float,  # noqa: ANN001
                                 batched: bool = True, equal: bool = True) -> None:
    """8 staggered streams: each one's reply names its method and has 1 to `max_tokens` tokens, the requests
    overlapped, and passes carried several requests exactly when `batched`; with `equal`, each reply's token ids
    and text are its solo run's."""
    before = server.metric("batched_request_passes_total") - server.metric("batched_passes_total")

    async def main():  # noqa: ANN202
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", timeout=60,
                                      max_retries=0) as client:
            return await asyncio.gather(*(one_stream(client, i, method, temperature) for i in range(8)))

    results = asyncio.run(main())
    sampling = SamplingParams(temperature=temperature)
    for i, (text, ext, _) in enumerate(results):
        assert ext is not None and ext["method"] == request_of(method)["method"]
        assert 1 <= len(ext["token_ids"]) <= 6 + 5 * i, f"request {i}: {len(ext['token_ids'])} tokens"
        if equal:
            ids, solo_text = solo(method, PROMPTS[i], 6 + 5 * i, sampling, 100 + i)
            assert ext["token_ids"] == ids, f"request {i} differs from its solo run"
            assert text == solo_text
    spans = sorted(span for _, _, span in results)
    overlapping = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert overlapping >= 2, "the requests did not overlap: the test exercised no batching"
    # passes that carried several requests: each adds (requests - 1) to this difference
    shared = server.metric("batched_request_passes_total") - server.metric("batched_passes_total") - before
    assert (shared > 0) == batched


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantised(request, folder, server_env):  # noqa: ANN001, ANN201
    """A server whose oracle runs the forced weight format (not one chosen per machine), and its solo runner."""
    from _native import native_kernels_or_fail

    native_kernels_or_fail()  # quantised oracles are row-exact only on them: a failed build fails, not skips
    gen = start_server(folder, server_env, "fp32", "--quant", request.param, "--model-name", MODEL)
    srv = next(gen)
    with one_torch_thread():  # the models as the server loads them: its quantised oracle's draft runs int8
        loaded = Pipeline.load(str(folder), "layers:1", speculation=SpeculationConfig(method="tree"), dtype="fp32",
                               quant=request.param)

    def run(case: str, prompt: str, max_tokens: int, sampling: SamplingParams, seed: int | None):  # noqa: ANN202
        pipe = Pipeline(loaded.model, loaded.tokenizer, loaded.draft_models, solo_spec(case))
        out = pipe.generate(prompt, max_new_tokens=max_tokens, sampling=sampling, seed=seed)
        return out.token_ids, out.text

    yield srv, run
    next(gen, None)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ar", "tree-fixed", "staged"])
def test_quantised_oracle_concurrent_streams_equal_solo_runs(quantised, method, temperature):  # noqa: ANN001
    """`serve --quant int4|int8`: its batched passes run every block in one native call per round, and each of
    8 concurrent streams is its solo run, token for token."""
    server, solo = quantised
    check_concurrent_equals_solo(server, solo, method, temperature)
