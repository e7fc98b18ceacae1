"""Whole `generate` calls with the weights on 4 KB pages and a 4 KB prefetch distance (as before 2026-12-07)
against 2 MB pages and the distance this machine's timing chose, in one process, interleaved prompt by prompt.

Two copies of the oracle are loaded: the first with `move_to_huge_pages` switched off.  The prefetch distance is
process-wide, so it is set before each call.  Usage, from the repo root, nothing else running:

    python docs/bench/avx512-vnni-2026-12-07-huge-pages/ab_generate.py ORACLE METHOD [ROUNDS]

ORACLE: `default` (SmolLM2-135M) or `qwen2.5-coder-1.5b`; METHOD: `ar` or `auto` (the default draft).
"""
import collections
import sys

import torch

import stagedspec.models.loading as loading
from stagedspec.bench.prompts import CHAT, PROSE
from stagedspec.kernels import prefetch
from stagedspec.kernels.native import native_kernels
from stagedspec.pipeline import Pipeline, SpeculationConfig


def main() -> None:
    oracle, method = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    native_kernels()
    ahead = torch.ops.stagedspec_qlinear.prefetch_ahead
    chosen = ahead(0)
    draft = None if method == "ar" or oracle == "default" else "default"
    spec = SpeculationConfig.tuned(method, "mixed")
    moved = loading.move_to_huge_pages
    loading.move_to_huge_pages = lambda model: 0
    before = Pipeline.load(oracle, draft, quant="mixed", speculation=spec)
    loading.move_to_huge_pages = moved
    after = Pipeline.load(oracle, draft, quant="mixed", speculation=spec)
    pipes = {"4k pages, 4 KB ahead": (before, prefetch.DEFAULT), f"2 MB pages, {chosen // 1024} KB ahead": (after, chosen)}
    for pipe, distance in pipes.values():
        ahead(distance)
        pipe.generate(PROSE[5], max_new_tokens=8, chat=True)
    tot = collections.defaultdict(lambda: [0.0, 0])
    order = list(pipes)
    for r in range(rounds):
        for i, (kind, prompt) in enumerate([("prose", p) for p in PROSE[:4]] + [("chat", p) for p in CHAT[:4]]):
            for name in order[(i + r) % 2:] + order[:(i + r) % 2]:
                pipe, distance = pipes[name]
                ahead(distance)
                st = pipe.generate(prompt, max_new_tokens=64, chat=True).stats
                tot[(kind, name)][0] += st.seconds
                tot[(kind, name)][1] += st.new_tokens
    print(f"{oracle} {method}, whole calls, {rounds} rounds of 4 prose + 4 chat prompts x 64 tokens")
    for kind in ("prose", "chat"):
        s0, n0 = tot[(kind, order[0])]
        for name in order:
            s, n = tot[(kind, name)]
            print(f"{kind:6s} {name:24s} {n / s:6.2f} tok/s {n / s / (n0 / s0):5.3f}x")


if __name__ == "__main__":
    main()
