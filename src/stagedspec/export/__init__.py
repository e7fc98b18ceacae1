"""Write stagedspec drafts in other engines' formats, so a user who outgrows one machine keeps the draft.

Formats (`FORMATS`):

- `hf`: an independent draft as a self-contained causal-LM folder transformers loads with
  `AutoModelForCausalLM.from_pretrained` (and vLLM serves as a draft model); `stagedspec.export.hf`.
- `eagle`: a feature draft in the checkpoint layout vLLM's EAGLE-1 loader reads; `stagedspec.export.eagle`.
- `speculators`: a feature draft as a `speculators` EAGLE config + weights; `stagedspec.export.eagle`.

Each writer takes an already loaded draft and its oracle: loading (and refusing what cannot be
exported) is `stagedspec.export.common`, the command line `stagedspec.cli.export`.
"""

from __future__ import annotations

FORMATS = ("hf", "eagle", "speculators")
