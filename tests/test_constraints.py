"""Logit bias and grammar constraints: exact under speculation, with respect to the constrained distribution.

Greedy: every method's tokens equal constrained `ar`'s on the tiny models
(grammar tests need llguidance and are skipped without it).  Sampling: see
tests/test_constraints_distribution.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _exactness import assert_drafts_used
from stagedspec.constraints import GrammarSpec, LogitControls, LogitsProcessor, grammar_available, parse_logit_bias
from stagedspec.errors import StagedSpecError
from stagedspec.tree import TokenTree

needs_grammar = pytest.mark.skipif(not grammar_available(), reason="llguidance is not installed")

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
PROMPTS = ([1, 5, 9, 33, 2, 200, 17], [1, 40, 41, 42, 40, 41, 42, 40])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from _tiny_models import save_tiny_hf

    from stagedspec.models.loading import load_model

    folder = tmp_path_factory.mktemp("constraints") / "tiny"
    save_tiny_hf("llama_gqa", folder)
    return load_model(folder, dtype=torch.float32)


def pipelines(tiny, private: bool = True) -> dict:  # noqa: ANN001
    """One pipeline per method over the same tiny oracle and its one-layer draft."""
    from stagedspec.auto import AutoPolicy, arms_for
    from stagedspec.costs import CostProfile
    from stagedspec.models.draft_formats import truncated_copy
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    model, tok = tiny
    draft = truncated_copy(model, 1)
    configs = {
        "ar": SpeculationConfig(method="ar"),
        "chain": SpeculationConfig(method="chain", chain_length=3),
        "tree": SpeculationConfig(method="tree", tree_budget=6, tree_depth=3, tree_branching=2),
        "lookup": SpeculationConfig(method="lookup", lookup_length=4),
        "staged": SpeculationConfig(method="staged", stage_length=3, stage_branching=2),
        "auto": SpeculationConfig(method="auto"),
    }
    out = {}
    for name, spec in configs.items():
        drafts = [] if name in ("ar", "lookup") else [draft]
        out[name] = Pipeline(model, tok, drafts, spec)
    flat = CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])  # every arm gets its turn
    out["auto"].learned.set_policy("auto", AutoPolicy(arms_for(True, True), flat))
    return out


# --------------------------------------------------------------------------- logit bias


def test_logit_bias_parsing() -> None:
    assert parse_logit_bias({"5": 10, 7: -100.0}, 300) == {5: 10.0, 7: -100.0}
    for bad in ({"x": 1}, {"300": 1}, {"-1": 1}, {"5": 101}, {"5": "1"}, {"5": float("nan")}, {True: 1}):
        with pytest.raises(StagedSpecError):
            parse_logit_bias(bad, 300)


def test_bias_moves_greedy_and_every_method_matches_ar(tiny) -> None:  # noqa: ANN001
    pipes = pipelines(tiny)
    prompt = PROMPTS[0]
    plain = pipes["ar"].generate(prompt, max_new_tokens=12).token_ids
    banned = sorted(set(plain))[:3]
    forced = 77
    controls = LogitControls(logit_bias={**{t: -100.0 for t in banned}, forced: 4.0})
    want = pipes["ar"].generate(prompt, max_new_tokens=24, controls=controls).token_ids
    assert not set(banned) & set(want) and want != plain[: len(want)]
    for name, pipe in pipes.items():
        out = pipe.generate(prompt, max_new_tokens=24, controls=controls)
        assert out.token_ids == want, name
        if name != "ar":
            assert_drafts_used(out, f"{name} with a logit bias")


def test_no_controls_wrap_nothing(tiny) -> None:  # noqa: ANN001
    pipe = pipelines(tiny)["tree"]
    assert pipe.logits_processor(None) is None and pipe.logits_processor(LogitControls()) is None
    assert pipe.drafter(64).processor is None


def test_processor_rows_follow_each_nodes_path() -> None:
    """A toy grammar: no token twice in a row.  Row u is masked after u's own path."""

    class NoRepeat:
        def __init__(self, last: int | None) -> None:
            self.last = last

        def allowed(self) -> torch.Tensor:
            mask = torch.ones(6, dtype=torch.bool)
            if self.last is not None:
                mask[self.last] = False
            return mask

        def child(self, token: int) -> "NoRepeat":
            return NoRepeat(token)

    proc = LogitsProcessor(6, {5: 1.0}, NoRepeat(None))
    proc.begin([0, 1])
    tree = TokenTree([1], [-1])
    a = tree.add(0, 2)
    b = tree.add(a, 3)
    c = tree.add(0, 4)
    rows = proc.rows([0, 1], tree, [0, a, b, c], torch.zeros(4, 6))
    assert torch.isinf(rows).nonzero().tolist() == [[1, 2], [2, 3], [3, 4]]  # the root (prompt) is unconstrained
    assert rows[0, 5] == 1.0
    assert proc.allowed_prefix([0, 1, 2], [2, 3]) == 0 and proc.allowed_prefix([0, 1], [2, 3, 3, 1]) == 2


# --------------------------------------------------------------------------- grammars


@needs_grammar
@pytest.mark.parametrize("grammar", [GrammarSpec.json_schema(SCHEMA), GrammarSpec.json_object(),
                                     GrammarSpec("grammar", 'root ::= "{" [a-z ]* "}" | "[" [0-9]+ "]"')],
                         ids=["json_schema", "json_object", "gbnf"])
def test_grammar_greedy_every_method_is_constrained_ar(tiny, grammar: GrammarSpec) -> None:  # noqa: ANN001
    pipes = pipelines(tiny)
    controls = LogitControls(grammar=grammar)
    runs: dict[str, list] = {}
    for prompt in PROMPTS:
        want = pipes["ar"].generate(prompt, max_new_tokens=40, controls=controls)
        compiler = pipes["ar"].grammar_compiler()
        state = compiler.initial_state(compiler.compile(grammar))
        for t in want.token_ids:  # every emitted token is one the grammar allows
            assert bool(state.allowed()[t]), (t, want.token_ids)
            state = state.child(t)
        for name, pipe in pipes.items():
            got = pipe.generate(prompt, max_new_tokens=40, controls=controls)
            assert got.token_ids == want.token_ids, name
            runs.setdefault(name, []).append(got)
    for name, outs in runs.items():
        if name != "ar":
            assert_drafts_used(outs, f"{name} under a {grammar.kind} grammar")


@needs_grammar
def test_schema_output_parses_when_the_model_stops(tiny) -> None:  # noqa: ANN001
    """A forced short schema completes: the reply is a JSON document the schema accepts, then a stop token."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    pipes = pipelines(tiny)
    _, tok = tiny
    controls = LogitControls(grammar=GrammarSpec.json_schema(schema),
                             logit_bias={t: 30.0 for t in tok.eos_token_ids})  # stop as soon as allowed
    for name in ("ar", "tree", "staged"):
        res = pipes[name].generate(PROMPTS[0], max_new_tokens=60, controls=controls)
        assert res.stats.finish_reason == "stop", name
        doc = json.loads(res.text)
        assert set(doc) == {"a"} and isinstance(doc["a"], bool)


@needs_grammar
def test_grammar_sampling_is_seed_reproducible_and_valid(tiny) -> None:  # noqa: ANN001
    from stagedspec.sampling import SamplingParams

    pipes = pipelines(tiny)
    controls = LogitControls(grammar=GrammarSpec.json_schema(SCHEMA))
    sampling = SamplingParams(temperature=1.0, top_k=20)
    compiler = pipes["ar"].grammar_compiler()
    for name in ("chain", "tree", "staged"):
        first = pipes[name].generate(PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=3, controls=controls)
        again = pipes[name].generate(PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=3, controls=controls)
        assert first.token_ids == again.token_ids
        # The seed decided the draws: a loop that ignored it would repeat these tokens under other seeds too.
        others = [pipes[name].generate(PROMPTS[1], max_new_tokens=30, sampling=sampling, seed=s,
                                       controls=controls).token_ids for s in (4, 5)]
        assert any(o != first.token_ids for o in others), f"{name}: seeds 3, 4 and 5 gave the same tokens"
        state = compiler.initial_state(compiler.compile(controls.grammar))
        for t in first.token_ids:
            assert bool(state.allowed()[t])
            state = state.child(t)


@needs_grammar
@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json_schema", '{"type": "objec"}'), "bad JSON schema"),
    (GrammarSpec("grammar", "start: foo"), "bad grammar"),
])
def test_bad_grammars_are_one_line_errors(tiny, spec: GrammarSpec, words: str) -> None:  # noqa: ANN001
    pipe = pipelines(tiny)["ar"]
    with pytest.raises(StagedSpecError) as err:
        pipe.generate(PROMPTS[0], max_new_tokens=4, controls=LogitControls(grammar=spec))
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_schema_text_must_be_json() -> None:
    with pytest.raises(StagedSpecError, match="not valid JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(StagedSpecError, match="must be a JSON object"):
        GrammarSpec.json_schema([1])


# --------------------------------------------------------------------------- the command line


@needs_grammar
def test_cli_json_schema_and_grammar_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from _tiny_models import save_tiny_hf

    from stagedspec.cli import main

    folder = tmp_path / "tiny"
    save_tiny_hf("llama_gqa", folder)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    common = ["generate", "Hello the", "--oracle", str(folder), "--dtype", "fp32", "--max-new-tokens", "12", "--json"]
    runs = {}
    for name, extra in (("ar", ["--method", "ar"]), ("tree", ["--method", "tree", "--draft", "layers:1"])):
        assert main([*common, *extra, "--json-schema", str(schema)]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["ar"]["token_ids"] == runs["tree"]["token_ids"] and runs["ar"]["text"].startswith('{"')
    assert main([*common, "--method", "ar", "--grammar", str(grammar)]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
    assert main([*common, "--method", "ar", "--json-object", "--logit-bias", "5=-100"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].startswith("{")


def test_cli_bad_flags_are_one_line_errors(tmp_path: Path) -> None:
    import argparse

    from stagedspec.cli.constraints import controls_from

    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"json_schema": None, "json_object": False, "grammar": None, "logit_bias": [], **kw})

    assert controls_from(args()) is None
    assert controls_from(args(logit_bias=["7=-2.5"])).logit_bias == {7: -2.5}
    for bad in (args(logit_bias=["7"]), args(logit_bias=["x=1"]), args(json_schema=str(tmp_path / "missing.json"))):
        with pytest.raises(StagedSpecError):
            controls_from(bad)
