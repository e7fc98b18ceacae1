"""A draft's head cut to part of the vocabulary (`models.head_subset`, `--draft-vocab`).

The cut draft proposes only tokens of its subset (the others have logit -inf); greedy output stays `ar`'s with
the drafts proven used, sampled output keeps the oracle's distribution (chi-square, with a negative control whose
q is the whole head's while its tokens come from the cut one), and bad `--draft-vocab` values give one-line
errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stagedspec.drafters.model import ModelDrafter
from stagedspec.errors import StagedSpecError
from stagedspec.generation import NoDrafter, speculative_generate
from stagedspec.runner import ModelOracle
from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.draft import BUNDLED_DRAFTS
from stagedspec.models.head_subset import (bundled_subset, check_draft_vocab, draft_subset, restrict_head,
                                           split_vocab_suffix, token_ids_file)
from stagedspec.models.quant import Int8Linear
from stagedspec.models.transformer import init_random
from stagedspec.profiling import model_fingerprint
from stagedspec.sampling import SamplingParams, probs_from_logits
from _exactness import assert_drafts_used
from test_distribution_exactness import ALPHA, N_FAST, V
from test_feature_draft import sampled_fit

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
N_NEGATIVE_HERE = 600  # the control recomputes the whole head's q by full passes: fewer samples suffice


def tiny(seed: int, vocab: int = 48, layers: int = 2) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=256)
    return init_random(Transformer(cfg), seed=seed, std=0.3).eval()


def logits_of(model: Transformer, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(len(ids)))[0]


@pytest.mark.parametrize("head", ["float", "int8"])
def test_a_cut_head_gives_the_whole_head_s_logits_on_its_tokens_and_minus_inf_elsewhere(head: str) -> None:
    model = tiny(3)
    if head == "int8":  # PyTorch's int8 kernel (bf16 activations): the cut head stays int8
        model = model.to(torch.bfloat16)
        model.head_q = Int8Linear(model.head_weight.detach(), None, None)
    ids = [1, 5, 7, 20, 33, 47]
    whole = logits_of(model, [2, 9, 4])
    restrict_head(model, torch.tensor([33, 1, 7, 5, 47, 20, 5]))  # any order, repeats dropped
    cut = logits_of(model, [2, 9, 4])
    assert cut.shape == whole.shape
    others = [t for t in range(48) if t not in ids]
    assert torch.isinf(cut[:, others]).all() and (cut[:, others] < 0).all()
    # fp32: the same values up to the matrix product's rounding, which may differ with the head's width (on a Zen 5
    # EPYC 5 of these 18 logits moved by up to 4.8e-7); a draft's q is its own cut head's, so no exactness rests on it
    torch.testing.assert_close(cut[:, ids], whole[:, ids], rtol=0, atol=1e-5 if head == "float" else 5e-2)
    assert head == "float" or isinstance(model.subset_head, Int8Linear)
    assert model.num_bytes() < tiny(3).num_bytes()  # the whole head is no longer streamed


def test_greedy_with_a_cut_draft_head_equals_ar_and_uses_the_draft() -> None:
    oracle = tiny(5)
    draft = tiny(5)  # the oracle's weights with its head cut: proposes the oracle's token wherever it can
    keep = torch.arange(0, 48, 2)
    restrict_head(draft, keep)
    prompt = [3, 8, 1, 30]
    with torch.no_grad():
        ar = speculative_generate(ModelOracle(oracle, 128), NoDrafter(), prompt, max_new_tokens=24)
        for method in ("chain", "tree"):
            drafter = ModelDrafter(draft, method=method, chain_length=3, tree_budget=6, max_depth=3, max_len=128)
            out = speculative_generate(ModelOracle(oracle, 128), drafter, prompt, max_new_tokens=24)
            assert out.token_ids == ar.token_ids, method
            assert_drafts_used(out, f"{method} with a cut head")
    odd = [t for t in ar.token_ids if t % 2]
    assert odd, "the oracle never chose a token outside the subset: the test would not see a refused proposal"


class WholeHeadQ(ModelDrafter):
    """The mistake to catch: tokens drawn from the cut head, q reported as the whole head's distribution."""

    def __init__(self, cut: Transformer, whole: Transformer, **kw) -> None:  # noqa: ANN003
        super().__init__(cut, **kw)
        self.whole = whole

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        tree = super().propose(context, sampling, generator, max_tokens)
        for node in list(tree.child_q):
            path, a = [], node
            while a > 0:
                path.append(tree.tokens[a])
                a = tree.parents[a]
            row = logits_of(self.whole, list(context) + path[::-1])[-1:]
            tree.child_q[node] = probs_from_logits(row, sampling)[0].float()
        return tree


def sampled_pvalue(sampling: SamplingParams, n: int, wrong_q: bool = False) -> float:
    oracle = tiny(21, vocab=V)
    cut = tiny(22, vocab=V)
    restrict_head(cut, torch.tensor([0, 2, 3]))  # tokens 1 and 4 are never proposed
    prompt = [1, 3, 0]
    kw = dict(method="chain", chain_length=2, max_len=64)
    drafter = WholeHeadQ(cut, tiny(22, vocab=V), **kw) if wrong_q else ModelDrafter(cut, **kw)
    return sampled_fit(oracle, drafter, prompt, sampling, n)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
                         ids=["t1", "t0.7-k3"])
def test_sampling_from_a_cut_draft_head_matches_the_oracle(sampling: SamplingParams) -> None:
    p = sampled_pvalue(sampling, N_FAST)
    assert p > ALPHA, f"a cut draft head deviates from the oracle (p = {p:.2e})"


def test_negative_control_q_from_the_whole_head_is_caught() -> None:
    """600 samples give p ~ 1e-14 (300: ~4e-8)."""
    p = sampled_pvalue(SamplingParams(temperature=1.5), N_NEGATIVE_HERE, wrong_q=True)
    assert p < ALPHA, f"q from the whole head while drawing from the cut one was not detected (p = {p:.3f})"


def test_the_cut_changes_the_cost_key_and_auto_cuts_only_where_a_subset_is_bundled(tmp_path: Path) -> None:
    a, b = tiny(7), tiny(7)
    restrict_head(b, torch.arange(10))
    assert model_fingerprint(a) != model_fingerprint(b)  # a cut draft is priced by its own measured passes
    assert draft_subset("full", tiny(7), "no-such-tokenizer") is None
    assert draft_subset("auto", tiny(7), "no-such-tokenizer") is None  # nothing bundled for this tokenizer
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps([4, 2, 9]))
    assert draft_subset(str(ids_file), tiny(7), "x").tolist() == [2, 4, 9]
    lines = tmp_path / "ids.txt"
    lines.write_text("5\n1\n")
    assert token_ids_file(str(lines), 48).tolist() == [1, 5]


def test_the_bundled_qwen_subset_is_found_by_its_tokenizer_fingerprint() -> None:
    from stagedspec.models.draft import assets_dir

    config = json.loads((assets_dir() / "draft-qwen2.5-coder-1.5b" / "draft_config.json").read_text())
    assert "draft-qwen2.5-coder-1.5b" in BUNDLED_DRAFTS
    ids = bundled_subset(config["fingerprint"], config["vocab_size"])
    assert ids is not None and ids.numel() == config["head_size"] and bool((ids[1:] > ids[:-1]).all())
    assert bundled_subset(config["fingerprint"], config["vocab_size"] + 1) is None  # another vocabulary


def test_spec_suffixes_name_the_vocabulary_beside_the_weights() -> None:
    assert split_vocab_suffix("qwen2.5-coder-0.5b@full") == ("qwen2.5-coder-0.5b", "full")
    assert split_vocab_suffix("d.gguf@full@int8") == ("d.gguf@int8", "full")
    assert split_vocab_suffix("d.gguf@int8") == ("d.gguf@int8", None)
    assert split_vocab_suffix("d.gguf") == ("d.gguf", None)


@pytest.mark.parametrize("content, match", [(None, "neither auto, full nor a file"),
                                            ("[1, 2, 99]", "must lie in 0..47"),
                                            ("{\"a\": 1}", "no list of integer token ids"),
                                            ("one two", "neither a JSON list"),
                                            ("[]", "no list of integer token ids")])
def test_bad_draft_vocab_values_are_one_line_errors(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "ids"
    if content is None:
        with pytest.raises(StagedSpecError, match=match) as err:
            check_draft_vocab(str(path))
    else:
        path.write_text(content)
        check_draft_vocab(str(path))
        with pytest.raises(StagedSpecError, match=match) as err:
            draft_subset(str(path), tiny(7), "x")
    assert "\n" not in str(err.value)
