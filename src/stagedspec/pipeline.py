"""From user-level specs (paths, method names, text) to a configured decoding loop.

The CLI, the benchmark and the server all go through `Pipeline`, so a method
means the same thing everywhere.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from stagedspec.auto.drafter import AutoDrafter
from stagedspec.exactness import default_bit_exact
from stagedspec.errors import StagedSpecError
from stagedspec.generation import (
    Drafter,
    GenerationResult,
    ModelOracle,
    NoDrafter,
    Oracle,
    context_budget,
    speculative_generate,
)
from stagedspec.learned_state import LearnedState
from stagedspec.models.draft_formats import DraftSource, draft_format, load_draft_spec
from stagedspec.models.transformer import Transformer
from stagedspec.pass_options import PassOptions, PassRuntime
from stagedspec.runner import RequestPasses, draft_cache_len
from stagedspec.sampling import SamplingParams
from stagedspec.tokenizer import tokenizer_fingerprint

if TYPE_CHECKING:
    from stagedspec.constraints.grammar import GrammarCompiler
    from stagedspec.threads import ThreadGovernor
    from stagedspec.constraints.processor import LogitControls, LogitsProcessor

METHODS = ("auto", "ar", "chain", "tree", "lookup", "staged")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return resolve_dtype(name, "cpu")[0]
    try:
        return DTYPES[name]
    except KeyError:
        raise StagedSpecError(f"unknown dtype {name!r}: use auto, bf16 or fp32") from None


def resolve_dtype(name: str, device: str, quant: str = "none") -> tuple[torch.dtype, str]:
    """(dtype, why) for a --dtype value; `auto` asks the hardware (`stagedspec.hardware.auto_dtype`).

    Quantised weights on the native kernels take either dtype (activations are
    quantised to int8 inside them), so `auto` asks the hardware for the rest
    of the pass too; PyTorch's fallback kernels compute in bf16 only.
    """
    if name != "auto":
        return parse_dtype(name), "as asked"
    if quant != "none":
        from stagedspec.kernels.native import native_kernels

        if native_kernels() is None:
            return torch.bfloat16, f"--quant {quant} on PyTorch's kernels computes in bf16"
    from stagedspec.hardware import auto_dtype

    chosen, why = auto_dtype(device)
    return DTYPES[chosen], why


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]


def parse_weights(name: str) -> tuple[torch.dtype, str]:
    """A weight format as the engine benchmarks name it: bf16, fp32, or int4/int8 (quantised, bf16 compute)."""
    if name in ("int4", "int8"):
        return torch.bfloat16, name
    try:
        return DTYPES[name], "none"
    except KeyError:
        raise StagedSpecError(f"unknown weight format {name!r}: use bf16, fp32, int8 or int4") from None


def check_device(device: str) -> str:
    """A valid device name, with CUDA set up for our passes.

    On CUDA, cuDNN's SDPA backend is turned off: it builds a new plan for
    every new (query, key) shape, and speculation makes many shapes (an H100
    profile of `staged` spent 65% of its CPU time there; without it `tree`
    went from 21 to 55 tok/s). The flash / memory-efficient / math backends
    that take over return non-contiguous outputs, which `Attention.forward`
    reshapes.
    """
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StagedSpecError(f"device {device!r} requested but no CUDA GPU is available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise StagedSpecError(f"unknown device {device!r}: use cpu or cuda")
    if device.startswith("cuda") and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device


# Speculation defaults on int4/int8 oracle weights (see `SpeculationConfig.tuned`).
QUANTISED_DEFAULTS = {"tree_budget": 2, "tree_depth": 2, "chain_length": 2, "lookup_chain_length": 2,
                      "stage_chain_length": 1}
# On a GPU with CUDA graphs a 16-row oracle pass costs 1.2x a 1-row one and 64 rows 1.3x (H100, docs/gpu.md),
# while each draft pass costs about as much host work as an oracle pass: so wider trees at the same depth
# (more nodes per draft pass) and longer lookup chains (free to propose).
CUDA_DEFAULTS = {"tree_budget": 16, "branching": 4, "lookup_chain_length": 8}
# bf16 on a CPU with native bf16 (AVX-512 BF16 or AMX): a verification row costs next to nothing (AMX, 2
# threads: 12 rows 1.1x one), so `staged` merges a longer prompt-lookup chain into the oracle's tree
# (AMX Xeon, 2026-11-23, docs/benchmarks.md: 1.75x -> 1.78-1.87x bf16 `ar` greedy in four runs, T=1 1.44-1.51x).  Where rows are dear
# (AVX2 CPUs: a 16-row bf16 pass 6.3x one row), the chain stays `lookup_chain_length` long.
NATIVE_BF16_DEFAULTS = {"oracle_lookup_length": 8}
# Methods whose sizes can be chosen each step by this machine's measured costs (`SpeculationConfig.sizing`).
# `chain` stays the textbook k-token baseline; `auto` always chooses.
MEASURED_METHODS = ("tree", "lookup", "staged")
SIZINGS = ("fixed", "measured")
# The fields that size each method: setting any of them on the command line asks for fixed sizes.
SIZE_FIELDS = {
    "tree": ("tree_budget", "tree_depth", "branching", "adaptive_budget"),
    "lookup": ("lookup_chain_length",),
    "staged": ("stage_chain_length", "stage_branching", "lookup_chain_length", "oracle_lookup_length",
               "oracle_lookup"),
}


@dataclass
class SpeculationConfig:
    """How drafts are proposed.

    Defaults were tuned on the reference 2-core CPU with the default models
    (docs/benchmarks.md, the AVX-512 BF16 EPYC of 2026-11-22): there a bf16 pass over 4 tokens costs what one
    token costs, 8 cost 1.2x and 16 cost 1.5x (`stagedspec bench-engine
    --tree-cost`), so small trees of likely tokens beat wide ones.

    - chain / tree: one draft model proposes for the oracle;
    - lookup: model-free drafts (prompt lookup and/or an n-gram) for the oracle;
    - auto: each step, whichever of ar / lookup / tree / staged (and of
      their sizes) this machine's measured costs and the acceptance so far
      say is fastest (`stagedspec.auto`); the other fields do not apply;
    - staged: oracle <- draft model(s) <- lookup; each model stage decodes
      `stage_chain_length` tokens per proposal speculatively against the stage below;
      with `oracle_lookup` the prompt-lookup chain is also merged into the
      tree the oracle verifies (it catches the copies a small draft misses).
    """

    method: str = "auto"
    tree_budget: int = 8
    tree_depth: int = 4
    branching: int = 2
    chain_length: int = 4
    ngram: str | None = None  # n-gram spec for lookup/staged: "default" or a file
    context: bool = True  # prompt lookup at the bottom of lookup/staged
    lookup_chain_length: int = 4  # tokens per lookup chain
    stage_chain_length: int = 3  # tokens each model stage decodes per proposal
    stage_branching: int = 1  # spine token + (b - 1) alternatives per position
    oracle_lookup: bool = True  # staged: prompt-lookup chains also go straight to the oracle's tree
    oracle_lookup_length: int | None = None  # staged: tokens of that chain (None: lookup_chain_length)
    adaptive_budget: bool = False  # tree: verify only the nodes that pay for themselves (tree_budget = the most)
    # tree: "best-first" on the host, "levels" on the device with one copy back (`stagedspec.tree_levels`),
    # "auto": levels where a copy back waits for the device (CUDA), best-first on a CPU
    tree_growth: str = "auto"
    # tree / lookup / staged: "fixed" runs the sizes above every step; "measured" lets `auto`'s policy pick,
    # each step, `ar` or one of this method's sizes by this machine's measured costs and the acceptance so
    # far (`Pipeline.sized_policy`), so the method is never knowingly slower than plain decoding.  The
    # CLI, the server and the bench run "measured" unless a size is given; the library keeps "fixed".
    sizing: str = "fixed"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise StagedSpecError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.sizing not in SIZINGS:
            raise StagedSpecError(f"unknown --sizing {self.sizing!r}: use one of {', '.join(SIZINGS)}")
        for label, value in (("--tree-budget", self.tree_budget), ("--tree-depth", self.tree_depth),
                             ("--branching", self.branching), ("--chain-length", self.chain_length),
                             ("--lookup-chain-length", self.lookup_chain_length),
                             ("--stage-chain-length", self.stage_chain_length),
                             ("--stage-branching", self.stage_branching),
                             ("--oracle-lookup-length",
                              1 if self.oracle_lookup_length is None else self.oracle_lookup_length)):
            if value < 1:
                raise StagedSpecError(f"{label} must be >= 1, got {value}")
        from stagedspec.drafters.model import GROWTHS

        if self.tree_growth not in GROWTHS:
            raise StagedSpecError(f"unknown --tree-growth {self.tree_growth!r}: use one of {', '.join(GROWTHS)}")

    @classmethod
    def tuned(cls, method: str, quant: str = "none", device: str = "cpu", dtype: str | torch.dtype | None = None,
              **overrides: Any) -> "SpeculationConfig":
        """The defaults for `method` on `quant` oracle weights, `device` and `dtype` (a --dtype value or a
        torch dtype; None: not known), with `overrides` (None = keep them).

        On a CPU with native bf16, bf16 verification rows are nearly free, so
        `staged` merges a longer prompt-lookup chain (`NATIVE_BF16_DEFAULTS`)
        unless `lookup_chain_length` is given.

        On CUDA (`CUDA_DEFAULTS`), verification rows are nearly free and draft
        passes are not, so trees are wider at the same depth and lookup chains
        longer.

        Quantised layers make extra rows dear: PyTorch's int4 CPU kernel runs
        rows in blocks of four, so a pass over 5-8 tokens costs about twice one
        over 1-4 (`bench-engine --tree-cost --dtypes int4`: 4 tokens 1.13x,
        8 tokens 1.72x), while the oracle pass itself got 2x cheaper than the
        draft's.  On int4/int8 the proposals therefore stay within four rows.
        """
        values: dict[str, Any] = dict(QUANTISED_DEFAULTS) if quant != "none" else {}
        if str(device).startswith("cuda") and quant == "none":
            values.update(CUDA_DEFAULTS)
        if quant != "none" and method == "lookup":
            values["lookup_chain_length"] = 1
        if (method == "staged" and quant == "none" and overrides.get("lookup_chain_length") is None
                and _native_bf16_cpu(device, dtype)):
            values.update(NATIVE_BF16_DEFAULTS)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(method=method, **values)

    @property
    def measured(self) -> bool:
        """Whether each step's size is chosen by the measured costs (`sizing`): `auto`, or a method that
        can be sized so and is asked to be."""
        return self.method == "auto" or (self.sizing == "measured" and self.method in MEASURED_METHODS)

    @property
    def merged_lookup_length(self) -> int:
        """staged: tokens of the prompt-lookup chain merged into the oracle's tree."""
        return self.oracle_lookup_length or self.lookup_chain_length

    @property
    def max_tree_budget(self) -> int:
        """Most tree nodes the oracle may be asked to verify in one step."""
        if self.measured:  # the biggest arm the policy may run on any device
            from stagedspec.auto import arms_for

            return max(arm.max_tree_budget for arm in arms_for(True, True, "cuda", sized_method(self.method)))
        lookup = self.merged_lookup_length if self.oracle_lookup else 0
        staged = self.stage_chain_length * self.stage_branching + lookup
        return max(self.tree_budget, self.chain_length, staged, self.lookup_chain_length * 3)


def sized_method(method: str) -> str | None:
    """The arm kind a measured method's policy is restricted to (None: `auto`, every kind)."""
    return None if method == "auto" else method


def choose_sizing(method: str, sizing: str | None, given: Mapping[str, Any]) -> str:
    """The sizing a command line asks for: `sizing` if given, else "fixed" when one of `method`'s size fields
    (`SIZE_FIELDS`; for `auto`, which a server request may switch to any method, every method's) is in
    `given` (flag values, None = not given), else "measured" (it matters for `MEASURED_METHODS` only).
    Naming a size together with `--sizing measured` is an error: the policy would ignore it."""
    # `auto` may be asked for any method later (a server request): every size then counts
    fields = SIZE_FIELDS.get(method, ()) if method != "auto" else dict.fromkeys(sum(SIZE_FIELDS.values(), ()))
    named = [f for f in fields if given.get(f) is not None]
    if sizing == "measured" and named:
        flags = ", ".join("--" + f.replace("_", "-") for f in named)
        raise StagedSpecError(f"--sizing measured picks {method}'s sizes each step; drop {flags} or use "
                              f"--sizing fixed")
    if sizing is not None:
        return sizing
    return "fixed" if named else "measured"


def _native_bf16_cpu(device: str, dtype: str | torch.dtype | None) -> bool:
    """Whether passes run in bf16 on a CPU whose bf16 matmuls are native (`hardware.cpu_has_native_bf16`)."""
    if dtype is None or not str(device).startswith("cpu"):
        return False
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, "cpu")[0]
    from stagedspec.hardware import cpu_has_native_bf16

    return dtype == torch.bfloat16 and cpu_has_native_bf16()


def parse_stages(specs: Sequence[str]) -> tuple[str, list[str], str | None, bool]:
    """`--stages ORACLE,DRAFT...,BOTTOM` -> (oracle, drafts, ngram spec or None, use prompt lookup).

    BOTTOM is `ngram`, `ngram:FILE`, `context`, or a `+`-joined mix such as
    `context+ngram`; it may be omitted (then `context+ngram`).
    """
    specs = [s.strip() for s in specs if s.strip()]
    if len(specs) < 2:
        raise StagedSpecError("--stages needs at least an oracle and one more stage, e.g. default,DRAFT,ngram")

    def is_bottom(spec: str) -> bool:
        return all(part == "context" or part == "ngram" or part.startswith("ngram:") for part in spec.split("+"))

    bottom = specs[-1] if is_bottom(specs[-1]) else "context+ngram"
    middle = specs[1:-1] if is_bottom(specs[-1]) else specs[1:]
    for spec in middle:
        if is_bottom(spec):
            raise StagedSpecError(f"stage {spec!r} is model-free and can only be the last stage")
    ngram, context = None, False
    for part in bottom.split("+"):
        if part == "context":
            context = True
        else:
            ngram = part.split(":", 1)[1] if ":" in part else "default"
    return specs[0], middle, ngram, context


def load_draft_model(spec: str, oracle: Transformer, oracle_tokenizer, dtype: torch.dtype, device: str,  # noqa: ANN001
                     weights: str = "auto") -> Transformer:
    """Resolve a --draft SPEC: `layers:N`, a distilled draft folder, an HF folder or a .gguf.

    `weights` (--draft-weights, or a `SPEC@FORMAT` suffix) picks the draft's weight format: "native" (the
    pipeline's dtype), "int8", or "auto": int8 for a quantised oracle, and on a bf16 CPU oracle whichever this
    machine runs faster, measured once and cached (`stagedspec.draft_weights`).  The output never depends on it."""
    from stagedspec.draft_weights import choose_draft_weights, split_weights_suffix

    spec, own = split_weights_suffix(spec)
    weights = own or weights
    return choose_draft_weights(lambda: _load_draft(spec, oracle, oracle_tokenizer, dtype, device), oracle, weights,
                                load_mixed=_mixed_loader(spec, oracle, oracle_tokenizer, dtype, device))


def _mixed_loader(spec: str, oracle: Transformer, oracle_tokenizer, dtype: torch.dtype,  # noqa: ANN001
                  device: str) -> Callable[[], Transformer] | None:
    """A loader of the draft `spec` in its quantised GGUF's own formats (`--quant mixed`), or None where its
    source is not one (a distilled draft, `layers:N`, an HF folder, a float GGUF)."""
    from stagedspec.models.quant import resolve_quant

    if draft_format(spec).name != "checkpoint":
        return None
    try:
        if resolve_quant("auto", spec, device) != "mixed":
            return None
    except StagedSpecError:
        return None  # a bad path: `_load_draft` names it
    return lambda: _load_draft(spec, oracle, oracle_tokenizer, dtype, device, quant="mixed")


def _load_draft(spec: str, oracle: Transformer, oracle_tokenizer, dtype: torch.dtype, device: str,  # noqa: ANN001
                quant: str = "none") -> Transformer:
    """The draft `spec`, its passes run with its oracle's options: a pipeline's models share one `PassOptions`."""
    draft = load_draft_spec(spec, DraftSource(oracle, oracle_tokenizer, dtype, device, quant))
    draft.pass_runtime = PassRuntime(oracle.pass_runtime.options)
    return draft


def draft_specs(method: str, draft: str | Sequence[str] | None, oracle: str, tokenizer,
                hidden_size: int | None = None) -> list[str]:
    """The draft specs `method` runs with, from `draft` (one spec, or for `staged` a list from the stage below
    the oracle downwards): none for `ar` and `lookup`; for `auto` with none given, the draft shipped for the
    oracle (`--draft default`, found by `tokenizer`) or the oracle's named pair (`models.named`), if any."""
    drafts = [draft] if isinstance(draft, str) else list(draft or [])
    if method in ("chain", "tree") and len(drafts) != 1:
        raise StagedSpecError(f"method {method!r} needs exactly one draft: pass --draft SPEC")
    if method == "staged" and not drafts:
        raise StagedSpecError("method 'staged' needs at least one draft model stage (--draft or --stages); "
                              "for model-free drafting use --method lookup")
    if method in ("ar", "lookup"):
        return []
    if method == "auto" and not drafts:
        from stagedspec.models.draft import bundled_draft_for
        from stagedspec.models.named import paired_draft

        pair = paired_draft(oracle) if isinstance(oracle, str) else None
        bundled = bundled_draft_for(tokenizer_fingerprint(tokenizer), hidden_size) is not None
        drafts = ["default"] if bundled else [pair] if pair else []
    return drafts


def tree_drafter(model: Transformer, **kwargs: Any) -> Drafter:
    """The tree/chain drafter for `model`: a `FeatureDrafter` for a feature draft, else a `ModelDrafter`."""
    from stagedspec.models.feature_draft import is_feature_draft

    if is_feature_draft(model):
        from stagedspec.drafters.feature import FeatureDrafter

        return FeatureDrafter(model, **kwargs)
    from stagedspec.drafters.model import ModelDrafter

    return ModelDrafter(model, **kwargs)


class Pipeline:
    """An oracle, its tokenizer and (optionally) draft models, ready to generate.

    Its parts: the loaded models (`model`, `tokenizer`, `draft_models`, `ngram`), what it learns about
    this machine (`learned`, a `LearnedState`, which the server shares between its requests' pipelines),
    and per request the drafter its `speculation` asks for (`drafter`).  `Pipeline.load` loads the
    models from specs (paths, names); the constructor takes models already in memory.

    `bit_exact = True` makes greedy output bit-identical, for every method, to
    plain decoding with the same flag, in bf16 and on quantised weights too
    (see `ModelOracle`), at a cost in speed.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer,  # noqa: ANN001 - stagedspec Tokenizer
        draft_models: Sequence[Transformer] = (),
        speculation: SpeculationConfig | None = None,
        ngram=None,  # noqa: ANN001 - NgramModel
        *,
        learned: LearnedState | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        dtype_reason: str = "as asked",
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        """A pipeline over models already in memory (benchmarks and tests run many methods on one load).

        `learned`: the pass costs and policies to use and add to (the server gives every request's pipeline
        its one; default: a new one).  `device` and `dtype` default to those of the oracle's weights;
        `dtype_reason` says why that dtype (`--dtype auto` asks the hardware).  `grammar_compiler`: another
        pipeline's over the same tokenizer (`Pipeline.grammar_compiler`), so its vocabulary is not built
        again."""
        self.speculation = speculation or SpeculationConfig()
        self.model, self.tokenizer = model, tokenizer
        self.device = device if device is not None else str(model.embed.weight.device)
        self.dtype = dtype if dtype is not None else model.embed.weight.dtype
        self.dtype_reason = dtype_reason
        self.draft_models = list(draft_models)
        self.draft_model = self.draft_models[0] if self.draft_models else None
        self.ngram = ngram
        self.learned = learned if learned is not None else LearnedState()
        # every method's greedy output bit-identical to `ar`'s (`runner.ModelOracle`); on by default for a dense
        # bf16/fp16 oracle on CUDA, where it costs little (`stagedspec.exactness.default_bit_exact`)
        self.bit_exact = default_bit_exact(model)
        self._warned_amx = False  # `generate` said that bit_exact cannot hold on this AMX CPU (once per pipeline)
        # "auto": follow the machine's load where results allow (`thread_governor`); N: fixed
        self.threads: str | int = "auto"
        self._governor: ThreadGovernor | None = None
        self._grammar_compiler = grammar_compiler  # the tokenizer as the grammar library sees it

    @property
    def weights_description(self) -> str:
        """The oracle's weight formats and the kernel running them (`--json` stats, `tune`)."""
        from stagedspec.models.quant import describe_weights

        return describe_weights(self.model)

    @classmethod
    def load(
        cls,
        oracle: str = "default",
        draft: str | Sequence[str] | None = None,
        *,
        speculation: SpeculationConfig | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        quant: str = "none",
        draft_weights: str = "auto",
        pass_options: PassOptions | None = None,
    ) -> Pipeline:
        """A pipeline over the models named by specs: loads the oracle, then the drafts `speculation.method`
        runs with (`draft_specs`), then the n-gram, and checks they make that method.

        `draft` is one spec, or for `staged` a list from the stage below the oracle downwards.
        `quant` ("int4", "int8") runs the oracle's layers on quantised weights (CPU, bf16; see
        `stagedspec.models.quant`); speculation stays exact with respect to that quantised oracle.
        Drafts then run on int8 weights; on a bf16 CPU oracle `draft_weights="auto"` runs them on int8
        where that is measured faster here (`stagedspec.draft_weights`; "native" or "int8" choose).
        `dtype="auto"` picks bf16 where the hardware computes it natively and fp32 elsewhere
        (`dtype_reason` says which and why); the output is the oracle's in the chosen dtype.
        `method="auto"` with no draft uses the draft shipped for the oracle, when there is one
        (SmolLM2-135M-Instruct, Gemma-3-270m).  `pass_options`: how the models' passes run (the drafts run
        theirs as the oracle does; None: the environment's defaults, `stagedspec.pass_options`)."""
        from stagedspec.models.loading import load_model

        s = speculation or SpeculationConfig()
        device = check_device(device)
        from stagedspec.models.quant import resolve_quant

        quant = resolve_quant(quant, oracle, device)  # "auto", as the CLI takes it, for library callers too
        torch_dtype, dtype_reason = resolve_dtype(dtype, device, quant)
        model, tokenizer = load_model(oracle, dtype=torch_dtype, device=device, quant=quant, pass_options=pass_options)
        draft_models = [load_draft_model(d, model, tokenizer, torch_dtype, device, draft_weights)
                        for d in draft_specs(s.method, draft, oracle, tokenizer, model.config.hidden_size)]
        from stagedspec.models.feature_draft import is_feature_draft

        if any(is_feature_draft(m) for m in draft_models[1:]):
            raise StagedSpecError("a feature draft can only be the first --draft (the stage right below the oracle): "
                                  "only the oracle computes the hidden states it reads")
        ngram = None
        if s.method in ("lookup", "staged", "auto") and s.ngram is not None:
            from stagedspec.drafters.ngram_files import load_ngram

            ngram = load_ngram(s.ngram, tokenizer)
        if s.method in ("lookup", "staged") and ngram is None and not s.context:
            raise StagedSpecError(f"method {s.method!r} needs a bottom stage: an n-gram (--ngram) or prompt lookup")
        return cls(model, tokenizer, draft_models, s, ngram, device=device, dtype=torch_dtype,
                   dtype_reason=dtype_reason)

    def pass_seconds(self, max_rows: int) -> dict[int, float]:
        """Seconds of one oracle pass per number of rows (`LearnedState.pass_seconds`: measured once, about a
        second).  The adaptive tree budget prices trees with it."""
        return self.learned.pass_seconds(self.model, max_rows)

    def cost_profile(self, remeasure: bool = False, quiet: bool = False):  # noqa: ANN201 - costs.CostProfile
        """This machine's pass costs for these models (cached on disk; measured at first use)."""
        from stagedspec.profiling import load_or_measure

        return load_or_measure(self.model, self.draft_models, self.device, remeasure=remeasure, quiet=quiet)

    def auto_policy(self):  # noqa: ANN201 - auto.AutoPolicy
        """The `--method auto` policy of this pipeline, created at first use and kept across requests."""
        return self.sized_policy("auto")

    def sized_policy(self, method: str):  # noqa: ANN201 - auto.AutoPolicy
        """The policy that sizes a measured `method` (`SpeculationConfig.sizing`): `auto`'s, restricted to
        `ar` and that method's arms, with its own learned state; created at first use (`LearnedState.policy`),
        kept across requests."""
        from stagedspec.auto import arms_for

        arms = arms_for(self.ngram is not None or self.speculation.context, bool(self.draft_models), self.device,
                        sized_method(method), has_context=self.speculation.context)
        return self.learned.policy(method, arms, self.cost_profile)

    def _stage_chain(self, below: Drafter, max_len: int, chain_length: int, processor: LogitsProcessor | None,
                     passes: RequestPasses | None) -> Drafter:
        """The draft models as stages, top one first, each decoding speculatively against the one below
        (each stage's rows biased and masked by `processor`, as the oracle's are; its passes run for
        `passes`' request)."""
        from stagedspec.models.feature_draft import is_feature_draft
        from stagedspec.stages import StageDrafter

        s = self.speculation
        n = len(self.draft_models)
        for i in reversed(range(n)):
            name = "draft" if n == 1 else f"draft{i + 1}"
            if is_feature_draft(self.draft_models[i]):
                if i != 0:  # only the oracle computes the features it reads
                    raise StagedSpecError("a feature draft can only be the top draft stage, right below the oracle")
                from stagedspec.drafters.feature import FeatureStage

                stage: Oracle = FeatureStage(self.draft_models[i], draft_cache_len(max_len, s.max_tree_budget),
                                             passes)
            else:
                # A draft stage's rounding need not match anything: it keeps the cheaper, filled-width attention.
                stage = ModelOracle(self.draft_models[i], draft_cache_len(max_len, s.max_tree_budget),
                                    fixed_width=False, passes=passes)
            if processor is not None:
                from stagedspec.constraints.processor import ConstrainedOracle

                stage = ConstrainedOracle(stage, processor)
            below = StageDrafter(stage, below, name=name, chain_length=chain_length, branching=s.stage_branching)
        return below

    def _auto_drafter(self, max_len: int, reproducible: bool, processor: LogitsProcessor | None,
                      passes: RequestPasses | None) -> Drafter:
        """Every arm's drafter for `--method auto` or a measured method, sized per step by the policy (see
        `stagedspec.auto`).

        `reproducible` (a seeded sampled request): a fresh policy that ignores measured times, so the
        seed reproduces the output; otherwise the pipeline's policy, which learns across requests."""
        from functools import partial

        from stagedspec.auto import (STAGE_SIZES, AutoDrafter, AutoPolicy, lookup_horizon, staged_lookup_length,
                                     tree_depth_for)
        from stagedspec.drafters.lookup import LookupDrafter

        s = self.speculation
        policy = self.sized_policy(s.method)
        if reproducible:
            kept = policy
            policy = AutoPolicy(policy.arms, policy.profile, learn_times=False)
            policy.step_observer = kept.step_observer
        has_lookup = self.ngram is not None or s.context
        lookup = (LookupDrafter(self.ngram, s.context, chain_length=lookup_horizon(policy.arms), processor=processor)
                  if has_lookup else None)
        arms: dict = {}
        for arm in policy.arms:
            if arm.kind == "ar":
                arms[arm] = (NoDrafter(), [])
            elif arm.kind == "lookup":
                arms[arm] = (lookup, [partial(lookup.resize, chain_length=arm.size)])
        copy_arms = [a for a in policy.arms if a.kind == "copy"]
        if copy_arms:  # the prompt-lookup chain alone (`stagedspec.auto.arms.COPY_SIZES`)
            copy = LookupDrafter(None, True, chain_length=max(a.size for a in copy_arms), processor=processor)
            for arm in copy_arms:
                arms[arm] = (copy, [partial(copy.resize, chain_length=arm.size)])
        tree_arms = [a for a in policy.arms if a.kind == "tree"]
        if tree_arms:
            biggest = max(a.size for a in tree_arms)
            tree = tree_drafter(self.draft_models[0], method="tree", tree_budget=biggest,
                                max_depth=tree_depth_for(biggest), branching=2, max_len=max_len,
                                growth=s.tree_growth, processor=processor, passes=passes)
            for arm in tree_arms:
                arms[arm] = (tree, [partial(tree.resize, tree_budget=arm.size, max_depth=tree_depth_for(arm.size))])
        stage_arms = [a for a in policy.arms if a.kind == "staged"]
        if stage_arms:
            below = (LookupDrafter(self.ngram, s.context, chain_length=s.lookup_chain_length, processor=processor)
                     if has_lookup else NoDrafter())
            top = self._stage_chain(below, max_len, max(STAGE_SIZES), processor, passes)
            staged: Drafter = top
            merged_lookup = None
            if s.context:
                from stagedspec.drafters.merged import MergedDrafter

                merged_lookup = LookupDrafter(None, True, processor=processor,
                                              chain_length=max(staged_lookup_length(a) for a in stage_arms))
                staged = MergedDrafter(top, merged_lookup)
            for arm in stage_arms:
                resizes = [partial(top.resize, chain_length=arm.size)]
                if merged_lookup is not None:
                    resizes.append(partial(merged_lookup.resize, chain_length=staged_lookup_length(arm)))
                arms[arm] = (staged, resizes)
        drafter = AutoDrafter(policy, {a: arms[a] for a in policy.arms}, lookup=lookup)
        if s.method != "auto":
            drafter.name = f"{s.method} (measured)"  # its row in the stats' stages
        return drafter

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(prompt) if chat else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise StagedSpecError("the prompt is empty after tokenisation")
        return ids

    def drafter(self, max_len: int, reproducible: bool = False, processor: LogitsProcessor | None = None,
                passes: RequestPasses | None = None) -> Drafter:
        """The drafter of one request; `reproducible` asks `auto` for seed-reproducible choices; `processor`
        (the request's logit bias and grammar, `logits_processor`) shapes every draft row as it shapes the
        oracle's; `passes`: the request its draft models run for (router and runner leases, `RequestPasses`;
        None: a drafter of its own, whose runners go back when it is collected)."""
        s = self.speculation
        if s.method == "ar":
            return NoDrafter()
        if s.measured:
            return self._auto_drafter(max_len, reproducible, processor, passes)
        if s.method in ("chain", "tree"):
            adaptive = None
            if s.method == "tree" and s.adaptive_budget:
                from stagedspec.budget import AdaptiveBudget

                adaptive = AdaptiveBudget(self.pass_seconds(s.tree_budget + 1))
            return tree_drafter(self.draft_models[0], method=s.method, tree_budget=s.tree_budget,
                                max_depth=s.tree_depth, branching=s.branching, chain_length=s.chain_length, max_len=max_len, adaptive=adaptive,
                                growth=s.tree_growth, processor=processor, passes=passes)
        from stagedspec.drafters.lookup import LookupDrafter

        below: Drafter = LookupDrafter(self.ngram, s.context, chain_length=s.lookup_chain_length, processor=processor)
        if s.method == "lookup":
            return below
        below = self._stage_chain(below, max_len, s.stage_chain_length, processor, passes)
        if s.oracle_lookup and s.context:
            from stagedspec.drafters.merged import MergedDrafter

            below = MergedDrafter(below, LookupDrafter(None, True, chain_length=s.merged_lookup_length,
                                                       processor=processor))
        return below

    def grammar_compiler(self) -> GrammarCompiler:
        """This pipeline's tokenizer as the grammar library sees it: built at the first grammar (about a
        second on a 49k vocabulary), then kept for every later request."""
        if self._grammar_compiler is None:
            from stagedspec.constraints.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        return self._grammar_compiler

    def logits_processor(self, controls: LogitControls | None) -> LogitsProcessor | None:
        """A request's processor for `controls` (bias, grammar), or None when it asks for neither;
        a bad bias or grammar raises a one-line `StagedSpecError`."""
        if controls is None or not controls.active:
            return None
        from stagedspec.constraints.processor import build_processor

        return build_processor(controls, self.model.config.vocab_size, self.grammar_compiler)

    def thread_governor(self) -> ThreadGovernor | None:
        """The thread count for a run (`stagedspec.threads.governor_for`): `threads` = N fixes it; "auto"
        follows the machine's load where the oracle's results cannot depend on it (kept across runs)."""
        from stagedspec.threads import governor_for

        if self.threads != "auto" or self._governor is None:
            self._governor = governor_for(self.model, self.threads)
        return self._governor

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        seed: int | None = None,
        stop_strings: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        controls: LogitControls | None = None,
    ) -> GenerationResult:
        """Generate from text (or token ids); `on_text` receives text pieces as they are decided.

        `stop_strings`: the text is cut where the earliest of them begins, whatever their order
        (`stagedspec.stops`, the rule the CLI and the server share); an empty one is a `StagedSpecError`.

        `controls`: a logit bias and/or a grammar (`stagedspec.constraints`); the output is then exactly
        constrained `ar`'s (greedy) or distributed as it (sampling), whatever the method."""
        from stagedspec.stops import StopTextStream

        if max_new_tokens < 1:
            raise StagedSpecError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        text = StopTextStream(self.tokenizer, stop_strings)  # the one stop-string rule (`stagedspec.stops`)
        ids = list(prompt) if not isinstance(prompt, str) else self.encode(prompt, chat)
        max_len = context_budget(self.model, len(ids), max_new_tokens, self.speculation.max_tree_budget)
        if self.bit_exact and str(self.device) == "cpu" and not self._warned_amx:
            self._warned_amx = True
            _warn_amx_bit_exact()
        processor = self.logits_processor(controls)
        governor = self.thread_governor()
        text_parts: list[str] = []

        def emit(piece: str) -> None:
            if piece:
                text_parts.append(piece)
                if on_text is not None:
                    on_text(piece)

        def on_tokens(step: list[int]) -> bool:
            if governor is not None:
                governor.tick()
            emit(text.push(step))
            return text.stopped  # True ends the generation

        passes = RequestPasses()  # the runners this request's oracle and drafters hold, given back when it ends
        try:
            oracle: Oracle = ModelOracle(self.model, max_len, bit_exact=self.bit_exact, passes=passes)
            if processor is not None:
                from stagedspec.constraints.processor import ConstrainedOracle

                oracle = ConstrainedOracle(oracle, processor, settles=True)
            drafter = self.drafter(max_len, reproducible=seed is not None and not sampling.greedy,
                                   processor=processor, passes=passes)
            result = speculative_generate(
                oracle, drafter, ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                stop_token_ids=self.tokenizer.eos_token_ids, on_tokens=on_tokens,
            )
        finally:
            passes.release()
        emit(text.finish())  # the decoder's final flush, checked against the stop strings too
        if text.stopped:
            result.stats.finish_reason = "stop"  # also when only the final flush held the stop string
        result.stats.stages = stage_report(result.stats, drafter)
        owner = self.learned.method_of(drafter.policy) if isinstance(drafter, AutoDrafter) else None
        if owner is not None:
            self.learned.save(owner)  # the kept policy learned something (a seeded run's own is dropped)
        result.stats.dtype = dtype_name(self.dtype)
        result.stats.weights = self.weights_description
        result.stats.auto_choices = dict(drafter.request_choices)
        result.text = "".join(text_parts)
        return result


def _warn_amx_bit_exact() -> None:
    """`bit_exact` cannot hold on AMX kernels: say so (the CLI caps the ISA at start-up instead)."""
    from stagedspec.hardware import AMX_ISA_CAP, amx_rounds_by_rows

    if amx_rounds_by_rows():
        print(f"stagedspec: warning: bit_exact on an AMX CPU is not bit-identical unless the process starts "
              f"with ONEDNN_MAX_CPU_ISA={AMX_ISA_CAP} (the CLI's --bit-exact sets it)", file=sys.stderr)


def stage_report(stats, drafter: Drafter) -> list[dict]:  # noqa: ANN001 - GenerationStats
    """Forward passes and seconds per stage, oracle first (the oracle gets the time not spent drafting)."""
    telemetry = drafter.stage_telemetry()
    if telemetry is None:  # one stage with no figures of its own: the loop timed its proposals
        rows = [{"stage": drafter.name, "forward_passes": drafter.forward_passes, "seconds": stats.draft_seconds}]
    else:  # one row per stage (none for `NoDrafter`)
        rows = [{"stage": t.name, "forward_passes": t.forward_passes, "seconds": t.seconds,
                 # tokens this stage emitted per inner step (accepted from the stage below + its own)
                 "mean_accepted_length": (sum(t.accepted_lengths) + len(t.accepted_lengths))
                 / len(t.accepted_lengths) if t.accepted_lengths else None}
                for t in telemetry]
    drafting = sum(r["seconds"] for r in rows)
    oracle = {"stage": "oracle", "forward_passes": stats.oracle_forward_passes,
              "seconds": max(0.0, stats.seconds - drafting), "mean_accepted_length": stats.mean_accepted_length}
    return [oracle, *rows]
