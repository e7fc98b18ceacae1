"""`auto`'s steps traced against `ar` on the same prompts: per arm, what a step cost and yielded against its price.

Why: when `auto` runs below plain decoding, the question is which arm it chose and whether the price it paid
(`stagedspec.auto.solo_step_seconds`) or the tokens it expected (`expected_tokens`) was wrong.  This runs
`ar` and `auto` alternately, prompt by prompt, in one process over one loaded model, and prints per prompt
the tok/s of both and, per arm `auto` chose, the steps, rows, measured wall time and price per step, and the
tokens it yielded and was expected to (the first step, with the prompt's prefill, is left out).

    python scripts/auto/trace_steps.py --oracle qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --prompts humaneval:3,prose:4 --max-new-tokens 64

`--prompts KIND:N,...` runs the kinds in order (`stagedspec.bench.prompts`: humaneval, prose, chat), so the
policy learns on the first and meets the next as a user switching tasks would.  `--request-prior X` sets
`stagedspec.auto.drafter.REQUEST_PRIOR` for the run (a large value prices every request by the machine's statistics
alone).  `--realized off` prices every request as if its steps had realized their prices
(`stagedspec.realized_rates`; the control for that record).  The pipeline's learned state is read from and saved to the cache as `generate` does: copy
`~/.cache/stagedspec/costs/*.auto.json` aside to repeat a run from the same state.  Timings are only
meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict

import stagedspec.auto.drafter as auto_drafter
from stagedspec.bench.prompts import chat_instruction, load_prompts
from stagedspec.heap import freeze_loaded
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.realized_rates import RealizedRates
from stagedspec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracle", default="default")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", default="humaneval:4", metavar="KIND:N,...")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled with top-k 50, seeded per prompt")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bf16 passes replayed as CUDA graphs, row-exact)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--request-prior", type=float, default=None)
    ap.add_argument("--realized", choices=("on", "off"), default="on")
    args = ap.parse_args()
    if args.request_prior is not None:
        auto_drafter.REQUEST_PRIOR = args.request_prior  # where `AutoDrafter` reads it
    if args.realized == "off":
        RealizedRates.factor = lambda self, kind: 1.0  # a diagnostic's control

    steps: list[dict] = []

    pipe = Pipeline.load(args.oracle, args.draft, quant=args.quant, device=args.device, dtype=args.dtype,
                         speculation=SpeculationConfig.tuned("auto", args.quant, device=args.device, dtype=args.dtype))
    pipe.auto_policy().step_observer = lambda step: steps.append(dataclasses.asdict(step))
    ar = Pipeline(pipe.model, pipe.tokenizer, [], SpeculationConfig.tuned("ar", args.quant, device=args.device,
                                                                          dtype=args.dtype),
                  learned=pipe.learned, device=pipe.device, dtype=pipe.dtype)
    prompts = []
    for part in args.prompts.split(","):
        kind, _, count = part.partition(":")
        got = load_prompts(kind, int(count) if count else None)
        prompts += [chat_instruction(p) for p in got] if kind == "humaneval" else got
    sampling = SamplingParams(temperature=args.temperature, top_k=50) if args.temperature > 0 else SamplingParams()
    for p in (ar, pipe):  # kernels, cost profile: untimed
        p.generate(prompts[0], chat=True, max_new_tokens=8, sampling=sampling)
    freeze_loaded()  # as the bench does: no full garbage collection walks the models mid-request
    total = {"ar": 0.0, "auto": 0.0}
    for i, prompt in enumerate(prompts):
        seed = i if args.temperature > 0 else None
        rates, walls = {}, {}
        for name, p in (("ar", ar), ("auto", pipe)):
            steps.clear()
            t = time.perf_counter()
            out = p.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed)
            seconds = time.perf_counter() - t
            total[name] += seconds
            rates[name] = len(out.token_ids) / seconds
            walls[name] = seconds
        traced = sum(s["wall"] for s in steps)
        print(f"prompt {i}: ar {rates['ar']:.1f} tok/s, auto {rates['auto']:.1f} tok/s "
              f"({rates['auto'] / rates['ar']:.2f}x); auto's {len(steps)} traced steps {1e3 * traced:.0f} ms "
              f"of its {1e3 * walls['auto']:.0f} ms (ar's whole request {1e3 * walls['ar']:.0f} ms)")
        by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for s in steps:
            b = by[s["arm"]]
            b["n"] += 1
            for key in ("rows", "wall", "price", "tokens", "expected"):
                b[key] += s[key]
            b["slowest"] = max(b["slowest"], s["wall"])
        for arm, b in sorted(by.items(), key=lambda kv: -kv[1]["n"]):
            n = b["n"]
            print(f"   {arm:12} steps={int(n):3} rows={b['rows'] / n:.1f} wall={1e3 * b['wall'] / n:6.1f} ms "
                  f"price={1e3 * b['price'] / n:6.1f} ms tokens={b['tokens'] / n:.2f} expected={b['expected'] / n:.2f} "
                  f"slowest={1e3 * b['slowest']:.1f} ms")
    print(f"auto / ar, total time: {total['auto'] / total['ar']:.3f}")


if __name__ == "__main__":
    main()
