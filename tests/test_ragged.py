"""`forward_ragged`: several sequences' passes in one, each against its own cache, equal to its solo pass.

One segment must be bit-identical to `Transformer.forward` (same ops, same
shapes); several segments share only the row-wise matmuls, so in fp32 they
agree with their solo passes to rounding (and the caches they leave match).
Covers Llama (GQA), GPT-2 and Gemma-3 (sliding window, q/k norms), causal
prompts, tree masks, full-width masks, fixed key widths and one-token
attention (`row_independent`).
"""

from __future__ import annotations

import pytest
import torch

from _exactness import assert_bit_identical
from stagedspec.models.config import ModelConfig
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.ragged import Segment, forward_ragged, padded_rows
from stagedspec.models.transformer import Transformer, init_random

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {
    "llama": ModelConfig(arch="llama", vocab_size=80, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         intermediate_size=48, max_position=96),
    "gpt2": ModelConfig(arch="gpt2", vocab_size=80, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=4,
                        intermediate_size=48, max_position=96),
    "gemma3": ModelConfig(arch="gemma3", vocab_size=80, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2,
                          intermediate_size=48, max_position=96, head_dim=8, sliding_window=5,
                          local_layers=[True, False, True], query_pre_attn_scalar=8),
}


def assert_same_rows(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to fp32 rounding of one matmul: far tighter than the 1e-5 that neighbouring segments are
    allowed (`test_ragged_segments_match_solo_passes`), so a padding row that leaked into a real one fails."""
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def tree_mask(n: int) -> torch.Tensor:
    """A small tree: node 0 root, 1 and 2 children of 0, 3 child of 1, ..."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        a = i
        while a >= 0:
            m[i, a] = True
            a = parents[a]
    return m


def cases(model: Transformer, seed: int):  # noqa: ANN201
    """(cache, prompt tokens, then one pass's kwargs) per sequence: different lengths, masks and widths."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    out = []
    for i, (plen, T, kind) in enumerate([(3, 1, "one"), (9, 5, "tree"), (14, 4, "causal"), (6, 3, "full")]):
        prompt = torch.randint(0, V, (1, plen), generator=g)
        toks = torch.randint(0, V, (1, T), generator=g)
        kw: dict = {}
        if kind == "tree":
            kw["tree_mask"] = tree_mask(T)
        elif kind == "full":
            m = torch.ones(T, plen + T, dtype=torch.bool)
            m[:, plen:] = tree_mask(T)
            m[1:, 2] = False  # a hidden earlier slot, as a drafter's full-width mask does
            kw["tree_mask"] = m
        if i % 2 == 1:
            kw["key_width"] = 40
        out.append((prompt, toks, plen, kw))
    return out


def run(model: Transformer, ragged: bool, row_independent: bool, seed: int, pad: bool = False):  # noqa: ANN201
    seqs = cases(model, seed)
    caches = [model.new_cache(64) for _ in seqs]
    # prompts: solo passes (the same for both sides)
    for cache, (prompt, _, plen, _) in zip(caches, seqs):
        model(prompt, torch.arange(plen), cache, PassSpec(logits_rows=slice(-1, None)))
        cache.commit()
    segs = [Segment(toks, torch.arange(plen, plen + toks.shape[1]), cache,
                    PassSpec(tree_mask=kw.get("tree_mask"), key_width=kw.get("key_width"),
                             row_independent=row_independent))
            for cache, (_, toks, plen, kw) in zip(caches, seqs)]
    if ragged:
        outs = forward_ragged(model, segs, pad=pad)
    else:
        outs = [model(s.tokens, s.positions, s.cache, s.spec) for s in segs]
    for c in caches:
        c.commit()
    return outs, caches


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("row_independent", [False, True])
def test_ragged_segments_match_solo_passes(arch, row_independent):
    model = init_random(Transformer(CONFIGS[arch]), seed=1).eval()
    with torch.inference_mode():
        solo, solo_caches = run(model, False, row_independent, seed=3)
        ragged, ragged_caches = run(model, True, row_independent, seed=3)
    for a, b in zip(solo, ragged):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(solo_caches, ragged_caches):
        assert a.length == b.length
        torch.testing.assert_close(b.k[:, :, :, :a.length], a.k[:, :, :, :a.length], rtol=1e-5, atol=1e-5)


def test_padded_rows_are_few_sizes_and_little_padding():
    sizes = [padded_rows(n) for n in range(1, 4097)]
    assert all(p >= n for n, p in zip(range(1, 4097), sizes))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) == 35  # what bounds the native per-shape state (oneDNN primitives, heap sizes)
    assert [padded_rows(n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65, 129)] == [1, 2, 4, 8, 16, 24, 40, 64, 80, 160]
    assert all((p - n) / p <= 0.2 for n, p in zip(range(65, 4097), sizes[64:]))


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("row_independent", [False, True])
def test_padded_ragged_pass_leaves_real_rows_unchanged(arch, row_independent):
    """The server pads a ragged pass's rows (`pad=True`); in fp32 every segment's logits and cache entries are
    those of the unpadded pass to the last bits (padding rows are only extra rows of the row-wise matmuls,
    never attended to), and the slots past each cache's entries stay untouched.  Often bit-identical, but
    not on every CPU: a GEMM may take another code path for a different row count (AVX2 MKL runs a 3-row
    and a 4-row head apart, 1 ulp off), hence `assert_same_rows`."""
    model = init_random(Transformer(CONFIGS[arch]), seed=1).eval()
    with torch.inference_mode():
        plain, plain_caches = run(model, True, row_independent, seed=3)
        padded, padded_caches = run(model, True, row_independent, seed=3, pad=True)
    total = sum(seq[1].shape[1] for seq in cases(model, 3))
    assert padded_rows(total) > total  # 13 rows run as 16: there is padding to test
    for a, b in zip(plain, padded):
        assert_same_rows(b, a)
    for a, b in zip(plain_caches, padded_caches):
        assert a.length == b.length
        assert_same_rows(b.k, a.k)
        assert_same_rows(b.v, a.v)
        assert not b.k[:, :, :, b.length:].any()


def test_padded_pass_returns_hidden_states_and_takes_features_per_segment():
    """`PassSpec.hidden` ("rows" and "all") and a feature draft's input features under padding."""
    from stagedspec.models.feature_draft import FeatureDraftModel

    oracle = init_random(Transformer(CONFIGS["llama"]), seed=4).eval()
    H = oracle.config.hidden_size
    g = torch.Generator().manual_seed(5)

    def segs(model, features: bool):  # noqa: ANN001, ANN202
        out = []
        for i, T in enumerate((3, 1, 2)):
            toks = torch.randint(0, 80, (1, T), generator=g)
            feats = torch.randn(1, T, H, generator=g) if features and i != 1 else None
            out.append(Segment(toks, torch.arange(T), model.new_cache(16),
                               PassSpec(logits_rows=slice(-1, None), hidden="all" if i == 0 else "rows",
                                        features=feats)))
        return out

    for model in (oracle, init_random(FeatureDraftModel(oracle), seed=6).eval()):
        state = g.get_state()
        with torch.inference_mode():
            plain = forward_ragged(model, segs(model, model is not oracle))
            g.set_state(state)
            padded = forward_ragged(model, segs(model, model is not oracle), pad=True)
        for (la, ha), (lb, hb) in zip(plain, padded):
            assert_same_rows(lb, la)
            assert_same_rows(hb, ha)


def test_the_server_batcher_pads_by_default():
    from stagedspec.server.batching import PassBatcher

    assert PassBatcher().pad and not PassBatcher(pad=False).pad


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_one_segment_is_bit_identical_to_forward(arch):
    model = init_random(Transformer(CONFIGS[arch]), seed=2).eval()
    with torch.inference_mode():
        for ragged_seed in range(4):
            seqs = cases(model, ragged_seed)
            for prompt, toks, plen, kw in seqs:
                outs = []
                for ragged in (False, True):
                    cache = model.new_cache(64)
                    model(prompt, torch.arange(plen), cache)
                    cache.commit()
                    pos = torch.arange(plen, plen + toks.shape[1])
                    if ragged:
                        seg = Segment(toks, pos, cache, PassSpec(tree_mask=kw.get("tree_mask"), logits_rows=slice(1, None),
                                                             key_width=kw.get("key_width")))
                        outs.append(forward_ragged(model, [seg])[0])
                    else:
                        outs.append(model(toks, pos, cache, PassSpec(tree_mask=kw.get("tree_mask"), logits_rows=slice(1, None),
                                                                 key_width=kw.get("key_width"))))
                assert torch.equal(outs[0], outs[1])


def test_a_restricted_head_draft_gets_full_vocabulary_logits():
    """A distilled draft's own head covers a subset of tokens; its ragged pass must scatter them into the
    vocabulary as `DraftModel.forward` does (a bug once made the server's `tree` accept nothing)."""
    from stagedspec.models.draft import DraftModel

    oracle = init_random(Transformer(CONFIGS["llama"]), seed=3).eval()
    draft = DraftModel(oracle, 1, list(range(0, 80, 3))).eval()
    toks = torch.tensor([[4, 9, 33]])
    with torch.inference_mode():
        solo = draft(toks, torch.arange(3), draft.new_cache(16))
        ragged = forward_ragged(draft, [Segment(toks, torch.arange(3), draft.new_cache(16))])[0]
    assert ragged.shape == solo.shape == (1, 3, 80)
    assert torch.equal(ragged, solo)


def test_ragged_refuses_batched_segments():
    model = init_random(Transformer(CONFIGS["llama"])).eval()
    seg = Segment(torch.zeros(2, 1, dtype=torch.long), torch.arange(1), model.new_cache(8, batch=2))
    with pytest.raises(ValueError, match="batch-1"):
        forward_ragged(model, [seg])


def test_feature_draft_segments_and_hidden_states_match_solo_passes():
    """A feature draft's passes (input fc(feature, embedding), hidden states out) join one ragged pass, one
    segment without features among them; the oracle's "all rows" hidden states come back per segment too."""
    from stagedspec.models.feature_draft import FeatureDraftModel

    oracle = init_random(Transformer(CONFIGS["llama"]), seed=4).eval()
    draft = FeatureDraftModel(oracle, 1, list(range(0, 80, 2))).eval()
    g = torch.Generator().manual_seed(5)
    H = oracle.config.hidden_size
    specs = [(4, 3, True, "rows"), (7, 1, True, "all"), (2, 4, False, "none"), (5, 2, True, "rows")]
    for model in (draft, oracle):
        solo, ragged_segs = [], []
        for plen, T, with_features, hidden in specs:
            feats = torch.randn(1, plen + T, H, generator=g) if with_features and model is draft else None
            toks = torch.randint(0, 80, (1, plen + T), generator=g)
            caches = []
            for _ in range(2):
                cache = model.new_cache(32)
                model(toks[:, :plen], torch.arange(plen), cache,
                      PassSpec(features=None if feats is None else feats[:, :plen]))
                cache.commit()
                caches.append(cache)
            spec = PassSpec(tree_mask=tree_mask(T), logits_rows=slice(-1, None) if T > 2 else None,
                            hidden=hidden, features=None if feats is None else feats[:, plen:])
            pos = torch.arange(plen, plen + T)
            with torch.inference_mode():
                solo.append(model(toks[:, plen:], pos, caches[0], spec))
            ragged_segs.append(Segment(toks[:, plen:], pos, caches[1], spec))
        with torch.inference_mode():
            ragged = forward_ragged(model, ragged_segs)
        for a, b in zip(solo, ragged):
            pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
            for x, y in pairs:
                assert x.shape == y.shape
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("pad", [False, True])
def test_quantised_models_on_the_native_kernels_batch_bit_identically(mode: str, pad: bool,
                                                                     isa_kernels) -> None:  # noqa: ANN001
    """int4/int8 oracles serve: each segment of a (padded) ragged pass is its solo pass to the bit, on each
    instruction-set path (forced in turn by `isa_kernels`; a failed kernel build fails this test)."""
    from stagedspec.models.quant import quantize_model

    kernels = isa_kernels
    cfg = ModelConfig(arch="llama", vocab_size=80, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=96)  # input sizes in whole groups of 32
    model = quantize_model(init_random(Transformer(cfg), seed=1).eval(), mode, torch.float32, kernels)
    assert model.runtime.native_stack is not None  # the ragged pass runs every block in one native call
    with torch.inference_mode():
        solo, solo_caches = run(model, False, False, seed=3)
        ragged, ragged_caches = run(model, True, False, seed=3, pad=pad)
        stack, model.runtime.native_stack = model.runtime.native_stack, None  # the same pass op by op, from Python
        by_ops, _ = run(model, True, False, seed=3, pad=pad)
        model.runtime.native_stack = stack
    where = f"{kernels.name} {mode}{' padded' if pad else ''}"
    for i, (a, b, c) in enumerate(zip(solo, ragged, by_ops)):
        assert_bit_identical(b, a, f"{where}: segment {i} of the ragged pass against its solo pass")
        assert_bit_identical(c, a, f"{where}: segment {i} of the ragged pass op by op against its solo pass")
    for i, (a, b) in enumerate(zip(solo_caches, ragged_caches)):
        assert_bit_identical(b.k[:, :, :, :a.length], a.k[:, :, :, :a.length], f"{where}: segment {i}'s keys")
        assert_bit_identical(b.v[:, :, :, :a.length], a.v[:, :, :, :a.length], f"{where}: segment {i}'s values")
