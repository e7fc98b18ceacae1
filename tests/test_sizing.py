"""Measured sizing (`SpeculationConfig.sizing`): tree, lookup and staged sized each step by this machine's costs.

A fixed size that pays on one CPU loses on another (an AVX2 EPYC, 2026-11-24: `tree` 0.92x and `lookup`
0.95x `ar`).  With "measured" sizing the method runs `auto`'s policy restricted to `ar` and the method's own
arms, so it is never knowingly slower than plain decoding; a size named on the command line is run as named.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from stagedspec.auto import AutoDrafter, AutoPolicy, arms_for
from stagedspec.costs import CostProfile
from stagedspec.errors import StagedSpecError
from stagedspec.learned_state import auto_state_path
from stagedspec.models.draft_formats import truncated_copy
from stagedspec.methods import METHODS
from stagedspec.pipeline import Pipeline, SpeculationConfig, choose_sizing
from stagedspec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread", "private_cost_cache")

# the methods `--sizing measured` sizes by measured costs (`auto` always does)
MEASURED_METHODS = tuple(name for name, m in METHODS.items() if m.sizable and not m.always_measured)
FLAT = CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])  # every arm is worth a turn
PROMPT = [1, 5, 9, 5, 9, 5, 9, 2, 7]


def test_the_command_line_measures_sizes_unless_one_is_named() -> None:
    assert choose_sizing("tree", None, {"tree_budget": None, "lookup_length": None}) == "measured"
    assert choose_sizing("tree", None, {"tree_budget": 16}) == "fixed"
    assert choose_sizing("tree", None, {"lookup_length": 2}) == "measured"  # not a size of tree
    assert choose_sizing("lookup", None, {"lookup_length": 2}) == "fixed"
    assert choose_sizing("staged", None, {"oracle_lookup": False}) == "fixed"  # --no-oracle-lookup
    assert choose_sizing("auto", None, {"tree_budget": 16}) == "fixed"  # a server request may switch to tree
    assert choose_sizing("tree", "fixed", {}) == "fixed"
    with pytest.raises(StagedSpecError, match="--sizing measured picks tree's sizes each step; drop --tree-budget"):
        choose_sizing("tree", "measured", {"tree_budget": 16})
    with pytest.raises(StagedSpecError, match="unknown --sizing"):
        SpeculationConfig(method="tree", sizing="sometimes")


def test_cli_flags_set_the_sizing() -> None:
    from stagedspec.cli.args import add_speculation_args, speculation_from

    p = argparse.ArgumentParser()
    p.add_argument("--oracle", default="default")
    p.add_argument("--quant", default="none")
    add_speculation_args(p)

    def spec(*argv: str) -> SpeculationConfig:
        return speculation_from(p.parse_args(list(argv)))[2]

    assert spec("--method", "tree", "--draft", "d").sizing == "measured"
    fixed = spec("--method", "tree", "--draft", "d", "--tree-branching", "3")
    assert (fixed.sizing, fixed.tree_branching, fixed.tree_budget) == ("fixed", 3, SpeculationConfig().tree_budget)
    assert spec("--method", "lookup", "--lookup-length", "2").sizing == "fixed"
    assert spec("--method", "staged", "--draft", "d", "--sizing", "fixed").sizing == "fixed"
    assert spec("--method", "staged", "--draft", "d").measured
    assert not spec("--method", "chain", "--draft", "d").measured  # chain is always the textbook baseline
    assert spec("--method", "auto").measured


def own_kinds(method: str) -> set[str]:
    """The arm kinds a measured method prices: `ar` and its own (`lookup`'s include `copy`, the prompt-lookup chain
    alone)."""
    return {"ar", method} | ({"copy"} if method == "lookup" else set())


def test_a_measured_method_prices_only_ar_and_its_own_arms() -> None:
    for method in MEASURED_METHODS:
        kinds = {a.kind for a in arms_for(True, True, "cpu", method)}
        assert kinds == own_kinds(method)
    assert arms_for(True, True, "cpu", None) == arms_for(True, True, "cpu")
    s = SpeculationConfig(method="tree", sizing="measured")
    assert s.max_tree_budget == max(a.size for a in arms_for(True, True, "cuda", "tree"))
    assert SpeculationConfig(method="tree").max_tree_budget < s.max_tree_budget  # fixed: its own sizes, as before


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN001, ANN201
    from _tiny_models import save_tiny_hf

    from stagedspec.models.loading import load_model

    folder = tmp_path_factory.mktemp("sizing") / "tiny"
    save_tiny_hf("llama_gqa", folder)
    model, tok = load_model(folder, dtype=torch.float32)
    return model, tok, truncated_copy(model, 1)


def _measured(tiny, method: str) -> Pipeline:  # noqa: ANN001
    model, tok, draft = tiny
    drafts = [] if method == "lookup" else [draft]
    pipe = Pipeline(model, tok, drafts, SpeculationConfig(method=method, sizing="measured"))
    pipe.learned.set_policy(method, AutoPolicy(arms_for(True, bool(drafts), "cpu", method), FLAT))
    return pipe


@pytest.mark.parametrize("method", MEASURED_METHODS)
def test_measured_methods_are_exact_and_run_their_own_arms(tiny, method: str) -> None:  # noqa: ANN001
    model, tok, _ = tiny
    ar = Pipeline(model, tok, speculation=SpeculationConfig(method="ar"))
    pipe = _measured(tiny, method)
    drafter = pipe.drafter(64)
    assert isinstance(drafter, AutoDrafter) and {a.kind for a in drafter.policy.arms} == own_kinds(method)
    kind_of = {a.name: a.kind for a in drafter.policy.arms}
    own_steps = 0
    for n in (7, 33):
        out = pipe.generate(PROMPT, max_new_tokens=n)
        assert out.token_ids == ar.generate(PROMPT, max_new_tokens=n).token_ids
        assert set(out.stats.auto_choices) <= set(kind_of)
        own_steps += sum(k for name, k in out.stats.auto_choices.items() if kind_of[name] in own_kinds(method) - {"ar"})
    # On the flat profile speculation looks free: the method's own sizes must have run, or the identity above
    # would only have compared `ar` with itself.
    assert own_steps > 0, f"only ar ran: {out.stats.auto_choices}"
    sampling = SamplingParams(temperature=1.0, top_k=20)
    first = pipe.generate(PROMPT, max_new_tokens=24, sampling=sampling, seed=5)
    assert pipe.generate(PROMPT, max_new_tokens=24, sampling=sampling, seed=5).token_ids == first.token_ids
    # the same pipeline at fixed sizes runs the method's own drafter, never `auto`'s
    pipe.speculation = SpeculationConfig(method=method)
    assert not isinstance(pipe.drafter(64), AutoDrafter)


def test_each_measured_method_keeps_its_own_learned_state(tiny) -> None:  # noqa: ANN001
    """A restricted policy's state never overwrites `auto`'s: each is saved beside the profile, by method."""
    model, tok, draft = tiny
    paths = set()
    for method in ("auto", "tree", "lookup"):
        spec = SpeculationConfig(method=method, sizing="measured")
        pipe = Pipeline(model, tok, [] if method == "lookup" else [draft], spec)
        pipe.generate(PROMPT, max_new_tokens=12)
        policy = pipe.sized_policy(method)
        assert {a.kind for a in policy.arms} <= (own_kinds(method) if method != "auto" else {"ar", "lookup", "copy",
                                                                                          "tree", "staged"})
        path = auto_state_path(policy.profile.key, method)
        assert path.exists()
        paths.add(path)
        again = Pipeline(model, tok, [] if method == "lookup" else [draft], spec)
        assert again.sized_policy(method).state()["greedy"]["chains"] == policy.state()["greedy"]["chains"]
    assert len(paths) == 3


def test_a_server_request_that_names_a_tree_budget_runs_it() -> None:
    from stagedspec.server.engine import Engine
    from stagedspec.server.schemas import SpeculationRequest, parse_speculation

    from types import SimpleNamespace

    engine = Engine.__new__(Engine)
    engine.speculation = SpeculationConfig(method="tree", sizing="measured")
    engine.draft_names, engine.draft_models, engine.ngram = ["d"], [object()], None
    engine.model = SimpleNamespace(config=SimpleNamespace(max_position=2048))  # the tree budget's cap: the context
    assert engine.speculation_for(SpeculationRequest()).measured
    named = engine.speculation_for(parse_speculation({"tree_budget": 5}))
    assert (named.sizing, named.tree_budget, named.measured) == ("fixed", 5, False)


def test_every_size_has_one_name_in_the_library_the_cli_and_the_server() -> None:
    """`SIZE_FIELDS` are `SpeculationConfig`'s fields, `generate`'s and `serve`'s flags (with dashes) and the
    server's `speculation` fields, under the same names."""
    import dataclasses

    from stagedspec.cli.commands import build_parser
    from stagedspec.server.schemas import SPECULATION_FIELDS
    from stagedspec.speculation import SIZE_FIELDS

    fields = {f.name for f in dataclasses.fields(SpeculationConfig)}
    assert set(SIZE_FIELDS) <= fields
    sizing_names = {"tree_budget", "tree_depth", "tree_branching", "chain_length", "lookup_length", "stage_length",
                    "stage_branching", "oracle_lookup_length"}
    assert set(SIZE_FIELDS) == sizing_names
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("generate", "serve"):
        flags = {s for a in commands[command]._actions for s in a.option_strings if a.help != argparse.SUPPRESS}
        assert {"--" + n.replace("_", "-") for n in SIZE_FIELDS} <= flags, command
    assert set(SIZE_FIELDS) <= set(SPECULATION_FIELDS)


def test_old_size_names_still_work_for_one_release_with_a_notice(capsys: pytest.CaptureFixture[str]) -> None:
    from stagedspec.cli.args import add_speculation_args, speculation_from

    p = argparse.ArgumentParser()
    p.add_argument("--oracle", default="default")
    p.add_argument("--quant", default="none")
    add_speculation_args(p)
    spec = speculation_from(p.parse_args(["--method", "staged", "--draft", "d", "--stage-chain-length", "2",
                                          "--lookup-chain-length", "5"]))[2]
    assert (spec.stage_length, spec.lookup_length, spec.sizing) == (2, 5, "fixed")
    err = capsys.readouterr().err.splitlines()
    assert err == ["stagedspec: --lookup-chain-length is now called --lookup-length; the old name will stop working "
                   "in the next release",
                   "stagedspec: --stage-chain-length is now called --stage-length; the old name will stop working "
                   "in the next release"]
    assert spec == speculation_from(p.parse_args(["--method", "staged", "--draft", "d", "--stage-length", "2",
                                                  "--lookup-length", "5"]))[2]
    with pytest.warns(FutureWarning, match="^branching is now called tree_branching"):
        old = SpeculationConfig(method="tree", branching=3)
    assert old == SpeculationConfig(method="tree", tree_branching=3)
    with pytest.warns(FutureWarning, match="^stage_chain_length is now called stage_length"):
        assert SpeculationConfig.tuned("staged", stage_chain_length=4).stage_length == 4


def test_a_server_request_may_name_any_size() -> None:
    from types import SimpleNamespace

    from stagedspec.server.engine import Engine
    from stagedspec.server.schemas import APIError, parse_speculation

    engine = Engine.__new__(Engine)
    engine.speculation = SpeculationConfig(method="staged", sizing="measured")
    engine.draft_names, engine.draft_models, engine.ngram, engine.model = ["d"], [object()], object(), SimpleNamespace(
        config=SimpleNamespace(max_position=2048))
    named = engine.speculation_for(parse_speculation({"stage_length": 2, "stage_branching": 3, "lookup_length": 6}))
    assert (named.stage_length, named.stage_branching, named.lookup_length, named.sizing) == (2, 3, 6, "fixed")
    with pytest.raises(APIError, match="'speculation.stage_length' must be >= 1"):
        parse_speculation({"stage_length": 0})
    with pytest.raises(APIError, match="speculation.branching"):
        parse_speculation({"branching": 2})  # the server never had the old names
