"""Staged speculation: every level must be exact with respect to the level above.

Distribution exactness uses the enumerable toy language models and the
chi-square test of `test_distribution_exactness` (same power analysis: N_FAST
samples detect a 7% TV bias; the slow run detects 2%).  The chain under test
is oracle <- draft <- draft2 <- toy tree drafter (and the 3-level version),
all driven through the real loop and the real `StageDrafter`.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from stagedspec.drafters.lookup import LookupDrafter
from stagedspec.drafters.merged import MergedDrafter
from stagedspec.generation import speculative_generate
from stagedspec.request import generate_ar
from stagedspec.runner import ModelOracle
from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.transformer import init_random
from stagedspec.sampling import SamplingParams
from stagedspec.stages import StageDrafter
from test_distribution_exactness import (  # the shared toy models and statistical test
    ALPHA,
    L,
    N_FAST,
    N_NEGATIVE,
    N_SLOW,
    TableLM,
    ToyDrafter,
    ToyOracle,
    chi_square_pvalue,
    corrupt_batched_leftover,
    exact_distribution,
    use_verifier,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


class WrongQStage(StageDrafter):
    """Negative control: passes up the stage's raw softmax as q, ignoring temperature/top-k/top-p.

    (Passing a sampled spine up as a deterministic proposal would *not* be a
    mistake: accepting any independently chosen x with probability p(x) and
    otherwise drawing from p without x is exact whatever chose x.)
    """

    def _tree_from_spine(self, root, spine, origins, rows, sampling, generator):  # noqa: ANN001, ANN202
        return super()._tree_from_spine(root, spine, origins, rows, SamplingParams(temperature=1.0), generator)


def chain(levels: int, seed: int, sampling: SamplingParams, stage_cls=StageDrafter, k: int = 2, b: int = 2):  # noqa: ANN001, ANN201
    """oracle <- (levels - 1) model stages <- toy tree drafter, over toy tables."""
    oracle_lm = TableLM(salt=seed)
    below = ToyDrafter(TableLM(salt=seed + 100, kind="good", oracle=oracle_lm),
                       dict(mode="topk", tree_budget=3, max_depth=2, branching=2))
    for level in range(levels - 1, 0, -1):
        stage_lm = TableLM(salt=seed + 10 * level, kind="good", oracle=oracle_lm)
        below = stage_cls(ToyOracle(stage_lm), below, name=f"draft{level}", chain_length=k, branching=b)
    return ToyOracle(oracle_lm), below, oracle_lm


def merged(levels: int, seed: int, sampling: SamplingParams, stage_cls=StageDrafter, **kw):  # noqa: ANN001, ANN201
    """`chain` with a deterministic toy drafter's tree merged into what the oracle verifies (like
    `--method staged` merging prompt lookup): a sampled spine plus fixed nodes."""
    oracle, below, oracle_lm = chain(levels, seed, sampling, stage_cls, **kw)
    lookup_like = ToyDrafter(TableLM(salt=seed + 200, kind="bad", oracle=oracle_lm),
                             dict(mode="topk", tree_budget=3, max_depth=3, branching=1))
    return oracle, MergedDrafter(below, lookup_like), oracle_lm


def sample_pvalue(levels: int, seed: int, sampling: SamplingParams, n: int, stage_cls=StageDrafter,
                  build=chain, **kw) -> float:  # noqa: ANN001
    oracle, drafter, oracle_lm = build(levels, seed, sampling, stage_cls, **kw)
    prompt = [1]
    counts: Counter = Counter()
    for s in range(n):
        out = speculative_generate(oracle, drafter, prompt, max_new_tokens=L, sampling=sampling, seed=s)
        counts[tuple(out.token_ids)] += 1
    return chi_square_pvalue(counts, exact_distribution(oracle_lm, prompt, sampling))[0]


STAGED_CONFIGS = [
    (3, 11, SamplingParams(temperature=1.0), dict(k=2, b=2)),
    (3, 12, SamplingParams(temperature=0.7, top_k=3), dict(k=3, b=1)),
    (4, 13, SamplingParams(temperature=1.5, top_p=0.9), dict(k=2, b=3)),
    (3, 12, SamplingParams(temperature=0.5, top_k=3), dict(k=2, b=2)),  # the negative control's setting
]


@pytest.mark.parametrize("levels, seed, sampling, kw", STAGED_CONFIGS)
def test_staged_sampling_matches_the_oracle(levels: int, seed: int, sampling: SamplingParams, kw: dict) -> None:
    p = sample_pvalue(levels, seed, sampling, N_FAST, **kw)
    assert p > ALPHA, f"staged chain of {levels} levels deviates from the oracle (p = {p:.2e})"


# Stage chains on a GPU verify with the batched rules at every level (`verify` on CUDA logits); the CPU walks.
# One merged configuration (stage spines with two drawn siblings a node, fixed lookup nodes merged in) also runs
# batched:
# N_BATCHED detects TV >= 0.08 (power 0.9) there; the rules themselves get N_FAST on every toy tree shape.
N_BATCHED = 2_000
MERGED_CASES = [(*c, "walk") for c in STAGED_CONFIGS[:3]] + [(*STAGED_CONFIGS[3], "batched")]


@pytest.mark.parametrize("levels, seed, sampling, kw, verifier", MERGED_CASES)
def test_staged_with_merged_lookup_matches_the_oracle(levels: int, seed: int, sampling: SamplingParams,
                                                      kw: dict, verifier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_verifier(monkeypatch, verifier)
    p = sample_pvalue(levels, seed, sampling, N_FAST if verifier == "walk" else N_BATCHED, build=merged, **kw)
    assert p > ALPHA, f"staged chain of {levels} levels with merged fixed proposals deviates (p = {p:.2e}, {verifier})"


@pytest.mark.slow
@pytest.mark.parametrize("levels, seed, sampling, kw", STAGED_CONFIGS)
def test_staged_sampling_high_power(levels: int, seed: int, sampling: SamplingParams, kw: dict) -> None:
    assert sample_pvalue(levels, seed, sampling, N_SLOW, **kw) > ALPHA


@pytest.mark.parametrize("verifier, n", [("walk", N_NEGATIVE), ("batched", 300)])
def test_negative_control_wrong_q_passed_up_is_caught(verifier: str, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrong q reaches the batched rules too (they read `child_q` row by row): caught by either verifier."""
    use_verifier(monkeypatch, verifier)
    sampling = SamplingParams(temperature=0.5, top_k=3)
    p = sample_pvalue(3, 12, sampling, n, stage_cls=WrongQStage, k=2, b=2)  # ~1e-107 at 2,000 walked samples
    assert p < ALPHA, f"the wrong stage was not detected (p = {p:.3f}, {verifier})"


def test_negative_control_corrupted_batched_verifier_under_a_merged_stage_chain_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched merged case above with `verify_sampled`'s leftover corrupted: caught with few samples."""
    use_verifier(monkeypatch, "batched")
    corrupt_batched_leftover(monkeypatch)
    levels, seed, sampling, kw = STAGED_CONFIGS[3]
    p = sample_pvalue(levels, seed, sampling, 300, build=merged, **kw)  # ~1e-7 when written
    assert p < ALPHA, f"a corrupted batched verifier passed under a stage chain (p = {p:.3f})"


def test_staged_greedy_is_the_oracle_argmax_continuation() -> None:
    greedy = SamplingParams()
    for seed in range(20):
        oracle, drafter, oracle_lm = chain(3 + seed % 2, seed, greedy)
        out = speculative_generate(oracle, drafter, [1], max_new_tokens=L, sampling=greedy).token_ids
        ctx = [1]
        for _ in range(L):
            ctx.append(int(oracle_lm.logits(tuple(ctx)).argmax()))
        assert out == ctx[1:]


# --- tiny random transformers: greedy identity with real caches, many seeds -------------------------------


def tiny(seed: int, layers: int = 2, vocab: int = 24) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=256)
    return init_random(Transformer(cfg), seed=seed, std=0.3).eval()


@pytest.mark.parametrize("levels", [2, 3, 4])
def test_staged_greedy_equals_ar_on_tiny_transformers(levels: int) -> None:
    for seed in range(8):
        oracle = tiny(seed, layers=3)
        prompt = torch.randint(0, 24, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = generate_ar(oracle, prompt, max_new_tokens=40).token_ids
        below = LookupDrafter(None, context=True, chain_length=4)
        for level in range(levels - 2, 0, -1):  # model stages between the oracle and the lookup stage
            below = StageDrafter(ModelOracle(tiny(seed + 50 * level), 300), below, name=f"draft{level}",
                                 chain_length=3 + level, branching=2)
        out = speculative_generate(ModelOracle(oracle, 300), below, prompt, max_new_tokens=40)
        assert out.token_ids == ref, f"seed {seed}, {levels} levels"
        if levels > 2:
            assert below.stage_telemetry()[0].forward_passes > 0
            both = MergedDrafter(below, LookupDrafter(None, context=True, chain_length=5))
            out = speculative_generate(ModelOracle(oracle, 300), both, prompt, max_new_tokens=40)
            assert out.token_ids == ref, f"seed {seed}, {levels} levels, lookup merged"
            assert [r.name for r in both.stage_telemetry()][-1] == "context (to oracle)"


def test_staged_sampling_is_reproducible_with_a_seed() -> None:
    oracle = tiny(3, layers=3)
    sampling = SamplingParams(temperature=1.0, top_k=10)

    def run(seed: int) -> list[int]:
        below = StageDrafter(ModelOracle(tiny(99), 300), LookupDrafter(None, True), chain_length=4)
        return speculative_generate(ModelOracle(oracle, 300), below, [1, 2, 3], max_new_tokens=30,
                                    sampling=sampling, seed=seed).token_ids

    first = run(7)
    assert run(7) == first
    # The seed decided the draws: a loop that ignored it would give these 30 tokens under any seed.
    assert run(8) != first, "seeds 7 and 8 gave the same 30 sampled tokens"


@pytest.mark.parametrize("native", [True, False])
def test_merged_lookup_length_follows_the_machines_bf16(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """`staged` merges 8 prompt-lookup tokens only where bf16 rows are nearly free; a given length wins."""
    import stagedspec.hardware
    from stagedspec.pipeline import NATIVE_BF16_DEFAULTS, SpeculationConfig

    monkeypatch.setattr(stagedspec.hardware, "cpu_has_native_bf16", lambda: native)
    tuned = SpeculationConfig.tuned
    base = SpeculationConfig().lookup_length
    wide = NATIVE_BF16_DEFAULTS["oracle_lookup_length"] if native else base
    assert tuned("staged", dtype="bf16").merged_lookup_length == wide
    assert tuned("staged", dtype=torch.bfloat16).merged_lookup_length == wide
    assert tuned("staged", dtype="fp32").merged_lookup_length == base
    assert tuned("staged").merged_lookup_length == base  # dtype not known
    assert tuned("staged", "int4", dtype="bf16").merged_lookup_length == 2
    assert tuned("staged", device="cuda", dtype="bf16").merged_lookup_length == 8  # CUDA's own lookup length
    assert tuned("staged", dtype="bf16", lookup_length=3).merged_lookup_length == 3
    assert tuned("staged", dtype="bf16", oracle_lookup_length=5).merged_lookup_length == 5
    assert tuned("staged", dtype="bf16").max_tree_budget >= 3 + wide
    with pytest.raises(Exception, match="oracle-lookup-length"):
        SpeculationConfig(method="staged", oracle_lookup_length=0)
