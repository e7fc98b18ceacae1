"""transformers' assisted generation with the exported shipped draft, against transformers' plain greedy.

Why: `stagedspec export --format hf` promises a draft that transformers can use as `assistant_model`;
this measures what it buys there (tok/s ratio, tokens per oracle pass) on the real default oracle and
a few HumanEval prompts, next to stagedspec's own mean accepted length for the same draft as a chain
of the same length.  Every assisted output is checked token-identical to plain greedy.

    python scripts/export/assisted_generation.py --prompts 4 --max-new-tokens 128
    python scripts/export/assisted_generation.py --prompts 1 --max-new-tokens 8   # an end-to-end check

Timings are only meaningful on an otherwise idle machine.  transformers is the baseline here, never
stagedspec's hot path.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def oracle_pass_counter(model: torch.nn.Module) -> list[int]:
    """A one-element list counting the model's forward calls (prefill and every verification pass)."""
    count = [0]
    model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int,
                   **kwargs: object) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:], time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="HumanEval prompts (chat-wrapped)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=4, help="assistant tokens per step (constant schedule)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="stagedspec-export-") as tmp:  # 127 MB in bf16: not kept
        return run(args, Path(tmp) / "draft-hf")


def run(args: argparse.Namespace, export_dir: Path) -> int:
    """Export the shipped draft into `export_dir`, then time and compare (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from stagedspec.bench.prompts import chat_instruction, humaneval_prompts
    from stagedspec.cli import main as stagedspec_main
    from stagedspec.models.specs import hf_folder_for
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if stagedspec_main(["export", "default", "--format", "hf", "--out", str(export_dir), "--dtype", args.dtype]):
        return 1
    oracle = AutoModelForCausalLM.from_pretrained(hf_folder_for("default"), dtype=torch_dtype).eval()
    assistant = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch_dtype).eval()
    assistant.generation_config.num_assistant_tokens = args.draft_tokens
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # propose all K tokens, as a chain does
    passes = oracle_pass_counter(oracle)

    pipe = Pipeline.load("default", ["default"],
                         speculation=SpeculationConfig(method="chain", chain_length=args.draft_tokens),
                         dtype=args.dtype, quant="none", draft_weights="native")
    tok = pipe.tokenizer

    warm = torch.tensor([tok.encode("def f(x):")])
    timed_generate(oracle, warm, 2)  # first-call costs (allocations, kernel selection) stay out of the timings
    timed_generate(oracle, warm, 2, assistant_model=assistant)

    totals = {"plain_s": 0.0, "assisted_s": 0.0, "tokens": 0, "assisted_passes": 0, "ours_steps": 0, "ours_tokens": 0}
    print(f"{'prompt':>6} {'tokens':>6} {'plain tok/s':>11} {'assisted tok/s':>14} {'ratio':>6} "
          f"{'tok/pass hf':>11} {'stagedspec chain':>16} identical")
    for i, prompt in enumerate(humaneval_prompts(args.prompts)):
        ids = tok.encode(tok.apply_chat_template(chat_instruction(prompt)))
        x = torch.tensor([ids])
        plain, t_plain = timed_generate(oracle, x, args.max_new_tokens)
        passes[0] = 0
        assisted, t_assisted = timed_generate(oracle, x, args.max_new_tokens, assistant_model=assistant)
        verify_passes = max(passes[0], 1)  # the first pass verifies the first proposals along with the prompt
        ours = pipe.generate(ids, max_new_tokens=args.max_new_tokens).stats
        n = int(plain.numel())
        same = torch.equal(plain, assisted)
        totals["plain_s"] += t_plain
        totals["assisted_s"] += t_assisted
        totals["tokens"] += n
        totals["assisted_passes"] += verify_passes
        totals["ours_steps"] += len(ours.accepted_lengths)
        totals["ours_tokens"] += sum(ours.accepted_lengths) + len(ours.accepted_lengths)
        print(f"{i:>6} {n:>6} {n / t_plain:>11.1f} {n / t_assisted:>14.1f} {t_plain / t_assisted:>5.2f}x "
              f"{n / verify_passes:>11.2f} {ours.mean_accepted_length:>16.2f} {same}")
    t = totals
    ours_mean = t["ours_tokens"] / max(t["ours_steps"], 1)
    print(f"all: {t['tokens']} tokens; transformers assisted / plain = {t['plain_s'] / t['assisted_s']:.2f}x "
          f"({t['tokens'] / t['plain_s']:.1f} -> {t['tokens'] / t['assisted_s']:.1f} tok/s); tokens per oracle pass: "
          f"transformers {t['tokens'] / t['assisted_passes']:.2f}, stagedspec chain k={args.draft_tokens} {ours_mean:.2f} "
          f"({args.dtype}, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
