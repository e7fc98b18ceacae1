"""`--method auto`: every step, the configuration with the highest expected tokens per second.

Whether speculation pays depends on the machine: on a CPU with native bf16 a
4-row pass costs what a 1-row pass costs and `staged` wins; on an AVX2-only
CPU a bf16 pass over 4 rows costs twice one row and every tree loses; on a
GPU a 64-node tree costs 1.3x one token.  So nothing here is tuned for a
machine.  Each step weighs its candidate configurations (`Arm`s):

- `ar`: no speculation (one token per oracle pass);
- `lookup:k`: prompt-lookup / n-gram chains of up to k tokens;
- `copy:k`: the prompt-lookup chain alone, up to k tokens (one row a token: where rows are dear, the n-gram's
  two chains beside it priced every lookup out);
- `tree:n`: a best-first draft tree of n nodes;
- `staged:k` / `staged:k+m`: the draft decodes k tokens, itself sped up by
  lookup below, with a prompt-lookup chain (k + 1 tokens, or m) merged into
  the oracle's tree;

by expected tokens / expected seconds, where

- seconds = the oracle's pass over the arm's rows and the verification
  around it (the measured cost curve and verification overhead of this
  machine, `stagedspec.costs`, scaled by how long that arm kind's steps
  actually took) + the arm's drafting time (predicted from the drafts' cost
  curves, then measured), all scaled by how the arm kind's whole steps
  compared with that price (from one `propose` to the next: a draft
  catching up on the tokens it missed is charged to its kind);
- tokens = 1 + sum over depths j of P(accepted length >= j), from
  per-proposer, per-depth acceptance statistics (`ChainStats`: context,
  n-gram, draft; the context chain's kept per length of the suffix it
  matched, `arms.CONTEXT_SERIES`) that start from priors and are updated after every
  verification, calibrated per arm by what that arm actually yielded
  (shrunk towards what its kind yielded, so an arm tried once is judged by
  its siblings too).

Prompt lookup costs microseconds, so its chains are computed every full step
and scored against the tokens the oracle went on to emit, whichever arm ran.
Deep in a run of plain steps most steps are quiet (`PLAIN_STREAK`,
`PROBE_MAX_GAP`): they run `ar` and do nothing else, because in the decoding
loop the policy's Python costs several times what it does in isolation, and
on prose its bookkeeping on every step had made `auto` slower than `ar`.  A draft's statistics are updated whenever an arm
that uses it runs.  A speculative arm must beat `ar` by `MARGIN` to run, so
when the estimates are close the loop decodes plainly.

Exploration.  A step's yield is noisy (1 token one step, 8 the next), so an
arm judged on one unlucky step could be written off for good.  Every
`EXPLORE_EVERY`-th priced step therefore runs the arm with the highest
*optimistic* rate (its calibration raised by `EXPLORE_WIDTH` / sqrt(1 + the
steps it ran), UCB-style), twice in a row so that its drafting time is
measured on a warm draft cache: a step whose drafter did not run the step
before pays for catching up on the tokens decoded meanwhile, which is not
the arm's price and is not learned as such.  An exploration that does not
convince (the next priced step chooses `ar` again) doubles the gap to the
next one, up to `EXPLORE_MAX_GAP`; a priced step that chooses a speculative
arm resets it.  Where plain decoding keeps winning, each exploration costs
about two slow steps (a model draft catching up on the context, then a warm
repeat) in every `EXPLORE_EVERY` priced ones, a visible share of a mostly-`ar`
request's time (docs/measurements.md, "Exploration's cost where plain decoding wins on an AVX2 EPYC").

The request's own record.  The models above are shared by every request and
learn slowly on purpose; each request also keeps, per arm kind, the tokens and
wall seconds its steps realized against what they were priced at
(`stagedspec.realized_rates`), and that ratio scales the kind's price for the
rest of the request.  An arm priced a little above `ar` that loses to its
price is dropped within a handful of steps, whichever part of the model erred.

In the batched server (`stagedspec.server`) a request's step is part of a
round whose passes it shares with the other running requests, so an arm is
priced by what it adds to that round (`SharedLoad`, `shared_step_seconds`):
its oracle rows at the margin of the others' rows on the cost curve, its
segment's per-request cost, its draft passes either inside the draft phases
the others already run (their marginal rows) or as new phases (their cost
shared by the requests that would run them), and the round's other tokens and
seconds, measured, in the ratio.  Alone (no others) that is the solo price.

Exactness.  The choice depends on earlier steps (the statistics, the
measured times) and on the drafts' own proposals for this step (whether a
lookup chain exists), never on the oracle's result for this step — the rule
in `stagedspec.verification`'s docstring.  Each arm's tree is then verified
by the ordinary rules, so every arm, and any sequence of arms, is exact.

The package, one job a module (each imports only those above it):

- `arms`: the configurations (`Arm`), which to price (`arms_for`) and their sizes;
- `acceptance`: the learned acceptance statistics and a step's expected tokens;
- `step_costs`: the measured times (`StepCosts`) and a step's seconds, alone or in a batched round;
- `pricing`: expected tokens per second of each arm and the choice among them;
- `policy`: `AutoPolicy`, the learned state shared by a pipeline's requests;
- `drafter`: `AutoDrafter`, which runs each step's chosen arm and learns from it.

A module-level knob is read from the module that uses it (`stagedspec.auto.drafter.REQUEST_PRIOR`, not
`stagedspec.auto.REQUEST_PRIOR`): the names here are re-exports, so changing one here changes nothing.
"""

from __future__ import annotations

from stagedspec.auto.arms import (
    CONTEXT_SERIES,
    CPU_TREE_SIZES,
    CUDA_TREE_SIZES,
    COPY_SIZES,
    FAN_SIZES,
    LOOKUP_SIZES,
    STAGE_LONG_LOOKUP,
    STAGE_LOOKUP_EXTRA,
    STAGE_SIZES,
    Arm,
    arms_for,
    context_chain,
    context_series,
    lookup_horizon,
    staged_lookup_length,
    tree_depth_for,
    verify_rows,
)
from stagedspec.auto.acceptance import (
    ARM_PRIOR_STEPS,
    PRIOR_ACCEPTANCE,
    PRIOR_WEIGHT,
    SECOND_CHOICE,
    AcceptanceStats,
    ChainStats,
    expected_tokens,
)
from stagedspec.auto.step_costs import (
    LOOKUP_SECONDS,
    STAGE_INNER_ACCEPT,
    SharedLoad,
    StepCosts,
    catch_up_seconds,
    draft_pass_rows,
    predicted_draft_seconds,
    shared_step_seconds,
    solo_step_seconds,
)
from stagedspec.auto.pricing import (
    EXPLORE_WIDTH,
    MARGIN,
    choose_arm,
    expected_rates,
)
from stagedspec.auto.policy import (
    AR_PROBE_BELOW,
    AR_PROBE_EVERY,
    AR_PROBE_MIN_STEPS,
    STATE_CAP,
    AutoPolicy,
)
from stagedspec.auto.drafter import (
    EXPLORE_EVERY,
    EXPLORE_MAX_GAP,
    LOOKUP_PROBE_EVERY,
    PLAIN_STREAK,
    REQUEST_PRIOR,
    AutoDrafter,
    Resize,
    StepTrace,
    matched_prefix,
    spine,
)

__all__ = [
    "MARGIN",
    "LOOKUP_SIZES",
    "COPY_SIZES",
    "CPU_TREE_SIZES",
    "CUDA_TREE_SIZES",
    "FAN_SIZES",
    "STAGE_SIZES",
    "STAGE_LONG_LOOKUP",
    "STAGE_LOOKUP_EXTRA",
    "PRIOR_ACCEPTANCE",
    "PRIOR_WEIGHT",
    "ARM_PRIOR_STEPS",
    "EXPLORE_EVERY",
    "EXPLORE_MAX_GAP",
    "EXPLORE_WIDTH",
    "SECOND_CHOICE",
    "LOOKUP_SECONDS",
    "STAGE_INNER_ACCEPT",
    "PLAIN_STREAK",
    "LOOKUP_PROBE_EVERY",
    "AR_PROBE_EVERY",
    "AR_PROBE_BELOW",
    "AR_PROBE_MIN_STEPS",
    "STATE_CAP",
    "REQUEST_PRIOR",
    "Arm",
    "arms_for",
    "CONTEXT_SERIES",
    "context_chain",
    "context_series",
    "tree_depth_for",
    "ChainStats",
    "AcceptanceStats",
    "StepCosts",
    "solo_step_seconds",
    "expected_tokens",
    "verify_rows",
    "staged_lookup_length",
    "lookup_horizon",
    "predicted_draft_seconds",
    "SharedLoad",
    "draft_pass_rows",
    "shared_step_seconds",
    "catch_up_seconds",
    "expected_rates",
    "choose_arm",
    "AutoPolicy",
    "Resize",
    "spine",
    "matched_prefix",
    "AutoDrafter",
    "StepTrace",
]
