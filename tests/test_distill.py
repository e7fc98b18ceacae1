"""Distilled drafts: training lowers the KL, files round-trip, resume is exact, restricted heads stay exact.

Everything runs on a tiny random oracle in a few seconds.  Its weights use a
larger init scale than `init_random`'s default so that its next-token
distributions are peaked (entropy ~2.7 nats of 4.2): with a near-uniform
teacher there would be little to distil and greedy paths would hinge on
near-ties.
"""

from __future__ import annotations

import json
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import pytest
import torch

from stagedspec.errors import StagedSpecError
from stagedspec.models.config import ModelConfig
from stagedspec.models.draft import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DraftModel,
    grow_draft,
    grown_layers,
    save_draft,
)
from stagedspec.models.draft_loading import load_draft
from stagedspec.models.transformer import Transformer, init_random
from stagedspec.sampling import SamplingParams
from stagedspec.training.distill import (
    DistillConfig,
    bucket_kl,
    check_no_human_eval,
    corpus_streams_from_files,
    default_corpus_files,
    distill,
    eval_draft,
    batched_greedy_continuations,
    oracle_continuation,
    oracle_samples,
    teacher_topk,
)

VOCAB = 64


def tiny_config(**overrides: object) -> ModelConfig:
    base = dict(arch="llama", vocab_size=VOCAB, hidden_size=32, n_layers=4, n_heads=4, n_kv_heads=2,
                intermediate_size=64, max_position=128)
    base.update(overrides)
    return ModelConfig(**base)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def oracle() -> Transformer:
    return init_random(Transformer(tiny_config()), seed=0, std=0.3).eval()


@pytest.fixture(scope="module")
def corpus(oracle: Transformer) -> list[list[int]]:
    """Text the oracle itself would write (sampled at temperature 1): in-distribution for distillation."""
    g = torch.Generator().manual_seed(1)
    return [[i] + oracle_continuation(oracle, [i], 100, SamplingParams(temperature=1.0), g) for i in range(16)]


def small_cfg(out: Path, **overrides: object) -> DistillConfig:
    base = dict(layers=2, tokens=40 * 64, seq_len=16, batch_size=4, lr=3e-3, teacher_top_k=16, eval_every=10,
                eval_windows=8, heldout_fraction=0.1, checkpoint_every=10, out=str(out), fingerprint="tiny-fp")
    base.update(overrides)
    return DistillConfig(**base)


@pytest.fixture(scope="module")
def distilled(oracle: Transformer, corpus: list[list[int]], tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("distilled")
    draft = distill(oracle, None, corpus, small_cfg(out), progress=False)
    return draft, out


def test_distillation_lowers_heldout_kl(distilled) -> None:
    draft, out = distilled
    history = json.loads((out / "metrics.json").read_text())
    assert history[0]["step"] == 0 and history[-1]["step"] == 40
    assert history[-1]["heldout_kl"] < 0.9 * history[0]["heldout_kl"], history
    assert (out / CONFIG_NAME).is_file() and (out / WEIGHTS_NAME).is_file()
    assert draft.training_meta["heldout_kl"] == history[-1]["heldout_kl"]


def test_saved_draft_loads_back_with_shared_embedding_and_same_logits(distilled, oracle, tmp_path) -> None:
    draft, out = distilled
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20)

    save_draft(draft, tmp_path / "fp32", "tiny-fp", {"note": "x"}, dtype=torch.float32)
    loaded = load_draft(tmp_path / "fp32", oracle, expected_fingerprint="tiny-fp", dtype=torch.float32)
    assert loaded.embed.weight.data_ptr() == oracle.embed.weight.data_ptr()  # shared, not copied
    assert loaded.oracle_layers == draft.oracle_layers == [0, 2]
    with torch.no_grad():
        assert torch.equal(loaded(tokens, pos, loaded.new_cache(20)), draft(tokens, pos, draft.new_cache(20)))

    # The default bf16 file holds only the draft's own weights and loads as the bf16-rounded draft.
    from safetensors.torch import load_file

    names = set(load_file(str(out / WEIGHTS_NAME)))
    assert not any(n.startswith(("embed", "pos_embed")) for n in names)
    bf16 = load_draft(out, oracle, dtype=torch.float32)
    for name, value in draft.own_state_dict().items():
        assert torch.equal(bf16.own_state_dict()[name], value.to(torch.bfloat16).float()), name
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["fingerprint"] == "tiny-fp" and cfg["vocab_size"] == VOCAB and cfg["oracle_layers"] == [0, 2]
    assert cfg["training"]["config"]["tokens"] == 40 * 64


def test_forward_train_matches_cached_forward(oracle) -> None:
    """The cache-free training pass must compute what decoding computes (llama and GPT-2, both heads)."""
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    gpt2 = init_random(Transformer(tiny_config(arch="gpt2", n_kv_heads=4, tie_embeddings=False)), std=0.3)
    for model, head in [(oracle, None), (oracle, list(range(0, VOCAB, 3))), (gpt2, None), (gpt2, [2, 9, 40])]:
        draft = DraftModel(model, 2, head)
        with torch.no_grad():
            cached = draft(tokens, torch.arange(24), draft.new_cache(24, batch=2))
            train = draft.forward_train(tokens)
        assert torch.equal(cached.isinf(), train.isinf())
        finite = cached.isfinite()
        assert torch.allclose(cached[finite], train[finite], atol=1e-5)


def tiny_gemma_oracle(window: int = 5) -> Transformer:
    """A tiny Gemma-3: sliding-window and global layers, q/k norms, sandwich norms, a soft-capped head."""
    cfg = tiny_config(arch="gemma3", n_layers=4, head_dim=8, norm_eps=1e-6, rope_theta=1e6, sliding_window=window,
                      local_layers=[True, False, True, False], query_pre_attn_scalar=16, final_logit_softcap=30.0)
    return init_random(Transformer(cfg), seed=3, std=0.3).eval()


@pytest.mark.parametrize("layers", [2, [0, 1], [1, 3]])
def test_gemma3_draft_training_pass_matches_cached_forward(layers) -> None:
    """Gemma-3 drafts: scaled embeddings, q/k and sandwich norms, the window (24 tokens, window 5) and
    the soft-cap are computed alike by the training pass and by decoding, for local and global layers."""
    oracle = tiny_gemma_oracle()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    for head in (None, list(range(1, VOCAB, 2))):
        draft = DraftModel(oracle, layers, head)
        assert draft.config.local_layers == [oracle.config.local_layers[i] for i in draft.oracle_layers]
        with torch.no_grad():
            cached = draft(tokens, torch.arange(24), draft.new_cache(24, batch=2))
            train = draft.forward_train(tokens)
        finite = cached.isfinite()
        assert torch.equal(finite, train.isfinite())
        assert torch.allclose(cached[finite], train[finite], atol=1e-5)


def test_gemma3_distilled_draft_trains_saves_loads_and_keeps_greedy_exact(tmp_path) -> None:
    from stagedspec.drafters.model import ModelDrafter
    from stagedspec.generation import speculative_generate
    from stagedspec.request import generate_ar
    from stagedspec.runner import ModelOracle

    oracle = tiny_gemma_oracle()
    g = torch.Generator().manual_seed(5)
    corpus = [[i] + oracle_continuation(oracle, [i], 100, SamplingParams(temperature=1.0), g) for i in range(16)]
    draft = distill(oracle, None, corpus, small_cfg(tmp_path / "d", vocab_top=40), progress=False)
    history = json.loads((tmp_path / "d" / CONFIG_NAME).read_text())["training"]["history"]
    assert history[-1]["heldout_kl"] < history[0]["heldout_kl"]
    loaded = load_draft(tmp_path / "d", oracle, expected_fingerprint="tiny-fp", dtype=torch.float32)
    assert loaded.config.local_layers == [True, True]  # layers 0 and 2, both sliding-window
    prompt = [3, 17, 9]
    want = generate_ar(oracle, prompt, max_new_tokens=30).token_ids  # 33 tokens, past the window of 5
    drafter = ModelDrafter(loaded, method="tree", tree_budget=8, max_depth=4)
    got = speculative_generate(ModelOracle(oracle, len(prompt) + 30 + 8 + 1), drafter, prompt, max_new_tokens=30)
    assert got.token_ids == want
    assert got.stats.token_origins.count("draft") > 0


def test_resume_gives_the_same_weights(oracle, corpus, tmp_path) -> None:
    steps = 12
    cfg_a = small_cfg(tmp_path / "a", tokens=steps * 64, checkpoint_every=4, eval_every=5)
    cfg_b = small_cfg(tmp_path / "b", tokens=steps * 64, checkpoint_every=4, eval_every=5)
    straight = distill(oracle, None, corpus, cfg_a, progress=False)

    distill(oracle, None, corpus, cfg_b, progress=False, stop_after_steps=steps // 2)
    assert (tmp_path / "b" / "checkpoint.pt").is_file()
    assert not (tmp_path / "b" / WEIGHTS_NAME).exists()  # unfinished runs do not publish a draft
    resumed = distill(oracle, None, corpus, cfg_b, resume=True, progress=False)

    for name, value in straight.own_state_dict().items():
        assert torch.equal(resumed.own_state_dict()[name], value), name
    history_a = json.loads((tmp_path / "a" / "metrics.json").read_text())
    history_b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert history_a == history_b

    with pytest.raises(StagedSpecError, match="settings changed"):
        distill(oracle, None, corpus, small_cfg(tmp_path / "b", tokens=steps * 64, lr=1e-2), resume=True,
                progress=False)
    with pytest.raises(StagedSpecError, match="nothing to resume"):
        distill(oracle, None, corpus, small_cfg(tmp_path / "c"), resume=True, progress=False)


def test_restricted_head_gives_minus_inf_outside_its_tokens(oracle, corpus, tmp_path) -> None:
    subset = [1, 5, 7, 30, 63]
    draft = DraftModel(oracle, [1, 2], subset)
    with torch.no_grad():
        logits = draft(torch.tensor([[3, 4, 5]]), torch.arange(3), draft.new_cache(8))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(logits[..., outside]).all()
    assert torch.isfinite(logits[..., ~outside]).all()
    assert torch.equal(draft.head.weight, oracle.head_weight[subset])  # initialised from the oracle's rows

    trained = distill(oracle, None, corpus, small_cfg(tmp_path, tokens=4 * 64, vocab_top=12), progress=False)
    assert trained.head_tokens.numel() == 12
    with torch.no_grad():
        logits = trained(torch.tensor([[3]]), torch.tensor([0]), trained.new_cache(4))[0, 0]
    assert int(logits.isfinite().sum()) == 12
    assert load_draft(tmp_path, oracle).head_tokens.tolist() == trained.head_tokens.tolist()


def test_restricted_draft_missing_oracle_tokens_keeps_greedy_output_exact(oracle) -> None:
    from stagedspec.drafters.model import ModelDrafter
    from stagedspec.generation import speculative_generate
    from stagedspec.request import generate_ar
    from stagedspec.runner import ModelOracle

    prompt = [3, 17, 42, 8]
    reference = generate_ar(oracle, prompt, max_new_tokens=24).token_ids
    # Drop the oracle's most used tokens from the draft's head: it can never propose them.
    counts = torch.bincount(torch.tensor(reference), minlength=VOCAB)
    banned = counts.argsort(descending=True)[:3]
    keep = [t for t in range(VOCAB) if t not in set(banned.tolist())]
    draft = DraftModel(oracle, [0, 3], keep)

    drafter = ModelDrafter(draft, method="tree", tree_budget=8, max_depth=4)
    result = speculative_generate(ModelOracle(oracle, len(prompt) + 24 + 8 + 1), drafter, prompt, max_new_tokens=24)
    assert result.token_ids == reference
    assert "draft" in result.stats.token_origins  # some proposals were accepted, some tokens were not proposable
    emitted_banned = [o for t, o in zip(result.token_ids, result.stats.token_origins) if t in set(banned.tolist())]
    assert emitted_banned and all(o == "oracle" for o in emitted_banned)


def test_load_draft_rejects_unusable_folders(distilled, oracle, tmp_path) -> None:
    draft, out = distilled
    with pytest.raises(StagedSpecError, match="no draft folder"):
        load_draft(tmp_path / "nope", oracle)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StagedSpecError, match="is missing"):
        load_draft(tmp_path / "empty", oracle)
    with pytest.raises(StagedSpecError, match="another oracle/tokenizer"):
        load_draft(out, oracle, expected_fingerprint="other-fp")

    bad = tmp_path / "bad"
    save_draft(draft, bad, "tiny-fp")
    (bad / WEIGHTS_NAME).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(StagedSpecError, match="corrupt draft weights"):
        load_draft(bad, oracle)
    (bad / WEIGHTS_NAME).unlink()
    with pytest.raises(StagedSpecError, match="weights .* are missing"):
        load_draft(bad, oracle)
    (bad / CONFIG_NAME).write_text("{not json")
    with pytest.raises(StagedSpecError, match="corrupt draft config"):
        load_draft(bad, oracle)

    other_vocab = init_random(Transformer(tiny_config(vocab_size=80)))
    with pytest.raises(StagedSpecError, match="vocabulary of 64 tokens"):
        load_draft(out, other_vocab)
    other_width = init_random(Transformer(tiny_config(hidden_size=48, n_heads=4, n_kv_heads=2)))
    with pytest.raises(StagedSpecError, match="width 32"):
        load_draft(out, other_width)


def test_bucket_kl_is_zero_for_the_teacher_and_finite_for_a_restricted_student(oracle) -> None:
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    logp, ids = teacher_topk(oracle, tokens, 8)
    with torch.no_grad():
        logits = oracle(tokens, torch.arange(12), oracle.new_cache(12))[0]
    assert bucket_kl(logits, logp[0], ids[0]).abs().max() < 1e-5
    assert (bucket_kl(torch.zeros_like(logits), logp[0], ids[0]) > 0.01).all()
    # A student whose 4-token support lies inside the teacher's top-8: the loss stays finite.
    cols = torch.where(ids[0] < 4, ids[0], torch.full_like(ids[0], -1))
    assert torch.isfinite(bucket_kl(torch.zeros(12, 4, requires_grad=True), logp[0], cols)).all()


def test_eval_draft_reports_agreement_and_cost(oracle, distilled) -> None:
    draft, _ = distilled
    prompts = [[3, 17, 42], [9, 9, 1, 2]]
    self_eval = eval_draft(oracle, oracle, prompts, 12, timing_dtype=None, timing_steps=2)
    assert self_eval["top1"] == 1.0 and self_eval["positions"] > 0
    report = eval_draft(oracle, draft, prompts, 12, timing_dtype=torch.bfloat16, timing_steps=2)
    assert 0.0 <= report["top1"] <= report["top2"] <= report["top4"] <= report["top8"] <= 1.0
    assert report["draft_ms_per_token"] > 0 and report["oracle_ms_per_token"] > 0


def test_training_corpus_never_contains_human_eval(tmp_path) -> None:
    files = default_corpus_files()
    assert files and all(f.suffix in (".py", ".txt", ".rst", ".md") for f in files)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)
    check_no_human_eval(files)
    leaked = tmp_path / "human_eval" / "data.py"
    leaked.parent.mkdir()
    leaked.write_text("x = 1\n")
    with pytest.raises(StagedSpecError, match="HumanEval"):
        corpus_streams_from_files([leaked], tokenizer=None)


class _CharTokenizer:
    """Just enough of `stagedspec.tokenizer.Tokenizer` for `oracle_samples`: ids are char codes mod 60."""

    eos_token_ids = [63]

    def apply_chat_template(self, prompt: str) -> str:
        return f"<u>{prompt}<a>"

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 60 for c in text]


def test_oracle_samples_are_chat_prompt_plus_the_oracles_continuation(oracle) -> None:
    tok = _CharTokenizer()
    streams = oracle_samples(oracle, tok, ["Write a Python function `f(x)`. Add one."], 10, progress=False)
    prompt_ids = tok.encode("<u>Write a Python function `f(x)`. Add one.<a>")
    assert streams[0][: len(prompt_ids)] == prompt_ids
    reply = streams[0][len(prompt_ids):]
    assert reply == oracle_continuation(oracle, prompt_ids, 10, stop_token_ids=[63]) and 1 <= len(reply) <= 10


def test_batched_greedy_replies_equal_one_prompt_at_a_time(oracle) -> None:
    """Left-padded batches with one mask per sequence give each prompt's own greedy reply (fp32)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6, 9, 2)]
    stops = [7, 11]
    batched = batched_greedy_continuations(oracle, prompts, 20, stops, batch_size=3)
    single = [oracle_continuation(oracle, p, 20, stop_token_ids=stops) for p in prompts]
    assert batched == single
    assert any(len(r) < 20 for r in single) and any(len(r) == 20 for r in single)  # both stop kinds covered


def test_oracle_samples_batched_equals_unbatched(oracle) -> None:
    tok = _CharTokenizer()
    prompts = ["Write f.", "Write a Python function `g(x, y)`. Add them.", "Sum a list of numbers."]
    one = oracle_samples(oracle, tok, prompts, 12, progress=False)
    many = oracle_samples(oracle, tok, prompts, 12, progress=False, batch_size=2)
    assert one == many


@pytest.mark.parametrize("batch_size", [1, 2])
def test_oracle_samples_hand_each_finished_batch_to_on_batch(oracle, batch_size: int) -> None:
    """Every stream reaches `on_batch` once, under its prompt's index, as its batch finishes."""
    tok = _CharTokenizer()
    prompts = ["Write f.", "Write a Python function `g(x, y)`. Add them.", "Sum a list.", "Nothing at all here."]
    seen: dict[int, list[int]] = {}
    calls: list[int] = []

    def on_batch(indices: list[int], streams: list[list[int]]) -> None:
        calls.append(len(indices))
        for i, stream in zip(indices, streams):
            assert i not in seen
            seen[i] = stream

    streams = oracle_samples(oracle, tok, prompts, 8, progress=False, batch_size=batch_size, on_batch=on_batch)
    assert [seen[i] for i in range(len(prompts))] == streams
    assert calls == [batch_size] * (len(prompts) // batch_size)


def test_init_from_continues_a_saved_draft(distilled, oracle, corpus, tmp_path) -> None:
    """`init_from` starts at the saved draft's weights (not the oracle's layers) and keeps its head."""
    _, first = distilled
    start = load_draft(first, oracle, dtype=torch.float32)
    cfg = small_cfg(tmp_path / "more", tokens=10 * 64, init_from=str(first), vocab_top=5)
    history_start = distill(oracle, None, corpus, dataclasses_replace(cfg, tokens=64), progress=False,
                            stop_after_steps=0).training_meta["history"][0]
    first_end = json.loads((first / "metrics.json").read_text())[-1]
    # step 0 of the continued run is where the first run ended (bf16-rounded weights)
    assert abs(history_start["heldout_kl"] - first_end["heldout_kl"]) < 0.05 * first_end["heldout_kl"]
    more = distill(oracle, None, corpus, cfg, progress=False)
    assert more.oracle_layers == start.oracle_layers and more.head_tokens is None  # vocab_top ignored
    assert any(not torch.equal(more.own_state_dict()[k], v) for k, v in start.own_state_dict().items())
    assert load_draft(tmp_path / "more", oracle).oracle_layers == start.oracle_layers
    with pytest.raises(StagedSpecError, match="has 2 layers"):
        distill(oracle, None, corpus, small_cfg(tmp_path / "bad", layers=1, init_from=str(first)), progress=False)
    with pytest.raises(StagedSpecError, match="not a draft folder"):
        distill(oracle, None, corpus, small_cfg(tmp_path / "bad", init_from=str(tmp_path)), progress=False)


def test_grown_layers_fill_the_widest_gaps_in_oracle_order() -> None:
    assert grown_layers([0, 15], 30, 2) == ([0, 15], [False, False])
    assert grown_layers([0, 15], 30, 3) == ([0, 7, 15], [False, True, False])
    assert grown_layers([0, 15], 30, 4) == ([0, 7, 15, 22], [False, True, False, True])
    assert grown_layers([0, 2], 4, 4) == ([0, 1, 2, 3], [False, True, False, True])
    with pytest.raises(StagedSpecError, match="no layer left"):
        grown_layers([0, 2], 4, 5)
    with pytest.raises(StagedSpecError, match="cannot shrink"):
        grown_layers([0, 2], 4, 1)


def test_a_grown_draft_computes_what_it_grew_from_and_then_trains(distilled, oracle, corpus, tmp_path) -> None:
    """New layers start as no-ops (zero output projections), so continued training starts exactly where it was."""
    _, first = distilled
    start = load_draft(first, oracle, dtype=torch.float32)
    grown = grow_draft(start, oracle, 4)
    assert grown.oracle_layers == [0, 1, 2, 3] and len(grown.layers) == 4
    tokens = torch.tensor([corpus[0][:24], corpus[1][:24]])
    with torch.no_grad():
        torch.testing.assert_close(grown.forward_train(tokens), start.forward_train(tokens), rtol=0, atol=1e-6)
        # the cached inference pass too (what decoding runs)
        ref, out = start.new_cache(32), grown.new_cache(32)
        pos = torch.arange(24)
        torch.testing.assert_close(grown(tokens[:1], pos, out), start(tokens[:1], pos, ref), rtol=0, atol=1e-6)
    # continued training with --layers 4: step 0 is the saved draft's own held-out figure, and the new layers learn
    cfg = small_cfg(tmp_path / "grown", layers=4, init_from=str(first), tokens=6 * 64)
    trained = distill(oracle, None, corpus, cfg, progress=False)
    history = json.loads((tmp_path / "grown" / "metrics.json").read_text())
    first_end = json.loads((first / "metrics.json").read_text())[-1]
    assert abs(history[0]["heldout_kl"] - first_end["heldout_kl"]) < 0.05 * first_end["heldout_kl"]
    assert trained.layers[1].attn.wo.weight.abs().sum() > 0 and trained.layers[3].mlp.w_down.weight.abs().sum() > 0
    save_draft(trained, tmp_path / "saved", "tiny-fp", {})
    assert load_draft(tmp_path / "saved", oracle).oracle_layers == [0, 1, 2, 3]


def test_checkpoint_resumes_across_devices(oracle, corpus, tmp_path, monkeypatch) -> None:
    """A checkpoint is device-neutral: written by a CUDA run, it resumes on the CPU where it stopped.

    No GPU here, so the CUDA side is simulated: the checkpoint is rewritten to
    say it came from `cuda:0` with a CUDA generator state, and the load must
    map everything to the CPU (`map_location="cpu"`) and skip that generator.
    """
    steps = 8
    straight = distill(oracle, None, corpus, small_cfg(tmp_path / "a", tokens=steps * 64, checkpoint_every=4,
                                                       eval_every=2), progress=False)
    cfg = small_cfg(tmp_path / "b", tokens=steps * 64, checkpoint_every=4, eval_every=2)
    distill(oracle, None, corpus, cfg, progress=False, stop_after_steps=steps // 2)
    path = tmp_path / "b" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    assert state["step"] == steps // 2 and state["device"] == "cpu"
    moments = [v for s in state["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert moments and all(v.device.type == "cpu" for v in moments)
    state["device"] = "cuda:0"
    state["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)  # a foreign generator state: must not be applied
    torch.save(state, path)

    seen = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: seen.append(kw.get("map_location")) or real_load(*a, **kw))
    resumed = distill(oracle, None, corpus, cfg, resume=True, progress=False)
    assert seen == ["cpu"]
    assert resumed.training_meta["steps_done"] == steps
    history = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert [h["step"] for h in history] == [0, 2, 4, 6, 8]  # the step count goes on from 4
    assert history == json.loads((tmp_path / "a" / "metrics.json").read_text())  # and so do the losses
    for name, value in straight.own_state_dict().items():
        assert torch.equal(resumed.own_state_dict()[name], value), name


def test_bf16_autocast_training_keeps_fp32_weights_and_learns(oracle, corpus, tmp_path) -> None:
    """The GPU path's bf16 autocast (forced here on the CPU): fp32 weights and optimizer state, KL still falls."""
    cfg = small_cfg(tmp_path, tokens=20 * 64, eval_every=10)
    draft = distill(oracle, None, corpus, cfg, progress=False, autocast=True)
    assert all(p.dtype == torch.float32 for p in draft.trainable_parameters())
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for s in state["optimizer"]["state"].values()
               for k, v in s.items() if k != "step")
    history = json.loads((tmp_path / "metrics.json").read_text())
    assert history[-1]["heldout_kl"] < 0.95 * history[0]["heldout_kl"], history


def test_progress_reports_tokens_per_second_and_eta(oracle, corpus, tmp_path, capsys) -> None:
    from stagedspec.training.distill import _duration, _eta_seconds

    distill(oracle, None, corpus, small_cfg(tmp_path, tokens=4 * 64, eval_every=2), progress=True)
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("step ")]
    assert [l.split(":")[0] for l in lines] == ["step 2/4", "step 4/4"]
    assert all("tok/s" in l and "ETA" in l and "held-out KL" in l for l in lines)
    assert _duration(5) == "5s" and _duration(125) == "2m05s" and _duration(3 * 3600 + 60) == "3h01m"
    assert _eta_seconds(10.0, 5, 20, None) == 40.0
    assert _eta_seconds(10.0, 5, 20, deadline=0.0) == 0.0  # a time box that has passed


def test_bundled_drafts_are_found_by_tokenizer_fingerprint() -> None:
    from stagedspec.models.draft import BUNDLED_DRAFTS, bundled_draft_for, default_draft_dir, read_draft_config

    for name in BUNDLED_DRAFTS:
        folder = default_draft_dir().parent / name
        assert bundled_draft_for(read_draft_config(folder)["fingerprint"]) == folder
    assert default_draft_dir().name == "draft-smollm2-135m"  # no fingerprint: the default oracle's
    with pytest.raises(StagedSpecError, match="no bundled draft for this oracle .*Gemma-3-270m"):
        default_draft_dir("not-a-known-tokenizer")
