"""The static-shape pass path (`stagedspec.runner`) on the CPU, with CUDA graphs off.

The same code runs on a GPU, where each bucket's pass is replayed as a CUDA
graph (tests/test_cuda.py); here it must compute what the eager forward
computes, keep greedy output identical to `ar` for every method, and keep
sampled output distributed as the oracle's (chi-square, with a negative
control that must fail).
"""

from __future__ import annotations

import argparse
import gc
from collections import Counter

import pytest
import torch

from _exactness import assert_drafts_used
from stagedspec import runner as runner_mod
from stagedspec.drafters.lookup import LookupDrafter
from stagedspec.drafters.merged import MergedDrafter
from stagedspec.drafters.model import ModelDrafter
from stagedspec.generation import GenerationResult, NoDrafter, speculative_generate
from stagedspec.request import generate_ar
from stagedspec.runner import ModelOracle
from stagedspec.models.config import ModelConfig
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.transformer import Transformer, init_random
from stagedspec.pass_options import PassOptions
from stagedspec.runner import (PassRouter, RequestPasses, StaticRunner, acquire_runner, pass_mode, runner_capacity,
                               set_pass_mode)
from stagedspec.sampling import SamplingParams, probs_from_logits
from stagedspec.stages import StageDrafter
from stagedspec.verification import VerifyResult
from tests.test_distribution_exactness import chi_square_pvalue, corrupt_batched_leftover, use_verifier
from tests._reference_sampling import reference_probs

# Tiny tensors: their cost is thread wake-ups, not arithmetic (see conftest); the sampling tests below run
# thousands of two-row passes, 5-10x slower with two threads on a busy machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int, layers: int = 2, vocab: int = 24, dtype: torch.dtype = torch.float32) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=256)
    return init_random(Transformer(cfg), seed=seed, std=0.3).to(dtype).eval()


def test_cpu_models_default_to_eager_and_modes_are_checked() -> None:
    m = tiny(0)
    assert pass_mode(m) == ("static" if PassOptions.from_environment().static_on_cpu else "eager")  # the env's
    set_pass_mode(m, "graphs")  # no CUDA here: graphs become static passes
    assert pass_mode(m) == "static"
    with pytest.raises(ValueError, match="unknown pass mode"):
        set_pass_mode(m, "fast")


@pytest.mark.parametrize("rows", [1, 3, 5, 64, 70, 150])
def test_static_pass_computes_what_the_eager_forward_computes(rows: int) -> None:
    """Padded buckets, a tree mask, a complete mask, and more rows than the biggest bucket (chunked)."""
    m = tiny(1, layers=3)
    eager_cache = m.new_cache(256)
    runner = StaticRunner(m, 256)
    g = torch.Generator().manual_seed(rows)
    prompt = torch.randint(0, 24, (12,), generator=g).tolist()
    with torch.inference_mode():
        m(torch.tensor([prompt]), torch.arange(12), eager_cache)
        eager_cache.commit()
        runner.run(prompt, torch.arange(12), None)
        runner.cache.commit()
        toks = torch.randint(0, 24, (rows,), generator=g).tolist()
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, rows)]
        tree = torch.zeros(rows, rows, dtype=torch.bool)
        depth = [0] * rows
        for i, p in enumerate(parents):
            tree[i, i] = True
            if p >= 0:
                tree[i] |= tree[p]
                depth[i] = depth[p] + 1
        pos = torch.tensor(depth) + 12
        a = m(torch.tensor([toks]), pos, eager_cache, PassSpec(tree_mask=tree))[0]
        b = runner.run(toks, pos, tree)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        full = torch.cat([torch.ones(rows, 12, dtype=torch.bool), tree], dim=1)
        full[:, 3] = False  # hide one prefix token: the complete-mask form
        eager_cache.discard()
        a = m(torch.tensor([toks]), pos, eager_cache, PassSpec(tree_mask=full))[0]
        first = min(1, rows - 1)
        b = runner.run(toks, pos, full, logits_rows=slice(first, None))
        torch.testing.assert_close(b, a[first:], rtol=1e-4, atol=1e-5)
        # kept entries are the same too
        eager_cache.commit(list(range(0, rows, 2)))
        runner.cache.commit(list(range(0, rows, 2)))
        n = eager_cache.length
        torch.testing.assert_close(runner.cache.k[:, :, :, :n], eager_cache.k[:, :, :, :n], rtol=1e-4, atol=1e-5)


def test_static_pass_on_sliding_window_layers() -> None:
    from tests.test_gemma3 import tiny_gemma

    m = tiny_gemma(window=4)
    eager_cache = m.new_cache(96)
    runner = StaticRunner(m, 96)
    prompt = list(range(5, 25))
    with torch.inference_mode():
        a = m(torch.tensor([prompt]), torch.arange(20), eager_cache)[0]
        b = runner.run(prompt, torch.arange(20), None)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def all_method_runs(oracle: Transformer, draft: Transformer, prompt: list[int], n: int) -> dict[str, GenerationResult]:
    """Greedy runs of ar, tree, chain, staged, staged + lookup, lookup and, on static passes, trees grown level by
    level (also used by tests/test_cuda.py): their tokens for the identity, their stats for the drafts used."""
    out = {"ar": generate_ar(oracle, prompt, max_new_tokens=n)}
    out["tree"] = speculative_generate(ModelOracle(oracle, 300), ModelDrafter(draft, tree_budget=16, max_len=300),
                                       prompt, max_new_tokens=n)
    out["chain"] = speculative_generate(ModelOracle(oracle, 300),
                                        ModelDrafter(draft, method="chain", chain_length=4, max_len=300),
                                        prompt, max_new_tokens=n)
    staged = StageDrafter(ModelOracle(draft, 300), LookupDrafter(None, context=True, chain_length=4),
                          chain_length=4, branching=2)
    out["staged"] = speculative_generate(ModelOracle(oracle, 300), staged, prompt, max_new_tokens=n)
    merged = MergedDrafter(staged, LookupDrafter(None, context=True, chain_length=4))
    out["staged+lookup"] = speculative_generate(ModelOracle(oracle, 300), merged, prompt, max_new_tokens=n)
    out["lookup"] = speculative_generate(ModelOracle(oracle, 300), LookupDrafter(None, context=True, chain_length=5),
                                         prompt, max_new_tokens=n)
    if pass_mode(draft) != "eager":  # trees grown level by level on the device
        levels = ModelDrafter(draft, tree_budget=16, max_len=300, growth="levels")
        out["tree-levels"] = speculative_generate(ModelOracle(oracle, 300), levels, prompt, max_new_tokens=n)
    return out


def all_methods(oracle: Transformer, draft: Transformer, prompt: list[int], n: int) -> dict[str, list[int]]:
    """The greedy tokens of `all_method_runs`."""
    return {name: run.token_ids for name, run in all_method_runs(oracle, draft, prompt, n).items()}


def assert_every_method_is_ar_with_drafts_used(runs: dict[str, list[GenerationResult]], reference: list[list[int]],
                                               label: str) -> None:
    """Each method's runs (one per prompt) emit the reference's tokens, and together accepted drafted tokens:
    the identity compared speculation with `ar`, not `ar` with itself (also used by tests/test_cuda.py)."""
    for name, outs in runs.items():
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out.token_ids == ref, f"{label}, prompt {i}: {name}"
        if name != "ar":
            assert_drafts_used(outs, f"{name} ({label})")


def test_static_greedy_fp32_every_method_identical_to_eager_ar() -> None:
    runs: dict[str, list[GenerationResult]] = {}
    references = []
    for seed in range(4):
        oracle, draft = tiny(seed, layers=3), tiny(seed + 50)
        prompt = torch.randint(0, 24, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        references.append(generate_ar(oracle, prompt, max_new_tokens=40).token_ids)  # the eager path
        set_pass_mode(oracle, "static")
        set_pass_mode(draft, "static")
        for name, run in all_method_runs(oracle, draft, prompt, 40).items():
            runs.setdefault(name, []).append(run)
    assert_every_method_is_ar_with_drafts_used(runs, references, "static passes, seeds 0-3")


def test_static_bf16_prompt_longer_than_a_bucket() -> None:
    """A 100-token prompt runs as two bucket passes; greedy methods still agree with static ar, token for token.

    bf16 without `bit_exact` promises agreement only away from near-ties (a pass's rounding depends on its
    shape: README, Exactness).  So the prompt is one whose continuation has no near-tie (prompt seed 6: the
    smallest top-2 logit gap along it is 0.11, over three bf16 steps at these logits' scale), and the test
    checks that before it compares: a change that made the case a coin toss fails here, not at random."""
    oracle, draft = tiny(3, layers=3, dtype=torch.bfloat16), tiny(7, dtype=torch.bfloat16)
    prompt = torch.randint(0, 24, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    set_pass_mode(oracle, "static")
    set_pass_mode(draft, "static")
    runs = all_method_runs(oracle, draft, prompt, 24)
    out = {name: run.token_ids for name, run in runs.items()}
    seq = prompt + out["ar"]
    with torch.inference_mode():  # one eager pass over prompt + reply: the logits that chose each reply token
        rows = oracle(torch.tensor([seq]), torch.arange(len(seq)), oracle.new_cache(len(seq)))[0, len(prompt) - 1:-1]
    top2 = rows.float().topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= 0.09, "the reply passes a near-tie: pick another prompt"
    assert len(out["ar"]) == 24 and len(set(out["ar"])) > 3  # a varied reply, not one token repeated
    assert_every_method_is_ar_with_drafts_used({k: [v] for k, v in runs.items()}, [out["ar"]], "static bf16")


def assert_chain_rows_are_one_token_rows(model: Transformer, prompt: list[int], chain: list[int],
                                         max_len: int) -> None:
    """A chain scored in one bit-exact pass gives each row the bits of its token scored alone after the ones
    before it (one-token decoding); also used by tests/test_cuda.py."""
    from stagedspec.tree import TokenTree

    with torch.inference_mode():
        many = ModelOracle(model, max_len, bit_exact=True)
        many.prefill(prompt)
        rows = many.score(TokenTree.chain(prompt[-1], chain))
        one = ModelOracle(model, max_len, bit_exact=True)
        one.prefill(prompt)
        for i, token in enumerate([prompt[-1], *chain]):
            alone = one.score(TokenTree([token], [-1]))
            assert torch.equal(alone[0], rows[i]), f"row {i}"
            one.commit([])


def test_static_bit_exact_rows_keep_their_bits_whatever_shares_the_pass() -> None:
    """`bit_exact` on the static path (CUDA's): every pass runs `BUCKETS[-1]` rows, so a chain's rows are
    bit-identical to the same tokens scored one at a time (one-token decoding), in bf16, where passes of
    different row counts round differently; and every method's greedy output is bit-exact `ar`'s."""
    from stagedspec.runner import BUCKETS

    oracle, draft = tiny(3, layers=3, dtype=torch.bfloat16), tiny(7, dtype=torch.bfloat16)
    set_pass_mode(oracle, "static")
    set_pass_mode(draft, "static")
    prompt = torch.randint(0, 24, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert ModelOracle(oracle, 128, bit_exact=True).runner.buckets == (BUCKETS[-1],)
    assert_chain_rows_are_one_token_rows(oracle, prompt, [5, 9, 2, 17], 128)
    reference = speculative_generate(ModelOracle(oracle, 300, bit_exact=True), NoDrafter(), prompt,
                                     max_new_tokens=24).token_ids
    tree = speculative_generate(ModelOracle(oracle, 300, bit_exact=True),
                                ModelDrafter(draft, tree_budget=16, max_len=300), prompt, max_new_tokens=24).token_ids
    lookup = speculative_generate(ModelOracle(oracle, 300, bit_exact=True),
                                  LookupDrafter(None, context=True, chain_length=5), prompt,
                                  max_new_tokens=24).token_ids
    assert tree == reference and lookup == reference


def test_runners_are_pooled_per_model_and_released_with_their_owner() -> None:
    m = tiny(2)
    set_pass_mode(m, "static")
    assert runner_capacity(10) == 256 and runner_capacity(257) == 512

    class Owner:
        pass

    a_owner, b_owner = Owner(), Owner()
    a = acquire_runner(m, 300, a_owner)
    b = acquire_runner(m, 300, b_owner)
    assert a is not b and a.busy and b.busy  # a busy runner is never shared
    del a_owner
    gc.collect()
    assert not a.busy
    c_owner = Owner()
    assert acquire_runner(m, 400, c_owner) is a  # same capacity (512): reused, graphs and all
    assert acquire_runner(m, 100, Owner()).capacity == 256  # never a bigger one: equal widths, equal numbers


def test_a_request_s_eager_passes_go_through_its_router() -> None:
    """`RequestPasses.router`: the oracle and drafter a request builds with it run their eager passes through
    it (the server's lanes), whatever thread runs them; parts built without one run theirs on the model."""
    oracle, draft = tiny(3), tiny(4)
    for m in (oracle, draft):
        set_pass_mode(m, "eager")  # static passes run on their runner, never routed
    seen: list[Transformer] = []

    class Recorder(PassRouter):
        def __call__(self, model, tokens, positions, cache, spec):  # noqa: ANN001, ANN204
            seen.append(model)
            return model(tokens, positions, cache, spec)

    prompt = list(range(3, 12))
    request = RequestPasses(router=Recorder())
    routed = speculative_generate(ModelOracle(oracle, 64, passes=request),
                                  ModelDrafter(draft, tree_budget=4, max_depth=2, max_len=64, passes=request),
                                  prompt, max_new_tokens=8).token_ids
    assert oracle in seen and draft in seen
    seen.clear()
    alone = speculative_generate(ModelOracle(oracle, 64), ModelDrafter(draft, tree_budget=4, max_depth=2, max_len=64),
                                 prompt, max_new_tokens=8).token_ids
    assert not seen and routed == alone


def test_a_request_s_runners_go_back_to_the_pool_when_it_ends() -> None:
    """`RequestPasses`: the runners a request's parts lease through it are given back at its `release`,
    while those parts still exist; their owners' later collection does not free a runner leased again since."""
    m = tiny(2)
    set_pass_mode(m, "static")

    class Owner:
        pass

    first, other, second = Owner(), Owner(), Owner()
    request = RequestPasses()
    a = request.acquire(m, 300, first)
    b = acquire_runner(m, 300, other)  # outside the request: only its owner's collection frees it
    assert a.busy and b.busy and len(request.leases) == 1
    request.release()
    assert not a.busy and b.busy
    assert acquire_runner(m, 300, second) is a
    del first
    gc.collect()
    assert a.busy  # still `second`'s


def _exact_two_tokens(oracle: Transformer, prompt: list[int], sampling: SamplingParams) -> dict[tuple[int, int], float]:
    """P(a, b | prompt) from the eager oracle's logits, each step shaped by the independent numpy reference
    (`tests/_reference_sampling.py`), not the engine's `probs_from_logits` that the samples go through."""
    V = oracle.config.vocab_size
    s = sampling
    with torch.inference_mode():
        cache = oracle.new_cache(16)
        row = oracle(torch.tensor([prompt]), torch.arange(len(prompt)), cache)[0, -1]
        first = reference_probs(row, s.temperature, s.top_k, s.top_p)
        cache.commit()
        dist = {}
        for a in range(V):
            if first[a] <= 0:
                continue
            cache.truncate(len(prompt))
            row = oracle(torch.tensor([[a]]), torch.tensor([len(prompt)]), cache)[0, -1]
            second = reference_probs(row, s.temperature, s.top_k, s.top_p)
            for b in range(V):
                dist[(a, b)] = float(first[a] * second[b])
    return dist


def _sample_counts(oracle: Transformer, draft: Transformer, prompt: list[int], sampling: SamplingParams, n: int,
                   verifier=None, levels: bool = False, bit_exact: bool = False) -> Counter:  # noqa: ANN001
    counts: Counter = Counter()
    with torch.inference_mode():
        for i in range(n):
            if levels:  # a tree grown level by level on the device
                drafter = ModelDrafter(draft, tree_budget=5, max_depth=3, branching=2, max_len=32, growth="levels")
            else:
                drafter = StageDrafter(ModelOracle(draft, 32), LookupDrafter(None, context=True, chain_length=2),
                                       chain_length=2)
            out = speculative_generate(ModelOracle(oracle, 32, bit_exact=bit_exact), drafter, prompt,
                                       max_new_tokens=2, sampling=sampling, seed=i, verifier=verifier).token_ids
            counts[tuple(out)] += 1
    return counts


def _accept_first_children(tree, logits, sampling, generator) -> VerifyResult:  # noqa: ANN001
    """A broken verifier: takes the draft's first chain whatever the oracle says."""
    kids = tree.children_lists()
    node, accepted = 0, []
    while kids[node]:
        node = kids[node][0]
        accepted.append(node)
    return VerifyResult(accepted, int(probs_from_logits(logits[node], sampling).argmax()))


def test_static_staged_sampling_keeps_the_oracle_distribution() -> None:
    oracle, draft = tiny(11, layers=2, vocab=6), tiny(12, layers=1, vocab=6)
    set_pass_mode(oracle, "static")
    set_pass_mode(draft, "static")
    prompt, sampling = [1, 2, 3], SamplingParams(temperature=1.0)
    exact = _exact_two_tokens(oracle, prompt, sampling)
    p, df = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 1500), exact)
    assert df > 5 and p > 1e-3, p
    # negative control: a verifier that ignores the oracle must be caught
    p_bad, _ = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 1500, _accept_first_children), exact)
    assert p_bad < 1e-6, p_bad


def test_static_bit_exact_staged_sampling_keeps_the_oracle_distribution() -> None:
    """Row-exact passes (every oracle pass at 64 rows, CUDA's default in bf16) sample from the oracle's
    distribution too, and the negative control is still caught."""
    oracle, draft = tiny(11, layers=2, vocab=6, dtype=torch.bfloat16), tiny(12, layers=1, vocab=6)
    set_pass_mode(oracle, "static")
    set_pass_mode(draft, "static")
    prompt, sampling = [1, 2, 3], SamplingParams(temperature=1.0)
    exact = _exact_two_tokens(oracle, prompt, sampling)
    p, df = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 1500, bit_exact=True), exact)
    assert df > 5 and p > 1e-3, p
    p_bad, _ = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 1500, _accept_first_children,
                                                bit_exact=True), exact)
    assert p_bad < 1e-6, p_bad


def _level_grown_setup() -> tuple[Transformer, Transformer, list[int], SamplingParams, dict]:
    oracle, draft = tiny(13, layers=2, vocab=6), tiny(14, layers=1, vocab=6)
    set_pass_mode(oracle, "static")
    set_pass_mode(draft, "static")
    prompt, sampling = [1, 2, 3], SamplingParams(temperature=1.0, top_k=4)
    return oracle, draft, prompt, sampling, _exact_two_tokens(oracle, prompt, sampling)


def test_level_grown_sampling_keeps_the_oracle_distribution() -> None:
    """T=1, top-k 4: trees grown level by level (their children one-hot proposals) keep the oracle's law."""
    oracle, draft, prompt, sampling, exact = _level_grown_setup()
    p, df = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 1500, levels=True), exact)
    assert df > 5 and p > 1e-3, p
    p_bad, _ = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 1500, _accept_first_children,
                                                levels=True), exact)
    assert p_bad < 1e-6, p_bad


def test_level_grown_sampling_through_the_batched_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same trees verified as on a GPU (`verify_sampled`, which `verify` runs on CUDA logits; the test above
    walks, as a CPU does): 400 samples (~15 ms each here) detect TV >= 0.15 with power 0.9.  Its control, the
    batched rules with their leftover corrupted, must fail at 300 samples (p ~ 5e-6 when written)."""
    oracle, draft, prompt, sampling, exact = _level_grown_setup()
    use_verifier(monkeypatch, "batched")
    p, df = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 400, levels=True), exact)
    assert df > 5 and p > 1e-3, p
    corrupt_batched_leftover(monkeypatch)
    p_bad, _ = chi_square_pvalue(_sample_counts(oracle, draft, prompt, sampling, 300, levels=True), exact)
    assert p_bad < 1e-3, p_bad


def test_level_growth_scores_are_the_draft_s_own_path_probabilities() -> None:
    """Each node of a level-grown tree carries the product of the draft's probabilities along its path, as a
    teacher-forced forward over context + path computes them: masks, positions and slots are right."""
    draft = tiny(21, layers=3)
    reference = tiny(21, layers=3)
    set_pass_mode(draft, "static")
    prompt = [3, 1, 4, 1, 5, 9]
    drafter = ModelDrafter(draft, tree_budget=16, max_depth=5, branching=3, max_len=64, growth="levels")
    drafter.begin(prompt)
    with torch.inference_mode():
        tree = drafter.propose(prompt, SamplingParams(), None, 40)
        assert len(tree) == 17 and tree.draft_passes == 5 and max(tree.depths) >= 3
        for node in range(1, len(tree)):
            chain = [tree.tokens[x] for x in tree.path_to(node)]
            logits = reference(torch.tensor([prompt + chain]), torch.arange(len(prompt) + len(chain)),
                               reference.new_cache(64))[0]
            logp = logits.float().log_softmax(-1)[len(prompt) - 1:]
            expected = float(sum(logp[j, t] for j, t in enumerate(chain)).exp())
            assert tree.scores[node] == pytest.approx(expected, rel=1e-4), node
        # The kept nodes are the best candidates: a child of an expanded node (one with kept children: all its
        # `branching` best children were candidates) that was dropped scores no higher than the lowest kept node.
        lowest = min(tree.scores[1:])
        kids = tree.children_lists()
        for node in range(len(tree)):
            if not kids[node]:
                continue
            path = prompt + [tree.tokens[x] for x in tree.path_to(node)]
            row = reference(torch.tensor([path]), torch.arange(len(path)), reference.new_cache(64))[0, -1]
            probs = row.float().softmax(-1)
            kept = {tree.tokens[c] for c in kids[node]}
            for x in probs.topk(3).indices.tolist():
                if x not in kept:
                    assert tree.scores[node] * float(probs[x]) <= lowest * (1 + 1e-4), (node, x)
        assert drafter.cache.length == len(prompt)  # the tree's entries are gone


def test_level_growth_with_the_oracle_as_its_own_draft_accepts_every_level() -> None:
    oracle = tiny(5, layers=2)
    set_pass_mode(oracle, "static")
    prompt = [2, 7, 1, 8]
    ref = generate_ar(oracle, prompt, max_new_tokens=30).token_ids
    drafter = ModelDrafter(oracle, tree_budget=12, max_depth=4, branching=2, max_len=300, growth="levels")
    out = speculative_generate(ModelOracle(oracle, 300), drafter, prompt, max_new_tokens=30)
    assert out.token_ids == ref
    assert out.stats.mean_accepted_length >= 4.0  # 4 draft levels + the oracle's own token, nearly every step


def test_level_growth_needs_static_passes_and_a_token_draft() -> None:
    from stagedspec.errors import StagedSpecError

    eager = tiny(0)
    set_pass_mode(eager, "eager")  # whatever STAGEDSPEC_STATIC_PASSES says
    with pytest.raises(StagedSpecError, match="static-shape passes"):
        ModelDrafter(eager, growth="levels")
    with pytest.raises(StagedSpecError, match="unknown tree growth"):
        ModelDrafter(tiny(0), growth="sideways")
    m = tiny(0)
    set_pass_mode(m, "static")
    assert ModelDrafter(m).growth == "best-first"  # a CPU: reading results back costs nothing


def test_cuda_graphs_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagedspec.cli import build_parser
    from stagedspec.cli.args import pass_options_from

    args = build_parser().parse_args(["generate", "hi", "--no-cuda-graphs"])
    assert args.cuda_graphs is False
    assert isinstance(build_parser().parse_args(["generate", "hi"]).cuda_graphs, bool)
    monkeypatch.delenv("STAGEDSPEC_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("STAGEDSPEC_STATIC_PASSES", raising=False)
    default = PassOptions.from_environment()
    assert default.mode_on("cuda") == "graphs" and default.mode_on("cpu") == "eager"
    assert PassOptions(cuda_graphs=False).mode_on("cuda:0") == "static"
    assert PassOptions(mode="graphs").mode_on("cpu") == "static"  # CUDA graphs need CUDA
    options = pass_options_from(args)  # what the commands load their models with
    assert options.mode_on("cuda") == "static" and options.mode_on("cpu") == "eager"
    static = pass_options_from(build_parser().parse_args(["generate", "hi", "--static-passes", "--compile"]))
    assert static.mode_on("cpu") == "static" and static.mode_on("cuda") == "graphs" and static.compile
    monkeypatch.setenv("STAGEDSPEC_CUDA_GRAPHS", "0")
    monkeypatch.setenv("STAGEDSPEC_STATIC_PASSES", "1")  # how the whole suite runs the static path
    assert PassOptions.from_environment() == PassOptions(cuda_graphs=False, static_on_cpu=True)
    assert pass_mode(tiny(0)) == "static"  # a model built without options takes the environment's
    with pytest.raises(ValueError, match="unknown pass mode"):
        PassOptions(mode="fast")


def test_a_copy_of_a_model_keeps_its_options_and_gets_a_pool_of_its_own() -> None:
    import copy

    m = tiny(4)
    set_pass_mode(m, "static")
    runner_mod.set_compiled(m, True)
    acquire_runner(m, 10, m)
    twin = copy.deepcopy(m)
    assert twin.runtime.passes.options == m.runtime.passes.options and pass_mode(twin) == "static"
    assert twin.runtime.passes.runners == [] and len(m.runtime.passes.runners) == 1


def test_bit_exact_caps_onednn_below_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX bf16 kernels round a row by the pass's row count: `--bit-exact` caps oneDNN's ISA at start-up."""
    import os

    from stagedspec import hardware
    from stagedspec.cli.commands import _cap_isa_for_bit_exact

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")  # restored after the test
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert hardware.amx_rounds_by_rows()
    _cap_isa_for_bit_exact(argparse.Namespace(bit_exact=False, device="cpu"))
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "ALL"  # AMX stays on without --bit-exact (it makes trees cheap)
    _cap_isa_for_bit_exact(argparse.Namespace(bit_exact=True, device="cpu"))
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == hardware.AMX_ISA_CAP and not hardware.amx_rounds_by_rows()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    _cap_isa_for_bit_exact(argparse.Namespace(bit_exact=True, device="cpu"))
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "ALL"  # no AMX: nothing to cap


def test_compiled_static_pass_computes_what_the_plain_one_computes() -> None:
    """`--compile`: one bucket's pass through torch.compile equals the uncompiled pass (fp32, tiny model), and
    the compiled region sees no inference-mode switch of its own (`decoding_mode`; one broke CUDA compiles)."""
    m = tiny(3, layers=2)
    plain, compiled = StaticRunner(m, 64), StaticRunner(m, 64)
    runner_mod.set_compiled(m, True)
    try:
        prompt = [1, 5, 2, 7]
        with torch.inference_mode():
            out_c = compiled.run(prompt, torch.arange(4), None)
            assert runner_mod.is_compiled(m), "the compile failed and fell back"
            runner_mod.set_compiled(m, False)
            out_p = plain.run(prompt, torch.arange(4), None)
        torch.testing.assert_close(out_c, out_p, rtol=1e-4, atol=1e-5)
    finally:
        runner_mod.set_compiled(m, False)


def test_level_growth_keeps_its_levels_within_the_tree_s_cache_slots() -> None:
    """A width wider than the budget allows is narrowed: the levels' entries fit the slots kept for a tree."""
    m = tiny(6)
    set_pass_mode(m, "static")
    prompt = [i % 24 for i in range(1, 40)]
    drafter = ModelDrafter(m, tree_budget=4, max_depth=4, branching=3, width=8, max_len=len(prompt) + 1, growth="levels")
    drafter.begin(prompt)
    with torch.inference_mode():
        tree = drafter.propose(prompt, SamplingParams(), None, 8)
    assert 1 < len(tree) <= 5 and drafter.cache.length == len(prompt)
