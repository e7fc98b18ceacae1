"""In-process A/B of `auto` on a fresh machine: its draft statistics starting from the draft's own held-out top-1
(this code, `AutoPolicy(draft_prior=...)`) against the generic prior (`PRIOR_ACCEPTANCE["draft"]`, 0.6), beside
`ar`, on the Qwen oracle with its bundled feature draft.

Each trial starts both `auto` pipelines with nothing learned (the learned state of these models is moved aside
first and restored at the end), then runs 4 prose and 4 chat prompts x 64 tokens, greedy, each prompt by `ar` and
both in turn (the order rotated).  Usage, from the repo root, nothing else running:

    python docs/bench/avx512-vnni-2026-12-07-draft-prior/ab_prior.py [TRIALS]
"""
import collections
import shutil
import sys
import tempfile
from pathlib import Path

from stagedspec.auto.acceptance import PRIOR_ACCEPTANCE, ChainStats
from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.learned_state import auto_state_path
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="auto", quant="mixed")
    probe = Pipeline.over(models, SpeculationConfig(method="auto", sizing="measured"))
    state = auto_state_path(probe.cost_profile().key)
    kept = Path(tempfile.mkdtemp()) / state.name
    if state.exists():
        shutil.move(state, kept)
    ar = Pipeline.over(models, SpeculationConfig(method="ar"))
    ar.generate(PROSE[5], max_new_tokens=8, chat=True)
    totals = collections.defaultdict(lambda: [0.0, 0, 0])
    try:
        for trial in range(trials):
            state.unlink(missing_ok=True)  # nothing learned: both policies start from their priors
            pipes = {"ar": ar}
            for name in ("auto-generic-prior", "auto"):
                pipe = Pipeline.over(models, SpeculationConfig(method="auto", sizing="measured"))
                policy = pipe.auto_policy()
                if name == "auto-generic-prior":
                    for stats in (policy.greedy_stats, policy.sampled_stats):
                        stats.chains["draft"] = ChainStats(PRIOR_ACCEPTANCE["draft"])
                pipes[name] = pipe
            print("trial", trial, "draft priors:", {k: p.auto_policy().greedy_stats.chains["draft"].prior
                                                   for k, p in pipes.items() if k != "ar"})
            order = list(pipes)
            for i, (kind, prompt) in enumerate([("prose", p) for p in PROSE[:4]] + [("chat", p) for p in CHAT[:4]]):
                for name in order[i % 3:] + order[:i % 3]:
                    st = pipes[name].generate(prompt, max_new_tokens=64, chat=True).stats
                    t = totals[(kind, name)]
                    t[0] += st.seconds - st.prefill_seconds
                    t[1] += st.new_tokens
                    t[2] += st.oracle_forward_passes
    finally:
        state.unlink(missing_ok=True)
        if kept.exists():
            shutil.move(kept, state)
    for kind in ("prose", "chat"):
        s, n, _ = totals[(kind, "ar")]
        base = n / s
        for name in ("ar", "auto-generic-prior", "auto"):
            s, n, steps = totals[(kind, name)]
            print(f"{kind:6s} {name:19s} {n / s:6.2f} tok/s {n / s / base:5.3f}x {n / steps:.3f} tok/step "
                  f"{1000 * s / steps:5.1f} ms/step")


if __name__ == "__main__":
    main()
