"""In-process measurement of the batched scheduler with the default models (no HTTP): exactness and speed.

For each method and dtype: 8 requests (HumanEval prompts, different max_tokens)
run through `Scheduler` with batched passes, all submitted at once; each
one's token ids are compared with its solo `Pipeline.generate`.  Then the
aggregate tokens/s of 1 vs 8 concurrent requests (batched, and interleaved
with --no-batch-passes).  Usage:
    PYTHONPATH=src python docs/bench/serve-batched/measure_inprocess.py [--dtype bf16] [--bit-exact] [--speed]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from stagedspec.bench.prompts import load_prompts
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams
from stagedspec.server.engine import Engine
from stagedspec.server.scheduler import Job, Scheduler


def run_jobs(sched: Scheduler, jobs: list[Job]) -> list[dict]:
    infos: list = [None] * len(jobs)
    done = threading.Semaphore(0)
    for i, job in enumerate(jobs):
        def deliver(ev, i=i):  # noqa: ANN001, ANN202
            if ev[0] in ("done", "error"):
                infos[i] = ev
                done.release()
        job.deliver = deliver
        sched.submit(job)
    for _ in jobs:
        done.acquire()
    return infos


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--bit-exact", action="store_true")
    ap.add_argument("--methods", default="ar,tree,staged")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--speed", action="store_true")
    args = ap.parse_args()
    engine = Engine.load("default", ["default"], SpeculationConfig(method="staged"), dtype=args.dtype,
                         bit_exact=args.bit_exact)
    ids = [engine.tokenizer.encode(p)[-200:] for p in load_prompts("humaneval", 8)]
    out: dict = {"dtype": args.dtype, "bit_exact": args.bit_exact, "threads": torch.get_num_threads()}
    greedy = SamplingParams(temperature=0.0)
    for method in args.methods.split(","):
        spec = engine.speculation_for(type("R", (), {"method": method, "draft": None, "tree_budget": None})())
        lengths = [args.tokens - 4 * i for i in range(8)]
        sched = Scheduler(engine, max_batch=8)
        sched.start()
        t0 = time.perf_counter()
        infos = run_jobs(sched, [Job(p, n, greedy, None, [], spec, None) for p, n in zip(ids, lengths)])
        batched_s = time.perf_counter() - t0
        sched.stop()
        same = tokens = agree = 0
        for p, n, ev in zip(ids, lengths, infos):
            solo = engine.pipeline(spec).generate(p, max_new_tokens=n).token_ids
            got = ev[2]["token_ids"]
            same += got == solo
            prefix = next((k for k, (a, b) in enumerate(zip(got, solo)) if a != b), min(len(got), len(solo)))
            agree += prefix
            tokens += len(solo)
        out[method] = {"requests_identical": f"{same}/8", "tokens_before_first_difference": f"{agree}/{tokens}",
                       "batched_seconds": round(batched_s, 2), "ragged_passes": sched.metrics.ragged_passes,
                       "request_passes": sched.metrics.ragged_segments}
        print(method, out[method], flush=True)
    if args.speed:
        out["speed"] = speed(engine, ids, greedy, args.tokens)
    print(json.dumps(out))


def speed(engine: Engine, ids: list[list[int]], sampling: SamplingParams, n: int) -> dict:
    """Aggregate tokens/s of 1 and of 8 concurrent requests, batched and interleaved, ar and staged."""
    rows = {}
    for method in ("ar", "staged"):
        spec = engine.speculation_for(type("R", (), {"method": method, "draft": None, "tree_budget": None})())
        for batched in (True, False):
            for conc in (1, 8):
                sched = Scheduler(engine, max_batch=8, batch_passes=batched)
                sched.start()
                run_jobs(sched, [Job(ids[0], 4, sampling, None, [], spec, None)])  # warm-up
                t0 = time.perf_counter()
                infos = run_jobs(sched, [Job(p, n, sampling, None, [], spec, None) for p in ids[:conc]])
                secs = time.perf_counter() - t0
                sched.stop()
                toks = sum(len(ev[2]["token_ids"]) for ev in infos)
                key = f"{method} {'batched' if batched else 'interleaved'} x{conc}"
                rows[key] = round(toks / secs, 1)
                print(key, rows[key], "tok/s", flush=True)
    return rows


if __name__ == "__main__":
    main()
