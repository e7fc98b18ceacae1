"""`ar` against `auto` (the Qwen oracle and its bundled feature draft) in one process, timed by the whole call and
with the time to the first token left out (`GenerationStats.prefill_seconds`, which since 2026-12-07 ends after the
first step for every method).  Before, `prefill_seconds` ended before the first step: a feature draft's pipeline
runs the prompt there (to read its hidden states), `ar` runs it in its first step, so `seconds - prefill_seconds`
had counted the prompt's pass for `ar` only.  Usage, from the repo root, nothing else running:

    python docs/bench/avx512-vnni-2026-12-07-first-accept/whole_call.py [ROUNDS] [TEMPERATURE]
"""
import collections
import sys

from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.sampling import SamplingParams


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    sampling = SamplingParams(temperature=temperature, top_k=50) if temperature > 0 else SamplingParams()
    models = ModelSet.load("qwen2.5-coder-1.5b", "default", method="auto", quant="mixed")
    pipes = {"ar": Pipeline.over(models, SpeculationConfig(method="ar")),
             "auto": Pipeline.over(models, SpeculationConfig(method="auto", sizing="measured"))}
    pipes["ar"].generate(PROSE[5], max_new_tokens=8, chat=True)
    tot = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])  # whole seconds, ttft, tokens, requests
    order = list(pipes)
    for r in range(rounds):
        for i, (kind, prompt) in enumerate([("prose", p) for p in PROSE[:4]] + [("chat", p) for p in CHAT[:4]]):
            for name in order[(i + r) % 2:] + order[:(i + r) % 2]:
                st = pipes[name].generate(prompt, max_new_tokens=64, chat=True, sampling=sampling).stats
                t = tot[(kind, name)]
                t[0] += st.seconds
                t[1] += st.prefill_seconds
                t[2] += st.new_tokens
                t[3] += 1
    for kind in ("prose", "chat"):
        s, f, n, k = tot[(kind, "ar")]
        whole, rest = n / s, (n - k) / (s - f)
        for name in order:
            s, f, n, k = tot[(kind, name)]
            print(f"{kind:6s} {name:5s} whole call {n / s:6.2f} tok/s {n / s / whole:5.3f}x | after the first token "
                  f"{(n - k) / (s - f):6.2f} tok/s {(n - k) / (s - f) / rest:5.3f}x | time to first token "
                  f"{1000 * f / k:6.1f} ms")


if __name__ == "__main__":
    main()
