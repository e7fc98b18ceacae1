"""The models a server holds, the speculation each request may ask for, and what memory a request needs.

One `Engine` is loaded at start and shared read-only by every request: the
weights never change, and everything that does (KV caches, drafters'
caches, random generators) is made per request by `Engine.pipeline(...)` /
`Pipeline.drafter`, which is what keeps a request's output independent of
its neighbours.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from stagedspec.auto import StepCosts
from stagedspec.constraints import GrammarCompiler
from stagedspec.errors import StagedSpecError
from stagedspec.exactness import default_bit_exact
from stagedspec.request import TREE_SLACK, context_budget
from stagedspec.learned_state import LearnedState
from stagedspec.models.transformer import Transformer
from stagedspec.pass_options import PassOptions
from stagedspec.methods import METHOD_NAMES, METHODS
from stagedspec.model_set import ModelSet
from stagedspec.pipeline import Pipeline, SpeculationConfig
from stagedspec.server.schemas import SpeculationRequest, bad

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `1234`, `512M`, `1.5G`, `2GiB`, `800MB` (binary multiples, as memory is counted)."""
    m = _SIZE.match(text)
    if not m:
        raise StagedSpecError(f"bad size {text!r}: use e.g. 2G, 512M or a number of bytes")
    scale = 1024 ** "_kmgt".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def model_bytes(model: Transformer) -> int:
    return int(model.num_bytes())


def kv_bytes_per_token(model: Transformer) -> int:
    """Keys and values of one cached token, all layers (`KVCache` layout, model dtype)."""
    cfg = model.config
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * model.embed.weight.element_size()


@dataclass
class MemoryModel:
    """weights + KV per token x tokens + tree scratch: what `--max-memory` is checked against.

    KV is counted per request from the cache slots it will really allocate
    (`context_budget`, the same sizes a solo run uses), for the oracle and
    for every draft model stage (each keeps its own cache).  Scratch is one
    pass's activations for a full tree at full key width: the worker runs one
    pass at a time, so it is counted once, not per request.  Its `scratch_rows`
    rows (the server's full tree, its root and one spare) cost the same each,
    which is how `tree_scratch` prices a smaller tree: with batched passes each
    request is charged its own rows, and under memory pressure its tree
    shrinks level by level (`server.pressure`).
    """

    weights: int
    oracle_kv_per_token: int
    draft_kv_per_token: int
    scratch: int
    scratch_rows: int = 1

    @property
    def row_bytes(self) -> int:
        """One row of the pass's activations (attention scores, hidden and MLP states, logits)."""
        return self.scratch // max(1, self.scratch_rows)

    def tree_scratch(self, tree_budget: int) -> int:
        """The activations of a tree of `tree_budget` proposed nodes: its rows, the root and a spare."""
        return (tree_budget + 2) * self.row_bytes

    def request_kv(self, cache_slots: int, max_tree_budget: int, uses_drafts: bool) -> int:
        draft_slots = cache_slots + max_tree_budget + 1 if uses_drafts else 0
        return self.oracle_kv_per_token * cache_slots + self.draft_kv_per_token * draft_slots

    def describe(self, memory_budget: int, max_batch: int, full_slots: int, max_tree_budget: int) -> str:
        per_seq = self.request_kv(full_slots, max_tree_budget, self.draft_kv_per_token > 0)
        fits = max(0, (memory_budget - self.weights - self.scratch) // max(1, per_seq))
        return (f"memory model: weights {format_size(self.weights)} + KV "
                f"{format_size(self.oracle_kv_per_token + self.draft_kv_per_token)}/token x tokens + tree scratch "
                f"{format_size(self.scratch)}; one full-context sequence ({full_slots} slots) "
                f"{format_size(per_seq)}; budget {format_size(memory_budget)} holds {fits} full-context sequences "
                f"(--max-batch {max_batch})")


@dataclass
class Engine:
    """Loaded models + the server's default speculation; requests get their own pipelines from it."""

    model: Transformer
    tokenizer: Any  # stagedspec Tokenizer
    draft_models: list[Transformer] = field(default_factory=list)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    ngram: Any = None
    model_name: str = "stagedspec"
    draft_names: list[str] = field(default_factory=list)
    bit_exact: bool | None = None  # None: `stagedspec.exactness.default_bit_exact`, resolved at construction
    # What requests learn about this machine, shared by all of them: the oracle's pass costs for
    # --adaptive-budget (measured once, about a second) and, per measured method (`auto`, or a method whose
    # sizes are measured: `SpeculationConfig.sizing`), the policy that learns acceptance and step times.
    learned: LearnedState = field(default_factory=LearnedState)
    # Set by the scheduler: requests' passes are batched across requests (`server.batching`).
    batched_passes: bool = False
    # The tokenizer as the grammar library sees it: built at the first request with a grammar, then shared.
    _grammar_compiler: Any = None
    # `--threads`: "auto" follows the machine's load where results allow (`stagedspec.threads`), N fixes it.
    threads: str | int = "auto"
    # Other names a request's `model` may use for this server's model (`serves`): the spec it was started with
    # (`default`, `qwen2.5-coder-1.5b`, a path) and the model's name without the weight suffix.
    model_aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bit_exact is None:
            self.bit_exact = self.model is not None and default_bit_exact(self.model)

    @classmethod
    def load(cls, oracle: str, drafts: Sequence[str], speculation: SpeculationConfig, *, dtype: str = "bf16",
             device: str = "cpu", quant: str = "none", draft_weights: str = "auto", draft_vocab: str = "auto", bit_exact: bool | None = None,
             model_name: str | None = None, pass_options: PassOptions | None = None) -> "Engine":
        # Drafts are loaded even for a default of `ar` or `lookup`, so a request can still ask for them.
        method = speculation.method
        if drafts and not METHODS[method].uses_drafts:
            method = "tree" if len(drafts) == 1 else "staged"
        if draft_weights == "auto" and quant == "none":
            # The scheduler batches the drafts' passes across requests (ragged passes over many rows): those need
            # dense weights, and PyTorch's int8 CPU kernel is slower than bf16 past 8 rows (16 rows: 1.6x).
            draft_weights = "native"
        models = ModelSet.load(oracle, list(drafts), method=method, ngram=speculation.ngram,
                               context=speculation.context, dtype=dtype, device=device, quant=quant,
                               draft_weights=draft_weights, draft_vocab=draft_vocab, pass_options=pass_options)
        engine = cls(models.model, models.tokenizer, list(models.draft_models), speculation, models.ngram,
                     model_name or default_model_name(oracle, quant), list(drafts), bit_exact)
        engine.model_aliases = tuple(dict.fromkeys([str(oracle), default_model_name(oracle)]))
        return engine

    def serves(self, name: str) -> bool:
        """Whether a request's `model` names this server's model: its id, or a name a user would try
        (`model_aliases`)."""
        return name == self.model_name or name in self.model_aliases

    # ---------------------------------------------------------------- per request
    def speculation_for(self, req: SpeculationRequest) -> SpeculationConfig:
        """The server's default speculation with a request's overrides, or a 400 saying why not."""
        s = self.speculation
        method = req.method or s.method
        if method not in METHODS:
            raise bad(f"unknown speculation method {method!r}: use one of {', '.join(METHOD_NAMES)}",
                      "speculation.method")
        m = METHODS[method]
        if req.draft is not None and req.draft not in self.draft_names:
            have = ", ".join(self.draft_names) or "none"
            raise bad(f"draft {req.draft!r} is not loaded by this server (loaded: {have})", "speculation.draft")
        if m.needs_drafts and not self.draft_models:
            raise bad(f"method {method!r} needs a draft model; start the server with --draft", "speculation.method")
        try:
            m.check_bottom(self.ngram is not None, s.context)
        except StagedSpecError as e:
            raise bad(f"{e}; this server has neither", "speculation.method") from None
        changes: dict[str, Any] = {"method": method}
        for name, size in req.sizes.items():
            if size > self.max_context:
                # a tree is verified in one pass over the context: more nodes than the context holds is no tree
                raise bad(f"'speculation.{name}' must be at most {self.max_context} (the model's context), "
                          f"got {size}", f"speculation.{name}")
        if req.sizes:  # the sizes a request names are run as named
            changes.update(req.sizes, sizing="fixed")
        try:
            return dataclasses.replace(s, **changes)
        except StagedSpecError as e:
            raise bad(str(e), "speculation") from None

    def grammar_compiler(self) -> GrammarCompiler:
        """The tokenizer as the grammar library sees it, built at the first request with a grammar and kept
        (`request_plan.plan_constraints` calls it)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        return self._grammar_compiler

    def pipeline(self, spec: SpeculationConfig) -> Pipeline:
        # Pipeline.drafter takes the first draft for chain/tree and all of them for staged (or any later method)
        drafts = self.draft_models if METHODS[spec.method].uses_drafts else []
        # one measurement of the pass costs, and one policy per method, learn from every request
        pipe = Pipeline(self.model, self.tokenizer, drafts, spec, self.ngram, learned=self.learned)
        pipe.bit_exact = bool(self.bit_exact)
        if spec.measured and self.batched_passes:
            # A batched request's measured step times include its waits at the barrier for its
            # neighbours' passes, which priced every draft arm out at 8 streams (bench-serve: auto 1.10x
            # `ar`, staged 1.46x); the machine's cost profile prices the arms instead, as for a seeded request,
            # at the margin of the round each step shares (`auto.SharedLoad`, set by the scheduler).
            policy = pipe.sized_policy(spec.method)
            if policy.learn_times:
                policy.learn_times, policy.costs = False, StepCosts()
        return pipe

    @property
    def max_context(self) -> int:
        return self.model.config.max_position

    def cache_slots(self, prompt_len: int, max_tokens: int, spec: SpeculationConfig) -> int:
        return context_budget(self.model, prompt_len, max_tokens, spec.max_tree_budget)

    # ---------------------------------------------------------------- memory
    def memory_model(self) -> MemoryModel:
        cfg = self.model.config
        weights = model_bytes(self.model)
        shared = {id(p) for p in self.model.parameters()}
        for d in self.draft_models:  # a truncated draft shares the oracle's tensors: count only its own
            weights += sum(p.numel() * p.element_size() for p in d.parameters() if id(p) not in shared)
        rows = self.speculation.max_tree_budget + 2
        width = cfg.max_position + TREE_SLACK
        elem = self.model.embed.weight.element_size()
        # one pass: attention scores (fp32) + hidden/MLP activations + logits rows (fp32)
        scratch = rows * (cfg.n_heads * width * 4 + (4 * cfg.hidden_size + 2 * cfg.intermediate_size) * elem
                          + cfg.vocab_size * 4)
        return MemoryModel(weights, kv_bytes_per_token(self.model),
                           sum(kv_bytes_per_token(d) for d in self.draft_models), int(scratch), rows)

    def full_context_slots(self) -> int:
        return context_budget(self.model, 1, self.max_context - 1, self.speculation.max_tree_budget)


def default_model_name(oracle: str, quant: str = "none") -> str:
    name = "SmolLM2-135M-Instruct" if oracle == "default" else oracle.rstrip("/").rsplit("/", 1)[-1]
    return name if quant == "none" else f"{name}@{quant}"

