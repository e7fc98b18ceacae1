"""Cost of one oracle forward as a function of the number of tree nodes.

At batch 1 a forward streams all weights once whatever the number of rows, so
verifying a tree of n nodes costs little more than one token until compute
catches up with bandwidth.  The curve decides the default tree budget: the
largest n whose cost stays within a small factor of n = 1.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from stagedspec.generation import wants_fixed_width
from stagedspec.models.transformer import Transformer


def forward_cost_curve(
    model: Transformer, sizes: Sequence[int] = (1, 2, 4, 8, 16, 24, 32, 48, 64), context: int = 256, repeats: int = 7
) -> dict[int, float]:
    """Median seconds of one forward of n tree nodes on top of `context` cached tokens.

    Passes are run as `ModelOracle` runs them: in bf16/fp16 over the whole
    cache's key width, with a throwaway second row when n = 1 (see
    `ModelOracle.score`).
    """
    device = model.embed.weight.device
    cache = model.new_cache(context + max(sizes) + 1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict[int, float] = {}
    fixed = wants_fixed_width(model)  # as ModelOracle runs it
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
        model(prompt, torch.arange(context, device=device), cache, logits_rows=slice(-1, None))
        cache.commit()
        for n in sizes:
            rows = max(n, 2) if fixed else n
            toks = torch.randint(0, vocab, (1, rows), generator=g).to(device)
            # a bushy tree: node i's parent is (i - 1) // 2, like a binary tree
            parents = [-1] + [(i - 1) // 2 for i in range(1, rows)]
            mask = torch.zeros(rows, rows, dtype=torch.bool)
            depth = [0] * rows
            for i in range(rows):
                mask[i, i] = True
                if parents[i] >= 0:
                    mask[i] |= mask[parents[i]]
                    depth[i] = depth[parents[i]] + 1
            pos = torch.tensor(depth, device=device) + context
            times = []
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                model(toks, pos, cache, tree_mask=mask if rows > 1 else None, logits_rows=slice(0, n),
                      key_width=cache.max_len if fixed else None)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                cache.discard()
            out[n] = statistics.median(times)
    return out


def print_cost_curve(curve: dict[int, float]) -> None:
    base = curve[min(curve)]
    print("nodes  ms/forward  cost vs 1 node")
    for n, secs in curve.items():
        print(f"{n:5d}  {1000 * secs:10.2f}  {secs / base:6.2f}x")
