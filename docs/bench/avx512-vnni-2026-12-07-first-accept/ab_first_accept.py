"""In-process A/B of `auto` at T=1: learning the draft's first-token acceptance probability
(`VerifyResult.first_accept`, this code) against learning the draw that decided it (the code before), beside `ar`,
on the Qwen oracle with its bundled feature draft.

Each trial starts both `auto` pipelines with nothing learned (this oracle's learned state is moved aside first
and restored at the end), then runs 4 prose and 4 chat prompts x 64 tokens at T=1 (top-k 50, unseeded), each
prompt by `ar` and both in turn (the order rotated).  Usage, from the repo root, nothing else running:

    python docs/bench/avx512-vnni-2026-12-07-first-accept/ab_first_accept.py [TRIALS] [TEMPERATURE]
"""
import collections
import shutil
import sys
import tempfile
from pathlib import Path

from stagedspec.auto.drafter import AutoDrafter
from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.learned_state import auto_state_path
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    sampling = SamplingParams(temperature=temperature, top_k=50) if temperature > 0 else SamplingParams()
    models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="auto", quant="mixed")
    probe = Pipeline.over(models, SpeculationConfig(method="auto", sizing="measured"))
    state = auto_state_path(probe.cost_profile().key)
    kept = Path(tempfile.mkdtemp()) / state.name
    if state.exists():
        shutil.move(state, kept)
    ar = Pipeline.over(models, SpeculationConfig(method="ar"))
    ar.generate(PROSE[5], max_new_tokens=8, chat=True)
    totals = collections.defaultdict(lambda: [0.0, 0, 0])
    learns_draws = set()
    original = AutoDrafter.verified

    def verified(self, seconds, first_accept=None):  # noqa: ANN001, ANN202
        return original(self, seconds, None if id(self.policy) in learns_draws else first_accept)

    AutoDrafter.verified = verified
    try:
        for trial in range(trials):
            state.unlink(missing_ok=True)
            pipes = {"ar": ar}
            for name in ("auto-draws", "auto"):
                pipe = Pipeline.over(models, SpeculationConfig(method="auto", sizing="measured"))
                if name == "auto-draws":
                    learns_draws.add(id(pipe.auto_policy()))
                pipes[name] = pipe
            order = list(pipes)
            for i, (kind, prompt) in enumerate([("prose", p) for p in PROSE[:4]] + [("chat", p) for p in CHAT[:4]]):
                for name in order[i % 3:] + order[:i % 3]:
                    st = pipes[name].generate(prompt, max_new_tokens=64, chat=True, sampling=sampling).stats
                    t = totals[(kind, name)]
                    t[0] += st.seconds - st.prefill_seconds
                    t[1] += st.new_tokens
                    t[2] += st.oracle_forward_passes
                    if name != "ar":
                        print(trial, kind, name, round(st.new_tokens / (st.seconds - st.prefill_seconds), 1),
                              st.auto_choices, flush=True)
    finally:
        AutoDrafter.verified = original
        state.unlink(missing_ok=True)
        if kept.exists():
            shutil.move(kept, state)
    for kind in ("prose", "chat"):
        s, n, _ = totals[(kind, "ar")]
        base = n / s
        for name in ("ar", "auto-draws", "auto"):
            s, n, steps = totals[(kind, name)]
            print(f"{kind:6s} {name:11s} {n / s:6.2f} tok/s {n / s / base:5.3f}x {n / steps:.3f} tok/step "
                  f"{1000 * s / steps:5.1f} ms/step")


if __name__ == "__main__":
    main()
