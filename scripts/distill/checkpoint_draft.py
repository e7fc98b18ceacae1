"""Write the draft a distillation checkpoint holds as a draft folder, without the corpus or the optimizer.

Why: a CPU distillation of a 1.5B oracle's feature draft runs for hours over several sittings; its draft so
far has to be measured (`stagedspec eval-draft`, `stagedspec tune`) and kept (the next run starts from it with
`--init-from`) while the run goes on or after it stopped.  `stagedspec distill --resume --stop-after-steps`
does the same but re-reads and re-tokenises the whole corpus first.

    python scripts/distill/checkpoint_draft.py --oracle qwen2.5-coder-1.5b --quant mixed \\
        --checkpoint WORK/checkpoint.pt --out DRAFT [--save-dtype int8]
"""

from __future__ import annotations

import argparse
import sys

import torch

from stagedspec.errors import StagedSpecError
from stagedspec.models.draft import save_draft
from stagedspec.models.loading import load_model
from stagedspec.tokenizer import tokenizer_fingerprint
from stagedspec.training.distill import SAVE_DTYPES, draft_from_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle", required=True, help="the oracle the run distilled from (a spec, as distill took it)")
    ap.add_argument("--quant", default="none", help="the teacher's weights, as the run had them (--quant)")
    ap.add_argument("--checkpoint", required=True, help="the run's WORK/checkpoint.pt")
    ap.add_argument("--out", required=True, help="the draft folder to write")
    ap.add_argument("--save-dtype", default="int8", choices=SAVE_DTYPES)
    args = ap.parse_args(argv)
    try:
        oracle, tok = load_model(args.oracle, dtype=torch.bfloat16, quant=args.quant)
        draft = draft_from_checkpoint(args.checkpoint, oracle, tokenizer_fingerprint(tok))
        save_draft(draft, args.out, draft.fingerprint, draft.training_meta, dtype=args.save_dtype)
    except StagedSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = draft.training_meta
    print(f"{args.out}: step {meta['steps_done']}/{meta['total_steps']}, held-out top-1 "
          f"{meta.get('heldout_top1', float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
