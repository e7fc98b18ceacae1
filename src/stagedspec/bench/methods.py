"""What `stagedspec bench` measures: each method as "run this prompt, return tokens and counters".

The models are loaded once (`BenchModels`) and shared by every method of a
run: all of ours use the same oracle `Transformer` and the same draft
objects, and the transformers baselines use one HF copy of the oracle (and of
the draft), so every method decodes with the same weights.

Methods and their families:

- ours (`Pipeline`): `ar`, `auto`, `chain`, `tree`, `lookup`, `staged`, and any
  `staged:ORACLE,DRAFT...,BOTTOM` stage configuration; each of them also on
  quantised oracle weights as `NAME@int4` / `NAME@int8` (a second copy of the
  oracle, loaded once, shared by the methods with that suffix);
- transformers: `hf-generate` (plain autoregressive `generate`),
  `hf-assisted` (assisted generation with the same draft as `assistant_model`),
  `hf-lookup` (prompt-lookup decoding, `prompt_lookup_num_tokens`);
- llama.cpp (`stagedspec.bench.llamacpp`, where `scripts/llamacpp/build.sh`
  has built it): `llamacpp` (plain), `llamacpp-spec` (its draft-model
  speculation) and `llamacpp-ngram` (its ngram-mod drafting), on the
  oracle's GGUF through `llama-server`.

Every run returns an `Outcome` with the generated ids, wall-clock seconds and
the forward passes of each model, from which the report derives tokens/s,
accepted lengths and weight bytes read per token.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from stagedspec.draft_weights import split_weights_suffix
from stagedspec.errors import StagedSpecError
from stagedspec.methods import METHODS
from stagedspec.models.transformer import Transformer
from stagedspec.pass_options import PassOptions
from stagedspec.sampling import SamplingParams

OURS = ("ar", "auto", "chain", "tree", "tree-adaptive", "lookup", "staged")
# Run only when named: `tree` grown on the host, beside `tree` on a GPU; and tree / lookup / staged at their
# fixed default sizes every step, beside the measured sizing the CLI runs (`SpeculationConfig.sizing`).
VARIANTS = ("tree-best-first", "tree-fixed", "lookup-fixed", "staged-fixed")
QUANTISABLE = (*OURS, *VARIANTS)  # methods of ours that take an @int4 / @int8 / @mixed suffix
# Suffixes of our methods: `staged@int4` runs staged on the int4 oracle; `@mixed` is what `--quant auto` runs on
# a GGUF; `-torch` runs those weights on PyTorch's kernels (bf16) instead of ours, side by side.
QUANTISED = ("int4", "int8", "mixed", "int4-torch", "int8-torch")
INT4 = ("ar@int4", "auto@int4", "lookup@int4", "staged@int4")
TRANSFORMERS = ("hf-generate", "hf-assisted", "hf-lookup")
LLAMACPP = ("llamacpp", "llamacpp-spec", "llamacpp-ngram")  # run by `stagedspec.bench.llamacpp`
ALL_METHODS = (*OURS, *VARIANTS, *INT4, *TRANSFORMERS, *LLAMACPP)
FIXED_VARIANTS = {"tree-fixed": "tree", "lookup-fixed": "lookup", "staged-fixed": "staged"}
NEEDS_DRAFT = ("chain", "tree", "tree-adaptive", "tree-best-first", "tree-fixed", "staged", "staged-fixed",
               "hf-assisted")
HF_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens


def split_draft(name: str) -> tuple[str, str | None]:
    """`auto@mixed/qwen2.5-coder-0.5b` -> ("auto@mixed", "qwen2.5-coder-0.5b"): a method may name its own draft
    (several model stages joined by `+`, top first: `staged@mixed/FEATURE+qwen2.5-coder-0.5b`),
    so one run compares drafts side by side (`auto` with a feature draft and with an independent one, llama.cpp's
    `-md` with a GGUF while ours run a draft folder).  No suffix: (name, None), the run's `--draft`."""
    base, sep, draft = name.partition("/")
    return (base, draft) if sep and draft else (name, None)


def split_quant(name: str) -> tuple[str, str]:
    """`staged@int4` -> ("staged", "int4"); a name without a suffix runs unquantised ("none").  A method's own
    draft (`split_draft`) is not part of either."""
    base, _, quant = split_draft(name)[0].partition("@")
    return base, quant or "none"


def reference_for(name: str) -> str:
    """Our `ar` on the same weights: what a method's speedup and exactness are measured against."""
    quant = split_quant(name)[1]
    return "ar" if quant == "none" else f"ar@{quant}"


class MethodSkipped(Exception):
    """A method cannot run in this environment (the reason is reported, the run goes on)."""


@dataclass
class Outcome:
    """One generation: ids, time, and the work done by each model."""

    token_ids: list[int]
    seconds: float
    oracle_forward_passes: int
    # (stage name, forward passes, weight bytes per pass) for every model below the oracle
    draft_passes: list[tuple[str, int, int]] = field(default_factory=list)
    accepted_lengths: list[int] | None = None  # draft tokens accepted per oracle step, when known
    token_origins: list[str] | None = None  # who proposed each emitted token, when known
    stage_seconds: dict[str, float] | None = None  # time per stage, when known
    finish_reason: str = "length"
    auto_choices: dict[str, int] | None = None  # `auto`: steps run per configuration

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Method:
    """A named way of decoding one prompt."""

    name: str
    family: str  # "ours", "transformers", "llama.cpp"
    kind: str  # "baseline", "spec", "lookup", "staged" (rows of the paper-style table)
    description: str
    run: Callable[[list[int], int, SamplingParams, int | None], Outcome]  # seed None: ours only (`--unseeded`)
    settings: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] | None = None

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "kind": self.kind, "description": self.description,
                "settings": self.settings}


# ====================================================================== shared models
class BenchModels:
    """The oracle, tokenizer, drafts and n-grams of a run, each loaded once and shared by all methods."""

    def __init__(self, oracle: str, dtype: str, device: str, draft_weights: str = "auto",
                 pass_options: PassOptions | None = None, draft_vocab: str = "auto") -> None:
        """`pass_options`: how every model's passes run (the drafts run theirs as their oracle does; None: the
        environment's defaults).  `draft_vocab`: the run's --draft-vocab (a SPEC@full suffix sets one draft's)."""
        # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
        from stagedspec.models.loading import load_model
        from stagedspec.pipeline import check_device, dtype_name, resolve_dtype

        self.oracle_spec = oracle
        self.draft_weights = draft_weights
        self.draft_vocab = draft_vocab
        self.pass_options = pass_options
        self.device = check_device(device)
        self.dtype = resolve_dtype(dtype, self.device)[0]
        self.dtype_name = dtype_name(self.dtype)
        self.oracle, self.tokenizer = load_model(oracle, dtype=self.dtype, device=self.device,
                                                 pass_options=pass_options)
        self._quantised: dict[str, Transformer] = {}
        self._drafts: dict[str, Transformer] = {}
        self._ngrams: dict[str, Any] = {}
        self._hf_oracle: nn.Module | None = None
        self._hf_drafts: dict[str, tuple[nn.Module, str]] = {}
        self.bit_exact: bool | None = None  # our methods' `Pipeline.bit_exact` (`bench --bit-exact`; None: default)

    def same_oracle(self, spec: str) -> bool:
        # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
        from stagedspec.models.specs import resolve_model_path

        return spec == self.oracle_spec or resolve_model_path(spec) == resolve_model_path(self.oracle_spec)

    def oracle_for(self, quant: str) -> Transformer:
        """The oracle on `quant` weights ("none": the shared unquantised oracle; "int4-torch": PyTorch's kernels)."""
        if quant == "none":
            return self.oracle
        if quant not in self._quantised:
            # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
            from stagedspec.models.loading import load_model

            mode, _, kernels = quant.partition("-")
            dtype = torch.bfloat16 if kernels == "torch" else self.dtype  # PyTorch's int4/int8 kernels take bf16
            try:
                self._quantised[quant] = load_model(self.oracle_spec, dtype=dtype, device=self.device,
                                                    quant=mode, kernels=kernels or "auto",
                                                    pass_options=self.pass_options)[0]
            except StagedSpecError as e:
                raise MethodSkipped(str(e)) from None
        return self._quantised[quant]

    def loaded_quantised(self) -> dict[str, Transformer]:
        """The quantised oracles loaded so far, by `--quant` mode (for the results' record)."""
        return dict(self._quantised)

    def loaded_drafts(self) -> dict[str, Transformer]:
        """The drafts loaded so far, by "spec|format|quant" (for the results' record)."""
        return dict(self._drafts)

    def draft(self, spec: str, quant: str = "none", weights: str | None = None) -> Transformer:
        """The draft `spec`; for a quantised oracle, on top of it.  Its weight format is `weights`, a
        `SPEC@FORMAT` suffix, or the run's `--draft-weights` (as `Pipeline` picks it)."""
        base, own = split_weights_suffix(spec)
        fmt = weights or own or self.draft_weights
        key = f"{base}|{fmt}|{quant}"
        if key not in self._drafts:
            # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
            from stagedspec.pipeline import load_draft_model

            self._drafts[key] = load_draft_model(base, self.oracle_for(quant), self.tokenizer, self.dtype,
                                                 self.device, fmt, self.draft_vocab)
        return self._drafts[key]

    def ngram(self, spec: str) -> Any:
        if spec not in self._ngrams:
            # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
            from stagedspec.drafters.ngram_files import load_ngram

            self._ngrams[spec] = load_ngram(spec, self.tokenizer)
        return self._ngrams[spec]

    @property
    def ngrams(self) -> dict[str, Any]:
        return dict(self._ngrams)

    # ------------------------------------------------------------------ transformers twins
    def hf_oracle(self) -> nn.Module:
        if self._hf_oracle is None:
            try:
                import transformers
                from transformers import AutoModelForCausalLM
            except ImportError:
                raise MethodSkipped("transformers is not installed (pip install 'stagedspec[bench]')") from None
            # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
            from stagedspec.models.specs import hf_folder_for

            transformers.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
            folder = hf_folder_for(self.oracle_spec)
            self._hf_oracle = AutoModelForCausalLM.from_pretrained(str(folder), dtype=self.dtype).to(self.device).eval()
        return self._hf_oracle

    def hf_draft(self, spec: str) -> tuple[nn.Module, str]:
        """The draft as a transformers model computing the same function, and a note on how it was made."""
        if spec not in self._hf_drafts:
            # transformers runs the draft's own (native) weights, whatever format ours runs
            self._hf_drafts[spec] = hf_twin(self.draft(spec, weights="native"), self.oracle, self.hf_oracle(), spec)
        return self._hf_drafts[spec]


# ====================================================================== our methods
def _pipeline(models: BenchModels, oracle: Transformer, speculation: Any, drafts: Sequence[Transformer],
              ngram: Any) -> Any:
    """A `Pipeline` around already-loaded models, on the run's device and dtype: `Pipeline.drafter` and
    `Pipeline.generate` run unchanged, so the benchmark measures the same code path as `stagedspec generate`.
    """
    # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
    from stagedspec.pipeline import Pipeline

    pipe = Pipeline(oracle, models.tokenizer, drafts, speculation, ngram, device=models.device, dtype=models.dtype)
    if models.bit_exact is not None:
        pipe.bit_exact = models.bit_exact
    return pipe


def _measured_description(method: str, draft: str, context: bool, ngram_spec: str | None, device: str) -> str:
    """What a measured method (`SpeculationConfig.sizing`) runs on `device`: its arms, `ar` among them."""
    # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
    from stagedspec.auto import STAGE_LONG_LOOKUP, STAGE_LOOKUP_EXTRA, arms_for

    sizes = "/".join(dict.fromkeys(str(a.size) for a in arms_for(True, True, device, method) if a.kind == method))
    what = {"tree": f"a best-first tree of {sizes} nodes from draft {draft}",
            "lookup": f"model-free chains of {sizes} tokens ({_bottom(context, ngram_spec)}"
                      f"{', or the prompt-lookup chain alone' if context else ''})",
            "staged": f"staged oracle <- {draft} <- {_bottom(context, ngram_spec)}, the draft decoding {sizes} "
                      f"tokens, a prompt-lookup chain of {STAGE_LOOKUP_EXTRA} more or of {STAGE_LONG_LOOKUP} "
                      "merged into the oracle's tree"}[method]
    return (f"our engine, {method} with measured sizes: each step ar or {what}, whichever this machine's measured "
            "costs and the acceptance so far make fastest")


def ours(
    models: BenchModels, name: str, speculation: Any, draft_specs: Sequence[str], ngram_spec: str | None,
    quant: str = "none",
) -> Method:
    """One of our methods (`SpeculationConfig`) with drafts given by spec, from the shared models.

    `quant` picks the oracle's weights (`BenchModels.oracle_for`) and, with them, int8 drafts."""
    from dataclasses import asdict

    s = speculation
    m = METHODS[s.method]
    drafts = [models.draft(d, quant) for d in draft_specs] if m.uses_drafts else []
    if m.drafts == "one":
        drafts = drafts[:1]
    ngram = models.ngram(ngram_spec) if m.bottom and ngram_spec else None
    m.check_bottom(ngram is not None, s.context)
    oracle = models.oracle_for(quant)
    pipe = _pipeline(models, oracle, s, drafts, ngram)
    oracle_bytes = oracle.num_bytes()
    draft_bytes = [d.num_bytes() for d in drafts]

    def run(ids: list[int], max_new_tokens: int, sampling: SamplingParams, seed: int | None) -> Outcome:
        t0 = time.perf_counter()
        result = pipe.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
        seconds = time.perf_counter() - t0
        st = result.stats
        rows = st.stages  # oracle, then one row per model stage (top down), then the lookup stage
        if m.drafts == "one":
            passes = [("draft", st.draft_forward_passes, draft_bytes[0])]
        else:
            passes = [(r["stage"], r["forward_passes"], draft_bytes[i] if i < len(draft_bytes) else 0)
                      for i, r in enumerate(rows[1:])]
        return Outcome(result.token_ids, seconds, st.oracle_forward_passes, passes,
                       accepted_lengths=list(st.accepted_lengths), token_origins=list(st.token_origins),
                       stage_seconds={r["stage"]: r["seconds"] for r in rows}, finish_reason=st.finish_reason,
                       auto_choices=dict(st.auto_choices) or None)

    kind = {"ar": "baseline", "auto": "auto", "chain": "spec", "tree": "spec", "lookup": "lookup",
            "staged": "staged"}[s.method]
    first = draft_specs[0] if draft_specs else ""
    desc = {
        "ar": "our engine, plain autoregressive decoding",
        "auto": "our engine, auto: each step the fastest of ar / lookup / tree / staged by this machine's measured "
                f"costs and the acceptance so far (draft {first or 'none'}, "
                f"{_bottom(s.context, ngram_spec) or 'no lookup'})",
        "chain": f"our engine, chain speculation ({s.chain_length} draft tokens) with draft {first}",
        "tree": f"our engine, tree speculation ({'adaptive budget, at most' if s.adaptive_budget else 'budget'} "
                f"{s.tree_budget}{', grown ' + s.tree_growth if s.tree_growth != 'auto' else ''}) with draft {first}",
        "lookup": f"our engine, model-free drafts ({'prompt lookup' if s.context else ''}"
                  f"{' + ' if s.context and ngram_spec else ''}{'n-gram ' + ngram_spec if ngram_spec else ''})",
        "staged": "our engine, staged: oracle <- " + " <- ".join([*draft_specs, _bottom(s.context, ngram_spec)])
                  + f" ({s.stage_length} tokens per stage step"
                  + (f"; prompt lookup of {s.merged_lookup_length} tokens also merged into the oracle's tree)"
                     if s.oracle_lookup and s.context else ")"),
    }[s.method]
    if s.measured and not METHODS[s.method].always_measured:
        desc = _measured_description(s.method, first, s.context, ngram_spec, str(pipe.device))
    if quant != "none":
        desc += f", oracle on {quant} weights"
    settings = asdict(s) | {"drafts": list(draft_specs), "oracle_bytes": oracle_bytes, "draft_bytes": draft_bytes,
                            "quant": quant,
                            "draft_weights": [d.runtime.weight_format for d in drafts],
                            "draft_weights_reason": [d.runtime.weight_reason for d in drafts]}
    return Method(name, "ours", kind, desc, run, settings)


def _bottom(context: bool, ngram: str | None) -> str:
    return "+".join(p for p, on in (("context", context), (f"ngram:{ngram}" if ngram else "", bool(ngram))) if on)


# ====================================================================== transformers
class _Counter:
    """Counts forward calls of an nn.Module and the time spent in them (hooks, so nothing is wrapped)."""

    def __init__(self, module: nn.Module) -> None:
        self.calls, self.seconds, self._t = 0, 0.0, 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self._t = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._t

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def transformers_method(models: BenchModels, name: str, draft_spec: str | None = None) -> Method:
    """`hf-generate`, `hf-assisted` (needs `draft_spec`) or `hf-lookup` on the shared HF oracle."""
    hf = models.hf_oracle()
    tok = models.tokenizer
    eos = list(tok.eos_token_ids)
    oracle_bytes = models.oracle.num_bytes()
    extra: dict[str, Any] = {}
    draft_bytes, note = 0, ""
    if name == "hf-assisted":
        if draft_spec is None:
            raise MethodSkipped("needs a draft model")
        assistant, note = models.hf_draft(draft_spec)
        extra["assistant_model"] = assistant
        draft_bytes = models.draft(draft_spec, weights="native").num_bytes()
    elif name == "hf-lookup":
        extra["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
    counters = [_Counter(hf)] + ([_Counter(extra["assistant_model"])] if "assistant_model" in extra else [])

    def run(ids: list[int], max_new_tokens: int, sampling: SamplingParams, seed: int) -> Outcome:
        inp = torch.tensor([ids], device=models.device)
        kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=eos,
                                  pad_token_id=eos[0] if eos else 0, **extra)
        if sampling.greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,  # 0 disables
                      top_p=sampling.top_p)
        torch.manual_seed(seed)
        for c in counters:
            c.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(inp, attention_mask=torch.ones_like(inp), **kw)
        if inp.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        finish = "length"
        for j, t in enumerate(new):
            if t in eos:
                new, finish = new[: j + 1], "stop"
                break
        passes = [("draft", counters[1].calls, draft_bytes)] if len(counters) > 1 else []
        stage_seconds = None
        if len(counters) > 1:
            stage_seconds = {"oracle": seconds - counters[1].seconds, "draft": counters[1].seconds}
        return Outcome(new, seconds, counters[0].calls, passes, stage_seconds=stage_seconds, finish_reason=finish)

    desc = {
        "hf-generate": "transformers generate, plain autoregressive (same weights)",
        "hf-assisted": f"transformers assisted generation, assistant_model = draft {draft_spec}",
        "hf-lookup": f"transformers prompt-lookup decoding (prompt_lookup_num_tokens={HF_LOOKUP_TOKENS})",
    }[name]
    kind = {"hf-generate": "baseline", "hf-assisted": "spec", "hf-lookup": "lookup"}[name]
    settings = {"oracle_bytes": oracle_bytes, "draft_bytes": [draft_bytes] if draft_bytes else [],
                "draft_note": note, **{k: v for k, v in extra.items() if k != "assistant_model"}}
    import transformers

    settings["transformers_version"] = transformers.__version__

    def close() -> None:
        for c in counters:
            c.remove()

    return Method(name, "transformers", kind, desc, run, settings, close)


class _RestrictedHead(nn.Module):
    """A vocabulary-restricted head as a full-vocabulary layer: the support's logits, -inf elsewhere.

    Computes exactly what `DraftModel.forward` computes (same matmul over the
    V' support rows, then a scatter), so the transformers twin proposes the
    same tokens at the same cost.
    """

    def __init__(self, weight: Tensor, support: Tensor, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.register_buffer("support", support.detach().clone())
        self.vocab_size = vocab_size

    def forward(self, h: Tensor) -> Tensor:
        logits = nn.functional.linear(h, self.weight)
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.support, logits)


def hf_twin(draft: Transformer, oracle: Transformer, hf_oracle: nn.Module, spec: str) -> tuple[nn.Module, str]:
    """A transformers model computing the same function as our `draft`, for `assistant_model`.

    Works for any Llama-family draft built from our weights (a `layers:N`
    truncation, a distilled `DraftModel`, or a standalone checkpoint): the
    decoder layers and final norm are our tensors un-fused into transformers'
    names (q|k|v and gate|up split back), the token embedding is the HF
    oracle's own module (our drafts share the oracle's embedding), and the
    head is the oracle's (shared), the draft's own, or a restricted head
    scattered to the full vocabulary with -inf outside its support.
    Built in memory; nothing is written to disk.
    """
    cfg = draft.config
    if getattr(draft, "kind", None) == "feature":
        raise MethodSkipped("no transformers twin for a feature draft (assistant_model passes it no oracle features)")
    if cfg.arch != "llama":
        raise MethodSkipped(f"no transformers twin for a {cfg.arch!r} draft (Llama-family only)")
    if draft.config.vocab_size != oracle.config.vocab_size:
        raise MethodSkipped("the draft's vocabulary differs from the oracle's")
    hcfg = copy.deepcopy(hf_oracle.config)
    hcfg.num_hidden_layers = cfg.n_layers
    if getattr(hcfg, "layer_types", None):
        hcfg.layer_types = list(hcfg.layer_types)[: cfg.n_layers]
    hcfg.tie_word_embeddings = False
    dtype = next(hf_oracle.parameters()).dtype
    twin = type(hf_oracle)(hcfg).to(dtype=dtype).eval()
    H, Hkv, D, inter = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    state: dict[str, Tensor] = {}
    for i, layer in enumerate(draft.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attn.wqkv.weight.split([H * D, Hkv * D, Hkv * D])
        state |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v}
        if layer.attn.wqkv.bias is not None:
            qb, kb, vb = layer.attn.wqkv.bias.split([H * D, Hkv * D, Hkv * D])
            state |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb}
        gate, up = layer.mlp.w_up.weight.split([inter, inter])
        state |= {p + "self_attn.o_proj.weight": layer.attn.wo.weight, p + "mlp.gate_proj.weight": gate,
                  p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": layer.mlp.w_down.weight,
                  p + "input_layernorm.weight": layer.attn_norm.weight,
                  p + "post_attention_layernorm.weight": layer.mlp_norm.weight}
    state["model.norm.weight"] = draft.norm.weight
    own = twin.state_dict()
    missing = sorted(k for k in own if k.startswith("model.layers.") and k not in state)
    if missing:
        raise MethodSkipped(f"cannot map the draft onto {type(hf_oracle).__name__}: no weights for {missing[:2]}")
    with torch.no_grad():
        for k, t in state.items():
            own[k].copy_(t.detach().to(dtype))
    twin.model.embed_tokens = hf_oracle.model.embed_tokens  # shared, as in our drafts
    head_tokens = getattr(draft, "head_tokens", None)  # a distilled draft's restricted head: its own rows
    cut = head_tokens is None and draft.subset_ids is not None  # a head cut by --draft-vocab: the whole head's rows
    if head_tokens is not None or cut:
        ids = draft.subset_ids if cut else head_tokens
        rows = draft.head_weight[ids] if cut else draft.head_weight
        twin.lm_head = _RestrictedHead(rows.to(dtype), ids.cpu(), cfg.vocab_size)
        kind = "head cut by --draft-vocab" if cut else "restricted head"
        note = (f"{kind} ({ids.numel()} of {cfg.vocab_size} tokens) as a module that scatters the support's "
                "logits into -inf elsewhere: the same function and cost as our draft")
    elif draft.head_weight.data_ptr() == oracle.head_weight.data_ptr():
        twin.lm_head = hf_oracle.get_output_embeddings()
        note = "the oracle's head (shared)"
    else:
        twin.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        with torch.no_grad():
            twin.lm_head.weight.copy_(draft.head_weight.detach().to(dtype))
        note = "its own full-vocabulary head"
    twin = twin.to(next(hf_oracle.parameters()).device)
    twin.generation_config = copy.deepcopy(hf_oracle.generation_config)
    return twin, (f"draft {spec} rebuilt in memory as {type(hf_oracle).__name__} ({cfg.n_layers} layers, "
                  f"oracle embedding, {note})")


# ====================================================================== llama.cpp
def gguf_for(oracle_spec: str) -> Path | None:
    """The GGUF llama.cpp should run for this oracle (the embedded default model's own GGUF), if any."""
    if oracle_spec == "default":
        # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
        from stagedspec.models.default import default_gguf_path

        return default_gguf_path()
    # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
    from stagedspec.models.named import PARTS_MODELS, parts_model_path

    if oracle_spec in PARTS_MODELS:
        return parts_model_path(oracle_spec)
    path = Path(oracle_spec).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def gguf_weight_bytes(path: Path) -> int:
    """Bytes llama.cpp streams per forward pass: every tensor as stored (quantised blocks included).

    The token embedding is counted only when it doubles as the output head
    (no separate `output.weight`), as for our own models."""
    # deferred: the CLI's parser loads this module (via bench.run); the models load when a benchmark runs
    from stagedspec.models.gguf_file import read_tensor_table

    tensors = {t.name: t.n_bytes for t in read_tensor_table(path)}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())
