"""Training drafts by distillation from the oracle (`stagedspec distill`; the command line is `cli.distill`).

The modules: `distill` the training loop, its data (the offline corpus, the oracle's sampled replies), checkpoints
and the evaluation helpers of `eval-draft`; `feature` what differs for a feature (EAGLE-style) draft, its loss and
held-out figures; `losses` the bucket KL both trainers share; `reply_cache` the per-request cache of the oracle's
replies.  Nothing below the command line imports this package: decoding never needs it.
"""
