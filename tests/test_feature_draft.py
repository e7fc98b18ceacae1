"""The EAGLE-style feature draft: exactness does not depend on it, its inputs are threaded right, it trains.

- Greedy identity: `tree`, `chain`, `staged` (feature draft as the top stage,
  with and without prompt lookup merged) on tiny random fp32 transformers
  emit exactly `ar`'s tokens, with eager and static oracle passes.
- Plumbing: each root prediction made incrementally in the loop (the oracle's
  recorded hidden states in, the draft's cache kept across steps) equals the
  draft's teacher-forced pass over the context with the oracle's features;
  the training pass unrolled j steps equals a depth-j chain node at inference.
- Sampling: the chi-square test of `test_distribution_exactness` through the
  real loop with a feature tree drafter and a feature stage (walked, and the
  stage also through the batched rules a GPU uses), and its negative controls
  (a stage that passes up the wrong q; a corrupted batched verifier) caught by
  the same test; tree, chain and stage again with a tapped draft (its root reads
  an oracle layer's input too), with its own negative control.
- Files and commands: save/load with `kind: "feature"`, one-line errors,
  `distill --kind feature` (API and CLI, seconds) and `eval-draft` on it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from _exactness import assert_drafts_used
from stagedspec.drafters.feature import FeatureDrafter, FeatureStage
from stagedspec.drafters.lookup import LookupDrafter
from stagedspec.drafters.merged import MergedDrafter
from stagedspec.errors import StagedSpecError
from stagedspec.generation import speculative_generate
from stagedspec.request import generate_ar
from stagedspec.runner import ModelOracle
from stagedspec.models import ModelConfig, Transformer
from stagedspec.models.draft import CONFIG_NAME, WEIGHTS_NAME, save_draft
from stagedspec.models.draft_loading import load_draft
from stagedspec.models.feature_draft import FeatureDraftModel, is_feature_draft
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.transformer import init_random
from stagedspec.runner import set_pass_mode
from stagedspec.sampling import SamplingParams
from stagedspec.stages import StageDrafter
from stagedspec.training.distill import DistillConfig, distill
from stagedspec.training.feature import shift_features
from test_distribution_exactness import (ALPHA, L, N_FAST, N_NEGATIVE, V, chi_square_pvalue, corrupt_batched_leftover,
                                         exact_distribution, use_verifier)
from test_staged import WrongQStage

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def tiny(seed: int, layers: int = 3, vocab: int = 24) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_position=256)
    return init_random(Transformer(cfg), seed=seed, std=0.3).eval()


def feature_draft(oracle: Transformer, seed: int, head: list[int] | None = None,
                  taps: tuple[int, ...] = ()) -> FeatureDraftModel:
    """An untrained feature draft with its fc and layers perturbed, so that it depends on its features (and,
    with `taps`, on the tapped layers' inputs: tap_fc perturbed from zero)."""
    draft = FeatureDraftModel(oracle, 1, head, taps=taps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        if taps:
            draft.tap_fc.weight.add_(0.3 * torch.randn(draft.tap_fc.weight.shape, generator=g))
    return draft.eval()


# ---------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_tree_chain_and_staged_greedy_equal_ar(mode: str) -> None:
    runs: dict[str, list] = {}
    for seed in range(6):
        oracle = tiny(seed)
        set_pass_mode(oracle, mode)
        prompt = torch.randint(0, 24, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = generate_ar(oracle, prompt, max_new_tokens=40).token_ids
        head = None if seed % 2 else list(range(0, 24, 2))  # full and restricted heads
        draft = feature_draft(oracle, seed, head)
        set_pass_mode(draft, mode)
        drafters = {
            "tree": FeatureDrafter(draft, tree_budget=8, max_depth=4, branching=2, max_len=300),
            "chain": FeatureDrafter(draft, method="chain", chain_length=4, max_len=300),
            "staged": StageDrafter(FeatureStage(draft, 300), LookupDrafter(None, True, chain_length=4),
                                   chain_length=3, branching=2),
        }
        drafters["staged+lookup"] = MergedDrafter(
            StageDrafter(FeatureStage(draft, 300), LookupDrafter(None, True, chain_length=4), chain_length=4),
            LookupDrafter(None, True, chain_length=5))
        for name, drafter in drafters.items():
            out = speculative_generate(ModelOracle(oracle, 300), drafter, prompt, max_new_tokens=40)
            assert out.token_ids == ref, f"seed {seed}, {name}, {mode} passes"
            assert drafter.forward_passes > 0
            runs.setdefault(name, []).append(out)
    for name, outs in runs.items():
        assert_drafts_used(outs, f"{name} ({mode} passes)")


def test_pipeline_runs_a_feature_draft_in_tree_staged_and_auto(tmp_path: Path) -> None:
    from _tiny_models import save_tiny_hf

    from stagedspec.auto import AutoPolicy, arms_for
    from stagedspec.costs import CostProfile
    from stagedspec.models.loading import load_model
    from stagedspec.models.draft_formats import truncated_copy
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    save_tiny_hf("llama_gqa", tmp_path / "tiny")
    oracle, tok = load_model(tmp_path / "tiny", dtype=torch.float32)
    draft = feature_draft(oracle, 7)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    ref = generate_ar(oracle, prompt, max_new_tokens=30).token_ids
    for method in ("tree", "chain", "staged", "auto"):
        pipe = Pipeline(oracle, tok, [draft], SpeculationConfig(method=method, tree_budget=8))
        if method == "auto":  # every arm gets its turn, the feature tree and stage among them
            flat = CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])
            pipe.learned.set_policy("auto", AutoPolicy(arms_for(True, True), flat))
        out = pipe.generate(prompt, max_new_tokens=30)
        assert out.token_ids == ref, method
        assert_drafts_used(out, f"{method} with a feature draft")
    # Below another stage it would read no oracle features: refused.
    pipe = Pipeline(oracle, tok, [truncated_copy(oracle, 1), draft], SpeculationConfig(method="staged"))
    with pytest.raises(StagedSpecError, match="top draft stage"):
        pipe.generate(prompt, max_new_tokens=4)


# ---------------------------------------------------------------------- plumbing
def test_root_predictions_read_the_oracle_features_of_the_committed_context() -> None:
    """Incremental (cache kept across steps, features recorded from verification) == teacher-forced."""
    oracle = tiny(3)
    draft = feature_draft(oracle, 3)
    seen: list[tuple[list[int], torch.Tensor]] = []

    class Recording(FeatureDrafter):
        def _root(self, context):  # noqa: ANN001, ANN202
            logits = super()._root(context)
            seen.append((list(context), logits[-1].clone()))
            return logits

    prompt = [5, 2, 7, 7, 1]
    speculative_generate(ModelOracle(oracle, 300), Recording(draft, tree_budget=6, max_depth=3, max_len=300), prompt,
                         max_new_tokens=30)
    assert len(seen) > 3
    with torch.no_grad():
        for context, logits in seen:
            seq = torch.tensor([context])
            _, f = oracle(seq, torch.arange(len(context)), oracle.new_cache(len(context)), PassSpec(hidden="rows"))
            ref = draft.expand_logits(draft.support_logits(draft.hidden_train(seq, shift_features(f))))[0, -1]
            assert torch.allclose(logits, ref, atol=1e-4), context


def test_unrolled_training_steps_equal_tree_nodes_at_inference() -> None:
    """Step j of `unrolled_hidden` at position t == the depth-j node of a chain rooted at t - j."""
    oracle = tiny(4)
    draft = feature_draft(oracle, 4)
    T, steps = 12, 4
    tokens = torch.randint(0, 24, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, f = oracle(tokens, torch.arange(T), oracle.new_cache(T), PassSpec(hidden="rows"))
        outs = draft.unrolled_hidden(tokens, shift_features(f), steps)
        for root in (2, 6):
            cache = draft.new_cache(T)
            feats = shift_features(f)[:, : root + 1]
            _, h = draft(tokens[:, : root + 1], torch.arange(root + 1), cache, PassSpec(hidden="rows", features=feats))
            cache.commit()
            assert torch.allclose(h[0, -1], outs[0][0, root], atol=1e-5)
            parent = h[0, -1]
            for j in range(1, steps):
                t = root + j
                _, h = draft(tokens[:, t:t + 1], torch.tensor([t]), cache,
                             PassSpec(hidden="rows", features=parent[None, None]))
                cache.commit()  # a chain: each node sees the context and its ancestors
                assert torch.allclose(h[0, 0], outs[j][0, t], atol=1e-5), (root, j)
                parent = h[0, 0]


# ---------------------------------------------------------------------- sampling exactness
class TransformerLM:
    """`exact_distribution`'s table interface over a tiny transformer: logits of a context by a full pass."""

    def __init__(self, model: Transformer) -> None:
        self.model, self._rows = model, {}

    def logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self._rows:
            with torch.no_grad():
                out = self.model(torch.tensor([list(ctx)]), torch.arange(len(ctx)), self.model.new_cache(len(ctx)))
            self._rows[ctx] = out[0, -1].double()
        return self._rows[ctx]


def sampled_pvalue(build: str, sampling: SamplingParams, n: int, stage_cls: type = StageDrafter,
                   taps: tuple[int, ...] = ()) -> float:
    """`taps`: a tapped draft (the root reads the oracle's tapped layer inputs, deeper nodes zeros there)."""
    oracle = tiny(21, layers=2, vocab=V)  # its continuations of the prompt: 11 of 125 cells above 1%
    draft = feature_draft(oracle, 21, taps=taps)
    prompt = [1, 3, 0]
    if build == "tree":  # best-first top-k tree: deterministic proposals
        drafter = FeatureDrafter(draft, tree_budget=4, max_depth=2, branching=2, max_len=64)
    elif build == "chain":  # sampled chain: draws from the feature draft's q
        drafter = FeatureDrafter(draft, method="chain", chain_length=2, max_len=64)
    else:
        drafter = stage_cls(FeatureStage(draft, 64), LookupDrafter(None, True, chain_length=2), chain_length=2,
                            branching=2)
    return sampled_fit(oracle, drafter, prompt, sampling, n)


def sampled_fit(oracle: Transformer, drafter: object, prompt: list[int], sampling: SamplingParams, n: int) -> float:
    """The chi-square p-value of `n` seeded continuations (L tokens) drawn through `drafter` against the oracle's
    exact distribution."""
    counts: Counter = Counter()
    with torch.no_grad():
        for s in range(n):
            out = speculative_generate(ModelOracle(oracle, 64), drafter, prompt, max_new_tokens=L, sampling=sampling,
                                       seed=s)
            counts[tuple(out.token_ids)] += 1
    return chi_square_pvalue(counts, exact_distribution(TransformerLM(oracle), prompt, sampling))[0]


NEGATIVE_SAMPLING = SamplingParams(temperature=2.0, top_k=2)  # the raw softmax the wrong stage passes up is far off


# A GPU verifies with the batched rules (`verify` on CUDA logits), the CPU walks: the feature stage (its drawn
# siblings and q passed up, lookup below) also runs batched, with 400 samples (~20 ms each here), which detect
# TV >= 0.15 (power 0.9); the rules themselves get N_FAST on every toy tree shape in test_distribution_exactness.
N_BATCHED = 400


@pytest.mark.parametrize("build, sampling, verifier", [("tree", SamplingParams(temperature=1.0), "walk"),
                                                       ("chain", SamplingParams(temperature=0.7, top_k=3), "walk"),
                                                       ("staged", SamplingParams(temperature=1.5, top_p=0.9), "walk"),
                                                       ("staged", NEGATIVE_SAMPLING, "walk"),
                                                       ("staged", NEGATIVE_SAMPLING, "batched")])
def test_sampling_with_a_feature_draft_matches_the_oracle(build: str, sampling: SamplingParams, verifier: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    use_verifier(monkeypatch, verifier)
    p = sampled_pvalue(build, sampling, N_FAST if verifier == "walk" else N_BATCHED)
    assert p > ALPHA, f"{build} with a feature draft deviates from the oracle (p = {p:.2e}, {verifier})"


@pytest.mark.parametrize("build, sampling", [("tree", SamplingParams(temperature=1.0)),
                                             ("chain", SamplingParams(temperature=0.7, top_k=3)),
                                             ("staged", SamplingParams(temperature=1.5, top_p=0.9))])
def test_sampling_with_a_tapped_feature_draft_matches_the_oracle(build: str, sampling: SamplingParams) -> None:
    p = sampled_pvalue(build, sampling, N_FAST, taps=(1,))
    assert p > ALPHA, f"{build} with a tapped feature draft deviates from the oracle (p = {p:.2e})"


def test_negative_control_wrong_q_from_a_tapped_feature_stage_is_caught() -> None:
    p = sampled_pvalue("staged", NEGATIVE_SAMPLING, N_NEGATIVE, stage_cls=WrongQStage, taps=(1,))
    assert p < ALPHA, f"the wrong stage over a tapped draft was not detected (p = {p:.3f})"


def test_negative_control_wrong_q_from_a_feature_stage_is_caught() -> None:
    p = sampled_pvalue("staged", NEGATIVE_SAMPLING, N_NEGATIVE, stage_cls=WrongQStage)  # ~1e-17 at 1,000 samples
    assert p < ALPHA, f"the wrong stage was not detected (p = {p:.3f})"


def test_negative_control_corrupted_batched_verifier_under_a_feature_stage_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched case above with `verify_sampled`'s leftover corrupted: 150 samples give p ~ 1e-6."""
    use_verifier(monkeypatch, "batched")
    corrupt_batched_leftover(monkeypatch)
    p = sampled_pvalue("staged", NEGATIVE_SAMPLING, 150)
    assert p < ALPHA, f"a corrupted batched verifier passed under a feature stage (p = {p:.3f})"


# ---------------------------------------------------------------------- files
def test_save_load_round_trip_and_one_line_errors(tmp_path: Path) -> None:
    oracle = tiny(5)
    draft = feature_draft(oracle, 5, list(range(0, 24, 3)))
    save_draft(draft, tmp_path / "d", "fp", {"note": "x"}, dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / CONFIG_NAME).read_text())
    assert cfg["kind"] == "feature" and cfg["format_version"] == 2 and cfg["oracle_layers"] == [2]
    loaded = load_draft(tmp_path / "d", oracle, expected_fingerprint="fp")
    assert is_feature_draft(loaded) and loaded.embed.weight.data_ptr() == oracle.embed.weight.data_ptr()
    tokens, feats = torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 32)
    with torch.no_grad():
        a = draft(tokens, torch.arange(3), draft.new_cache(4), PassSpec(features=feats))
        b = loaded(tokens, torch.arange(3), loaded.new_cache(4), PassSpec(features=feats))
    assert torch.equal(a, b)

    cfg["kind"] = "mystery"
    (tmp_path / "d" / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(StagedSpecError, match="unknown kind 'mystery'"):
        load_draft(tmp_path / "d", oracle)
    cfg["kind"] = "independent"  # a feature draft's weights read as an independent draft: its fc is unexpected
    (tmp_path / "d" / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(StagedSpecError, match="corrupt draft .*unexpected \\['fc"):
        load_draft(tmp_path / "d", oracle)
    (tmp_path / "d" / WEIGHTS_NAME).write_bytes(b"junk")
    with pytest.raises(StagedSpecError, match="corrupt draft weights"):
        load_draft(tmp_path / "d", oracle)


def test_distill_feature_kind_lowers_kl_saves_and_resumes(tmp_path: Path) -> None:
    oracle = tiny(6, vocab=64)
    g = torch.Generator().manual_seed(1)
    from stagedspec.training.distill import oracle_continuation

    corpus = [[i] + oracle_continuation(oracle, [i], 100, SamplingParams(temperature=1.0), g) for i in range(12)]

    def cfg(out: Path, **kw: object) -> DistillConfig:
        base = dict(kind="feature", layers=1, tokens=16 * 64, seq_len=16, batch_size=4, lr=3e-3, teacher_top_k=16,
                    eval_every=4, eval_windows=8, heldout_fraction=0.1, checkpoint_every=4, out=str(out),
                    fingerprint="fp", ttt_steps=3)
        base.update(kw)
        return DistillConfig(**base)

    straight = distill(oracle, None, corpus, cfg(tmp_path / "a"), progress=False)
    history = straight.training_meta["history"]
    assert history[-1]["heldout_kl"] < 0.9 * history[0]["heldout_kl"], history
    assert {"heldout_top1_d2", "heldout_top1_d3"} <= set(history[-1])
    loaded = load_draft(tmp_path / "a", oracle, expected_fingerprint="fp")
    assert is_feature_draft(loaded) and loaded.training_meta["config"]["ttt_steps"] == 3

    distill(oracle, None, corpus, cfg(tmp_path / "b"), progress=False, stop_after_steps=2)
    resumed = distill(oracle, None, corpus, cfg(tmp_path / "b"), resume=True, progress=False)
    for name, value in straight.own_state_dict().items():
        assert torch.equal(resumed.own_state_dict()[name], value), name

    with pytest.raises(StagedSpecError, match="ttt-steps"):
        cfg(tmp_path / "c", kind="independent")
    with pytest.raises(StagedSpecError, match="is a feature draft, but --kind is independent"):
        distill(oracle, None, corpus, cfg(tmp_path / "c", kind="independent", ttt_steps=1,
                                          init_from=str(tmp_path / "a")), progress=False)


def test_cli_distill_kind_feature_and_eval_draft_side_by_side(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from test_cli_distill import CODE, distill_args, run

    from _tiny_models import save_tiny_hf

    oracle_dir = tmp_path / "oracle"
    save_tiny_hf("llama_gqa", oracle_dir)
    code = tmp_path / "mod.py"
    code.write_text(CODE * 4)
    corpus = [str(code)]
    feature, independent = tmp_path / "feature", tmp_path / "independent"
    assert run(distill_args(oracle_dir, corpus, feature, "--kind", "feature", "--ttt-steps", "2")) == 0
    assert json.loads((feature / CONFIG_NAME).read_text())["kind"] == "feature"
    assert run(distill_args(oracle_dir, corpus, independent)) == 0
    converted = tmp_path / "converted"  # an independent draft continued as a feature draft
    assert run(distill_args(oracle_dir, corpus, converted, "--kind", "feature", "--init-from", str(independent))) == 0
    assert json.loads((converted / CONFIG_NAME).read_text())["kind"] == "feature"
    from stagedspec.cli.distill import _saved_layers  # --layers defaults to the --init-from draft's

    assert _saved_layers(str(independent)) == 1 and _saved_layers(None) is None
    assert _saved_layers(str(tmp_path / "nothing")) is None
    assert run(distill_args(oracle_dir, corpus, tmp_path / "x", "--ttt-steps", "2")) == 2
    assert "--ttt-steps applies to --kind feature only" in capsys.readouterr().err

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\n\ndef g(a, b):\n")
    rc = run(["eval-draft", "--oracle", str(oracle_dir), "--draft", f"{feature},{independent}", "--prompts",
              str(prompts), "--tokens", "12", "--accept-prompts", "1", "--accept-tokens", "8", "--tree-depth", "3",
              "--dtype", "fp32", "--json"])
    assert rc == 0
    both = json.loads(capsys.readouterr().out)["drafts"]
    assert [Path(r["draft"]).name for r in both] == ["feature", "independent"]
    for r in both:
        assert 0 <= r["top1"] <= r["top4"] <= 1 and r["tree_mean_accepted_length"] >= 1 and r["draft_cost_ratio"] > 0


def test_feature_draft_from_an_independent_draft_starts_as_it_and_learns_the_features(tmp_path: Path) -> None:
    """`--kind feature --init-from INDEPENDENT`: step 0 computes the independent draft's outputs at every unrolled
    level (fc ignores the features), the held-out figure starts where that draft's ends, and training moves fc's
    feature half off zero.  Exactness in decoding holds as for any feature draft."""
    from stagedspec.models.draft import DraftModel
    from stagedspec.models.feature_draft import feature_draft_from
    from stagedspec.training.distill import oracle_continuation

    oracle = tiny(6, vocab=64)
    g = torch.Generator().manual_seed(1)
    corpus = [[i] + oracle_continuation(oracle, [i], 100, SamplingParams(temperature=1.0), g) for i in range(12)]
    base = dict(layers=2, tokens=8 * 64, seq_len=16, batch_size=4, lr=3e-3, teacher_top_k=16, eval_every=4,
                eval_windows=8, heldout_fraction=0.1, checkpoint_every=4, fingerprint="fp", vocab_top=40)
    independent = distill(oracle, None, corpus, DistillConfig(out=str(tmp_path / "ind"), **base), progress=False)
    start = load_draft(tmp_path / "ind", oracle, dtype=torch.float32)
    converted = feature_draft_from(start, oracle)
    assert is_feature_draft(converted) and converted.oracle_layers == start.oracle_layers
    tokens = torch.tensor([corpus[0][:24], corpus[1][:24]])
    feats = torch.randn(2, 24, 32)
    with torch.no_grad():
        levels = converted.unrolled_hidden(tokens, feats, 3)
        plain = start.hidden_train(tokens)
        assert torch.equal(levels[0], plain)  # fc = [0 | I]: the features are read and ignored
        ref, out = start.new_cache(32), converted.new_cache(32)  # the cached decoding pass agrees too
        pos = torch.arange(24)
        assert torch.equal(converted(tokens[:1], pos, out, PassSpec(features=feats[:1])), start(tokens[:1], pos, ref))
    with pytest.raises(StagedSpecError, match="only from an independent draft"):
        feature_draft_from(converted, oracle)

    cfg = DistillConfig(out=str(tmp_path / "feat"), kind="feature", ttt_steps=2, init_from=str(tmp_path / "ind"),
                        **{**base, "lr": 1e-3})
    trained = distill(oracle, None, corpus, cfg, progress=False)
    history = json.loads((tmp_path / "feat" / "metrics.json").read_text())
    ind_end = independent.training_meta["history"][-1]
    assert abs(history[0]["heldout_kl"] - ind_end["heldout_kl"]) < 1e-3 * ind_end["heldout_kl"]
    assert trained.fc.weight[:, :32].abs().sum() > 0  # the feature half learned something
    assert 0 < trained.training_meta["fc_lr_scale"] < 1  # at the embeddings' scale (see `fc_lr_scale`)
    saved = load_draft(tmp_path / "feat", oracle, expected_fingerprint="fp")
    assert is_feature_draft(saved) and type(start) is DraftModel

    # a greedy feature tree from the trained, converted draft still emits the oracle's own tokens
    prompt = [1, 5, 9]
    ref_tokens = generate_ar(oracle, prompt, max_new_tokens=30).token_ids
    drafter = FeatureDrafter(saved.eval(), tree_budget=6, max_depth=3, branching=2, max_len=300)
    out = speculative_generate(ModelOracle(oracle, 300), drafter, prompt, max_new_tokens=30)
    assert out.token_ids == ref_tokens
