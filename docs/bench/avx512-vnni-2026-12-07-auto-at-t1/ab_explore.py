"""In-process A/B: `auto` whose quiet plain steps count towards its next exploration (this code) against `auto`
whose explorations counted priced steps only (before: the two methods below, patched in while it runs), beside
`ar` and a fixed fan of 3 of the bundled feature draft, on the Qwen oracle.

Why: sampled at T=1, requests that lost a few draft steps at their start ran `ar` to their end.  Every
configuration runs each prompt in turn in one process (this VM drifts 20-30% between processes); the two `auto`
pipelines start from the same learned state on disk and learn apart.  Usage, from the repo root, idle machine:

    T=1 python docs/bench/avx512-vnni-2026-12-07-auto-at-t1/ab_explore.py [ROUNDS]
"""
import collections
import os
import sys

import stagedspec.auto.drafter as auto_drafter
from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams

T = float(os.environ.get("T", "0"))
SAMPLING = SamplingParams(temperature=T, top_k=50) if T > 0 else SamplingParams()
NEW_DUE, NEW_QUIET = auto_drafter.AutoDrafter._lookup_due, auto_drafter.AutoDrafter._run_quiet


def old_due(self) -> bool:  # before: an exploration never made a quiet step a full one
    if self._plain_streak < auto_drafter.PLAIN_STREAK:
        return True
    self._until_probe -= 1
    return self._until_probe <= 0


def old_quiet(self, *args):  # noqa: ANN001, ANN002, ANN202 - before: quiet steps did not count towards it
    self._until_explore += 1
    return NEW_QUIET(self, *args)


def use(old: bool) -> None:
    auto_drafter.AutoDrafter._lookup_due = old_due if old else NEW_DUE
    auto_drafter.AutoDrafter._run_quiet = old_quiet if old else NEW_QUIET


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="auto", quant="mixed")
    configs = {"ar": SpeculationConfig(method="ar"),
               "fan3": SpeculationConfig(method="tree", tree_budget=3, tree_depth=1, tree_branching=3),
               "auto-before": SpeculationConfig(method="auto", sizing="measured"),
               "auto": SpeculationConfig(method="auto", sizing="measured")}
    pipes = {k: Pipeline.over(models, c) for k, c in configs.items()}
    for k, p in pipes.items():  # warm-up on a prompt the comparison does not use
        use(k == "auto-before")
        p.generate(PROSE[5], max_new_tokens=8, chat=True, sampling=SAMPLING)
    kinds = {"prose": PROSE[:4], "chat": CHAT[:4]}
    totals = collections.defaultdict(lambda: [0.0, 0, 0])
    choices = collections.defaultdict(collections.Counter)
    for _ in range(rounds):
        for kind, prompts in kinds.items():
            for prompt in prompts:
                for k, p in pipes.items():
                    use(k == "auto-before")
                    st = p.generate(prompt, max_new_tokens=64, chat=True, sampling=SAMPLING).stats
                    t = totals[(kind, k)]
                    t[0] += st.seconds - st.prefill_seconds
                    t[1] += st.new_tokens
                    t[2] += st.oracle_forward_passes
                    if st.auto_choices:
                        choices[k].update(st.auto_choices)
    for kind in kinds:
        s, n, _ = totals[(kind, "ar")]
        base = n / s
        for k in pipes:
            s, n, steps = totals[(kind, k)]
            print(f"T={T:g} {kind:6s} {k:12s} {n / s:6.2f} tok/s {n / s / base:5.3f}x {n / steps:.3f} tok/step "
                  f"{1000 * s / steps:5.1f} ms/step")
    for k, c in choices.items():
        print(k, dict(c.most_common(8)))


if __name__ == "__main__":
    main()
