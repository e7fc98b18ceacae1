"""What `auto`'s own Python costs per step, beside `ar` on the same prompts, in one process.

Why: on a fast pass (a 5 ms SmolLM2 step on the native kernels, a 3 ms GPU graph) the policy's bookkeeping is
a visible share of a step, and in the decoding loop it runs several times slower than in a micro-benchmark
(each pass's weights evict the caches).  This times `AutoDrafter.propose`, `_learn`, `AutoPolicy.choose` and
the lookup chains with wall clocks around each call, and compares `auto`'s tokens per second with `ar`'s,
alternating prompt by prompt: in all, and as the geometric mean over pairs of neighbouring requests with a 95%
interval (the machine's drift from one request to the next widens it).  `--arms ar` offers `auto` plain
decoding alone (its overhead with nothing to gain), `--arms lookup` only `ar`, `lookup` and `copy`.

    python scripts/auto/step_overhead.py --prompts prose --arms ar
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections import defaultdict

import stagedspec.auto.drafter as auto_drafter
import stagedspec.auto.policy as auto_policy
from stagedspec.bench.prompts import chat_instruction, load_prompts
from stagedspec.drafters import lookup as lookup_module
from stagedspec.heap import freeze_loaded
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracle", default="default")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", default="prose", help="humaneval, prose or chat")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--arms", choices=("all", "lookup", "ar"), default="all")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quant", default="auto", help="the oracle's weights, as `generate --quant` (none: bf16)")
    args = ap.parse_args()

    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(owner: type, name: str, label: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - t
                calls[label] += 1
        setattr(owner, name, wrapper)

    timed(auto_drafter.AutoDrafter, "propose", "propose")
    timed(auto_drafter.AutoDrafter, "_learn", "learn")
    timed(auto_policy.AutoPolicy, "choose", "choose")
    timed(lookup_module.LookupDrafter, "chains", "lookup chains")

    pipe = Pipeline.load(args.oracle, args.draft, speculation=SpeculationConfig.tuned("auto", args.quant),
                         quant=args.quant)
    ar = Pipeline(pipe.model, pipe.tokenizer, [], SpeculationConfig.tuned("ar", args.quant), learned=pipe.learned)
    kinds = {"all": None, "lookup": ("ar", "lookup", "copy"), "ar": ("ar",)}[args.arms]
    if kinds is not None:
        policy = pipe.auto_policy()
        policy.arms = [a for a in policy.arms if a.kind in kinds]
    prompts = load_prompts(args.prompts, args.n_prompts)
    if args.prompts == "humaneval":
        prompts = [chat_instruction(p) for p in prompts]
    sampling = SamplingParams(temperature=args.temperature, top_k=50) if args.temperature > 0 else SamplingParams()
    for p in (ar, pipe):  # kernels and cost profile, untimed
        p.generate(prompts[0], chat=True, max_new_tokens=8, sampling=sampling)
    freeze_loaded()  # as the bench does: no full garbage collection walks the models mid-request
    seconds.clear()
    calls.clear()
    wall = {"ar": 0.0, "auto": 0.0}
    tokens = {"ar": 0, "auto": 0}
    log_ratios = []  # per request pair: log(auto's tokens/s / ar's), the two run one after the other
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            rate = {}
            for name, p in (("ar", ar), ("auto", pipe)):
                t = time.perf_counter()
                out = p.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 seed=i if args.temperature > 0 else None)
                took = time.perf_counter() - t
                wall[name] += took
                tokens[name] += len(out.token_ids)
                rate[name] = len(out.token_ids) / took
            log_ratios.append(math.log(rate["auto"] / rate["ar"]))
    steps = calls["propose"]
    speed = (tokens["auto"] / wall["auto"]) / (tokens["ar"] / wall["ar"])
    print(f"auto / ar tokens per second: {speed:.3f} ({tokens['auto']} and {tokens['ar']} tokens, "
          f"{steps} auto steps of {1e3 * wall['auto'] / max(1, steps):.2f} ms)")
    if len(log_ratios) > 1:
        mean, spread = statistics.fmean(log_ratios), statistics.stdev(log_ratios) / math.sqrt(len(log_ratios))
        print(f"per request pair: geometric mean {math.exp(mean):.3f}, 95% interval "
              f"{math.exp(mean - 1.96 * spread):.3f}-{math.exp(mean + 1.96 * spread):.3f} ({len(log_ratios)} pairs)")
    for label in seconds:
        print(f"  {label:14} {calls[label]:6} calls  {1e6 * seconds[label] / max(1, steps):7.1f} us per step  "
              f"{1e6 * seconds[label] / calls[label]:7.1f} us per call")


if __name__ == "__main__":
    main()
