"""The KV cache and tree-masked forward: the engine features speculation relies on."""

import pytest
import torch

from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.transformer import init_random
from stagedspec.tree import TokenTree

ATOL = 1e-5  # fp32: tree and sequential runs differ only by summation order


def tiny(arch: str) -> Transformer:
    cfg = ModelConfig(arch=arch, vocab_size=97, hidden_size=48, n_layers=3, n_heads=4,
                      n_kv_heads=2 if arch == "llama" else 4, intermediate_size=96, max_position=128)
    return init_random(Transformer(cfg), seed=1, std=0.2).eval()


def sequential_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Logits of the last token when `ids` is run one token at a time on a fresh cache."""
    cache = model.new_cache(64)
    for i, t in enumerate(ids):
        out = model(torch.tensor([[t]]), torch.tensor([i]), cache)
        cache.commit()
    return out[0, -1]


# A tree under root: two branches of depth 3 and 2, and a sibling leaf.
#   0 -> 1 -> 2 -> 3
#   0 -> 4 -> 5
#   0 -> 6
TREE = TokenTree([11, 21, 22, 23, 31, 32, 41], [-1, 0, 1, 2, 0, 4, 0])
PREFIX = [5, 9, 13, 2, 7]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tree_forward_matches_sequential_paths(arch: str) -> None:
    model = tiny(arch)
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(torch.tensor([PREFIX]), torch.arange(len(PREFIX)), cache)
        cache.commit()
        logits = model(torch.tensor([TREE.tokens]), TREE.positions(cache.length), cache,
                       PassSpec(tree_mask=TREE.attention_mask()))[0]
        for node in range(len(TREE)):
            path = [0, *TREE.path_to(node)]
            ref = sequential_logits(model, PREFIX + [TREE.tokens[i] for i in path])
            torch.testing.assert_close(logits[node], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("keep", [[0, 4, 5], [0, 1, 2, 3], [0, 6], [0]])
def test_commit_keeps_only_the_accepted_path(arch: str, keep: list[int]) -> None:
    model = tiny(arch)
    nxt = 17
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(torch.tensor([PREFIX]), torch.arange(len(PREFIX)), cache)
        cache.commit()
        model(torch.tensor([TREE.tokens]), TREE.positions(cache.length), cache, PassSpec(tree_mask=TREE.attention_mask()))
        cache.commit(keep)
        assert cache.length == len(PREFIX) + len(keep)
        out = model(torch.tensor([[nxt]]), torch.tensor([cache.length]), cache)[0, -1]
        ref = sequential_logits(model, PREFIX + [TREE.tokens[i] for i in keep] + [nxt])
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_prefill_causal_matches_sequential() -> None:
    model = tiny("llama")
    with torch.inference_mode():
        cache = model.new_cache(64)
        out = model(torch.tensor([PREFIX]), torch.arange(len(PREFIX)), cache)[0]
        for i in range(len(PREFIX)):
            torch.testing.assert_close(out[i], sequential_logits(model, PREFIX[: i + 1]), atol=ATOL, rtol=0)


def test_cache_overflow_is_a_clear_error() -> None:
    from stagedspec.errors import StagedSpecError

    model = tiny("llama")
    cache = model.new_cache(4)
    with pytest.raises(StagedSpecError, match="context is full"):
        model(torch.tensor([PREFIX]), torch.arange(len(PREFIX)), cache)


def test_tree_helpers() -> None:
    assert TREE.depths == [0, 1, 2, 3, 1, 2, 1]
    assert TREE.path_to(5) == [4, 5]
    m = TREE.attention_mask()
    assert m[3].tolist() == [True, True, True, True, False, False, False]
    assert m[6].tolist() == [True, False, False, False, False, False, True]
    assert TREE.positions(10).tolist() == [10, 11, 12, 13, 11, 12, 11]


def test_keep_slot_aligned_cuts_at_the_first_node_off_the_first_child_chain() -> None:
    from stagedspec.generation import keep_slot_aligned
    from stagedspec.verification import VerifyResult

    # pre-order: 0 -> 1 -> 2 -> 3 (first-child chain), 1 -> 4 -> 5 (a second branch)
    tree = TokenTree([10, 11, 12, 13, 14, 15], [-1, 0, 1, 2, 1, 4])
    on_chain = VerifyResult([1, 2, 3], 99)
    assert keep_slot_aligned(tree, on_chain) is on_chain
    cut = keep_slot_aligned(tree, VerifyResult([1, 4, 5], 99))
    assert cut.accepted == [1] and cut.next_token == 14  # node 4's token, chosen on aligned row 1
    assert keep_slot_aligned(tree, VerifyResult([], 7)).accepted == []


def test_row_by_row_attention_rows_do_not_depend_on_the_pass() -> None:
    """`row_independent` attention: a query row's output is the same bit for bit whatever rows share its pass,
    and it computes the same function as the fused kernel (up to rounding)."""
    import torch.nn.functional as F

    from stagedspec.models.transformer import attend_row_by_row

    g = torch.Generator().manual_seed(0)
    H, Hkv, S, D, T = 6, 2, 96, 32, 12
    q = torch.randn(1, H, T, D, generator=g).to(torch.bfloat16)
    k = torch.randn(1, Hkv, S, D, generator=g).to(torch.bfloat16)
    v = torch.randn(1, Hkv, S, D, generator=g).to(torch.bfloat16)
    mask = torch.zeros(T, S, dtype=torch.bool)
    for t in range(T):
        mask[t, : 40 + t + 1] = True
    full = attend_row_by_row(q, k, v, mask, H // Hkv)
    for start, n in [(0, 1), (3, 2), (5, 7), (11, 1)]:
        part = attend_row_by_row(q[:, :, start:start + n], k, v, mask[start:start + n], H // Hkv)
        assert torch.equal(part, full[:, :, start:start + n])
    fused = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(H // Hkv, 1),
                                           v.float().repeat_interleave(H // Hkv, 1), attn_mask=mask)
    assert torch.allclose(full.float(), fused, atol=3e-2)


def test_a_non_contiguous_attention_output_is_handled(monkeypatch) -> None:  # noqa: ANN001
    """CUDA's non-cuDNN SDPA backends return non-contiguous outputs; the CPU kernel does not, so force one."""
    import torch.nn.functional as F

    model = tiny("llama")
    ids = torch.tensor([PREFIX])
    with torch.inference_mode():
        want = model(ids, torch.arange(len(PREFIX)), model.new_cache(64))
        real = F.scaled_dot_product_attention

        def strided(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - same values, transposed strides
            out = real(*args, **kwargs)
            return out.transpose(-1, -2).contiguous().transpose(-1, -2)

        monkeypatch.setattr(F, "scaled_dot_product_attention", strided)
        assert not strided(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 3)).is_contiguous()
        got = model(ids, torch.arange(len(PREFIX)), model.new_cache(64))
    assert torch.equal(got, want)
