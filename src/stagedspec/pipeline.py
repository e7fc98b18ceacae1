"""From user-level specs (paths, method names, text) to a configured decoding loop.

The CLI, the benchmark and the server all go through `Pipeline`, so a method
means the same thing everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from stagedspec.auto import AutoPolicy, arms_for
from stagedspec.auto.drafter import AutoDrafter
from stagedspec.constraints.grammar import GrammarCompiler
from stagedspec.drafting import DraftParts, fixed_drafter, measured_drafter
from stagedspec.exactness import default_bit_exact, warn_amx_bit_exact
from stagedspec.dtypes import DTYPES, dtype_name, parse_dtype, parse_weights, resolve_dtype  # noqa: F401 - re-exported
from stagedspec.errors import StagedSpecError
from stagedspec.generation import Drafter, GenerationResult
from stagedspec.learned_state import LearnedState
from stagedspec.model_set import (  # noqa: F401 - re-exported: the library's names since the start
    ModelSet,
    check_device,
    draft_specs,
    load_draft_model,
    parse_stages,
)
from stagedspec.models.quant import describe_weights
from stagedspec.models.transformer import Transformer
from stagedspec.pass_options import PassOptions
from stagedspec.profiling import load_or_measure
from stagedspec.runner import RequestPasses
from stagedspec.request_plan import plan_constraints, plan_request
from stagedspec.request import context_budget, stage_report, start_request  # noqa: F401 - stage_report re-exported
from stagedspec.sampling import SamplingParams
from stagedspec.speculation import (  # noqa: F401 - re-exported: the library's names since the start
    CUDA_DEFAULTS,
    NATIVE_BF16_DEFAULTS,
    QUANTISED_DEFAULTS,
    SIZINGS,
    SpeculationConfig,
    choose_sizing,
    sized_method,
)
from stagedspec.threads import ThreadGovernor, governor_for

if TYPE_CHECKING:
    from stagedspec.constraints.processor import LogitControls, LogitsProcessor

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
        quant: str = "auto",
        draft_weights: str = "auto",
        draft_vocab: str = "auto",
        pass_options: PassOptions | None = None,
    ) -> Pipeline:
        """A pipeline over the models named by specs: loads the oracle, then the drafts `speculation.method`
        runs with (`draft_specs`), then the n-gram, and checks they make that method.

        `draft` is one spec, or for `staged` a list from the stage below the oracle downwards.
        `quant` ("int4", "int8", "mixed") runs the oracle's layers on quantised weights (CPU; see
        `stagedspec.models.quant`); speculation stays exact with respect to that quantised oracle.  "auto"
        (the default, as on the command line) runs a quantised GGUF on its own codes on a CPU, the way
        llama.cpp does, and everything else as stored; "none" dequantises (SmolLM2's Q4_1 decoded about 5x
        slower that way on a Zen 5 EPYC, 2026-11-29: 55 against 280 tokens/s).
        Drafts then run on int8 weights; on a bf16 CPU oracle `draft_weights="auto"` runs them on int8
        where that is measured faster here (`stagedspec.draft_weights`; "native" or "int8" choose).
        `draft_vocab` ("auto", "full", a file of token ids) cuts a GGUF or HF draft's head to part of the
        vocabulary (`models.head_subset`).
        `dtype="auto"` picks bf16 where the hardware computes it natively and fp32 elsewhere
        (`dtype_reason` says which and why); the output is the oracle's in the chosen dtype.
        `method="auto"` with no draft uses the draft shipped for the oracle, when there is one
        (SmolLM2-135M-Instruct, Gemma-3-270m).  `pass_options`: how the models' passes run (the drafts run
        theirs as the oracle does; None: the environment's defaults, `stagedspec.pass_options`)."""
        s = speculation or SpeculationConfig()
        models = ModelSet.load(oracle, draft, method=s.method, ngram=s.ngram, context=s.context, dtype=dtype,
                               device=device, quant=quant, draft_weights=draft_weights, draft_vocab=draft_vocab,
                               pass_options=pass_options)
        return cls.over(models, s)

    @classmethod
    def over(cls, models: ModelSet, speculation: SpeculationConfig, **kwargs: Any) -> Pipeline:
        """A pipeline over a loaded `ModelSet` (`kwargs`: the constructor's, such as `learned`)."""
        return cls(models.model, models.tokenizer, models.draft_models, speculation, models.ngram,
                   device=models.device, dtype=models.dtype, dtype_reason=models.dtype_reason, **kwargs)

    def pass_seconds(self, max_rows: int) -> dict[int, float]:
        """Seconds of one oracle pass per number of rows (`LearnedState.pass_seconds`: measured once, about a
        second).  The adaptive tree budget prices trees with it."""
        return self.learned.pass_seconds(self.model, max_rows)

    def cost_profile(self, remeasure: bool = False, quiet: bool = False):  # noqa: ANN201 - costs.CostProfile
        """This machine's pass costs for these models (cached on disk; measured at first use)."""
        return load_or_measure(self.model, self.draft_models, self.device, remeasure=remeasure, quiet=quiet)

    def auto_policy(self):  # noqa: ANN201 - auto.AutoPolicy
        """The `--method auto` policy of this pipeline, created at first use and kept across requests."""
        return self.sized_policy("auto")

    def sized_policy(self, method: str):  # noqa: ANN201 - auto.AutoPolicy
        """The policy that sizes a measured `method` (`SpeculationConfig.sizing`): `auto`'s, restricted to
        `ar` and that method's arms, with its own learned state; created at first use (`LearnedState.policy`),
        kept across requests."""
        arms = arms_for(self.ngram is not None or self.speculation.context, bool(self.draft_models), self.device,
                        sized_method(method), has_context=self.speculation.context)
        return self.learned.policy(method, arms, self.cost_profile)

    def _parts(self, max_len: int, processor: LogitsProcessor | None, passes: RequestPasses | None) -> DraftParts:
        return DraftParts(self.draft_models, self.ngram, self.speculation, max_len, processor, passes,
                          self.pass_seconds)

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
        parts = self._parts(max_len, processor, passes)
        if not self.speculation.measured:
            return fixed_drafter(parts)
        # `reproducible` (a seeded sampled request): a fresh policy that ignores measured times, so the seed
        # reproduces the output; otherwise the pipeline's policy, which learns across requests
        policy = self.sized_policy(self.speculation.method)
        if reproducible:
            kept = policy
            policy = AutoPolicy(policy.arms, policy.profile, learn_times=False)
            policy.step_observer = kept.step_observer
        return measured_drafter(parts, policy)

    def grammar_compiler(self) -> GrammarCompiler:
        """This pipeline's tokenizer as the grammar library sees it: built at the first grammar (about a
        second on a 49k vocabulary), then kept for every later request."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        return self._grammar_compiler

    def logits_processor(self, controls: LogitControls | None) -> LogitsProcessor | None:
        """A request's processor for `controls` (bias, grammar), or None when it asks for neither;
        a bad bias or grammar raises a one-line `StagedSpecError`."""
        return plan_constraints(controls, self.model.config.vocab_size, self.grammar_compiler)

    def thread_governor(self) -> ThreadGovernor | None:
        """The thread count for a run (`stagedspec.threads.governor_for`): `threads` = N fixes it; "auto"
        follows the machine's load where the oracle's results cannot depend on it (kept across runs)."""
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
        ids = list(prompt) if not isinstance(prompt, str) else self.encode(prompt, chat)
        plan = plan_request(ids, max_new_tokens=max_new_tokens, context=self.model.config.max_position,
                            speculation=self.speculation, temperature=sampling.temperature, top_k=sampling.top_k,
                            top_p=sampling.top_p, seed=seed, stop=stop_strings)
        max_len = context_budget(self.model, len(ids), plan.max_new_tokens, self.speculation.max_tree_budget)
        if self.bit_exact and str(self.device) == "cpu" and not self._warned_amx:
            self._warned_amx = True
            warn_amx_bit_exact()
        processor = self.logits_processor(controls)
        governor = self.thread_governor()
        text_parts: list[str] = []

        def emit(piece: str) -> None:
            if piece:
                text_parts.append(piece)
                if on_text is not None:
                    on_text(piece)

        passes = RequestPasses()  # the runners this request's oracle and drafters hold, given back when it ends
        try:
            request = start_request(self, plan, max_len, processor=processor, passes=passes)
            while (step := request.step()) is not None:
                if governor is not None:
                    governor.tick()
                emit(request.text.push(step))
                if request.text.stopped:
                    request.stats.finish_reason = "stop"
                    break
        finally:
            passes.release()
        emit(request.text.finish())  # the decoder's final flush, checked against the stop strings too
        if request.text.stopped:
            request.stats.finish_reason = "stop"  # also when only the final flush held the stop string
        drafter = request.drafter
        result = GenerationResult(request.token_ids, request.finish_stats())
        result.stats.stages = stage_report(result.stats, drafter)
        owner = self.learned.method_of(drafter.policy) if isinstance(drafter, AutoDrafter) else None
        if owner is not None:
            self.learned.save(owner)  # the kept policy learned something (a seeded run's own is dropped)
        result.stats.dtype = dtype_name(self.dtype)
        result.stats.weights = self.weights_description
        result.stats.auto_choices = dict(drafter.request_choices)
        result.text = "".join(text_parts)
        return result
