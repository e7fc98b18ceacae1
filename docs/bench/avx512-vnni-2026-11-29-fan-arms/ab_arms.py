"""`auto` with and without the fan arms, each from a fresh policy, interleaved with `ar` in one process.

Usage, from the repo root, nothing else running:

    KINDS=humaneval,prose,chat VARIANTS=auto,nofans python docs/bench/avx512-vnni-2026-11-29-fan-arms/ab_arms.py ROUNDS

`auto`: every arm; `nofans`: without `tree:1` and `tree:kd1`; `fan3`: without them but `tree:3d1`.  Prompts:
HumanEval 1-8 as the bench asks them (a chat request), prose and chat 1-4; 64 tokens; decoding time only.
Checks that every variant's greedy output is `ar`'s.
"""
import collections
import os
import sys

from stagedspec.auto import AutoPolicy, arms_for
from stagedspec.bench.prompts import CHAT, PROSE, chat_instruction, humaneval_prompts
from stagedspec.learned_state import LearnedState
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig


def is_fan(arm) -> bool:  # noqa: ANN001 - auto.Arm
    return arm.kind == "tree" and (arm.depth == 1 or arm.size == 1)


VARIANTS = {
    "auto": lambda a: True,
    "nofans": lambda a: not is_fan(a),
    "fan3": lambda a: not is_fan(a) or a.name == "tree:3d1",
}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="auto", quant="mixed")
    pipes = {"ar": Pipeline.over(models, SpeculationConfig(method="ar"))}
    for name in os.environ.get("VARIANTS", "auto,nofans").split(","):
        p = Pipeline.over(models, SpeculationConfig(method="auto", sizing="measured"), learned=LearnedState())
        arms = [a for a in arms_for(True, True, "cpu") if VARIANTS[name](a)]
        p.learned.set_policy("auto", AutoPolicy(arms, p.cost_profile(quiet=True)))
        pipes[name] = p
    kinds = {"humaneval": [chat_instruction(h) for h in humaneval_prompts(8)], "prose": list(PROSE[:4]),
             "chat": list(CHAT[:4])}
    wanted = os.environ.get("KINDS", "humaneval,prose,chat").split(",")
    kinds = {k: v for k, v in kinds.items() if k in wanted}
    for p in pipes.values():
        p.generate(PROSE[6], max_new_tokens=8, chat=True)
    totals = collections.defaultdict(lambda: [0.0, 0, 0])
    choices = collections.defaultdict(collections.Counter)
    for _ in range(rounds):
        for kind, prompts in kinds.items():
            for prompt in prompts:
                outs = {}
                for k, p in pipes.items():
                    r = p.generate(prompt, max_new_tokens=64, chat=True)
                    t = totals[(k, kind)]
                    t[0] += r.stats.seconds - r.stats.prefill_seconds
                    t[1] += r.stats.new_tokens
                    t[2] += r.stats.oracle_forward_passes
                    choices[(k, kind)].update(r.stats.auto_choices)
                    outs[k] = r.token_ids
                assert all(o == outs["ar"] for o in outs.values()), "a variant's greedy output differs from ar's"
    for kind in kinds:
        seconds, tokens, _ = totals[("ar", kind)]
        for k in pipes:
            s, n, steps = totals[(k, kind)]
            top = dict(choices[(k, kind)].most_common(5)) if k != "ar" else ""
            print(f"{kind:9s} {k:7s} {n / s:6.2f} tok/s {n / s / (tokens / seconds):5.3f}x {n / steps:5.2f} tok/step", top)


if __name__ == "__main__":
    main()
