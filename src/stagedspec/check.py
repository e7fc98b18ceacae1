"""`stagedspec check`: an exactness self-test on the user's own oracle and draft, on their own machine.

Three parts, printed as one table (docs/check.md has the reasoning and example output):

1. Greedy: every method the pair supports emits token for token what `ar` emits, on a few prompts,
   in fp32 and, when the serving dtype is not fp32 (bf16, or --quant), in it with `bit_exact` on both
   sides.  A FAIL names the prompt and the first differing position.  Each row gives the method's mean
   accepted length, and FAILs when no drafted token was accepted: the output is then `ar`'s by
   construction and the identity tested nothing.  (`auto` that chose `ar` on every step by this
   machine's costs is run again with its arms taking turns, as on reference-only models.)
2. Sampling: the first token of a speculative step is distributed as the oracle's next-token
   distribution p at that context, computed from its logits with `probs_from_logits`.  N steps with
   different seeds, a chi-square goodness-of-fit test against p (cells with expected count < 5
   pooled; a draw where p = 0 fails outright), at T=1 and at the user's temperature/top-k/top-p.
   A negative control runs on the same pair and context: the draft's top tokens proposed
   deterministically but verified with min(1, p/q) as if drawn from the draft's q (the wrong-q
   verifier).  It must be flagged; if it is not, the row says NO POWER instead of claiming anything.
3. Speed: each method's tokens/s against `ar` on the greedy prompts (a measurement, not a test).

Exit status: 0 when nothing FAILs, 1 otherwise (2 for bad input, as everywhere in the CLI).

Reuse that keeps the sampling test fast without changing what it measures: the oracle's logits for
a tree are computed once and reused (a pass is a deterministic function of the context and the tree),
and a proposal that drew nothing from the random generator is reused for the same context (it is
then a deterministic function of the context).  Every sample still goes through the real loop
(`iter_steps`) and the real verifier with its own seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from stagedspec.drafters.base import Drafter
from stagedspec.errors import StagedSpecError
from stagedspec.methods import METHODS
from stagedspec.models.matmul_plan import OFF_ENV
from stagedspec.runner import ModelOracle
from stagedspec.sampling import SamplingParams, probs_from_logits
from stagedspec.tree import TokenTree

ALPHA = 1e-3  # significance level of every chi-square row
POWER = 0.9  # the power at which the detectable total variation is stated
CONTROL_BRANCHES = 3  # the negative control proposes the draft's top-3 tokens at the root


@dataclass
class Budget:
    """How much work each part does (`--quick` shrinks it)."""

    prompts: int = 3
    new_tokens: int = 32
    samples: int = 4000
    candidates: int = 24  # positions of a greedy continuation considered as the sampling context


FULL = Budget()
QUICK = Budget(prompts=2, new_tokens=16, samples=1000, candidates=12)


@dataclass
class Row:
    part: str  # greedy | sampling | control | speed
    name: str
    status: str  # PASS | FAIL | SKIP | FLAGGED | NO POWER | INFO
    detail: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *args: Any) -> Row:
        row = Row(*args)
        self.rows.append(row)
        return row

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.rows)

    def table(self) -> str:
        w_part = max(len(r.part) for r in self.rows)
        w_name = max(len(r.name) for r in self.rows)
        w_stat = max(len(r.status) for r in self.rows)
        lines = [f"{'part':<{w_part}}  {'check':<{w_name}}  {'result':<{w_stat}}  figures",
                 "-" * (w_part + w_name + w_stat + 16)]
        lines += [f"{r.part:<{w_part}}  {r.name:<{w_name}}  {r.status:<{w_stat}}  {r.detail}" for r in self.rows]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------


def chi2_sf(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: Q(df/2, stat/2)."""
    if df <= 0:
        return 1.0
    a = torch.tensor(df / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, df: int) -> float:
    """The critical value x with P(chi2_df > x) = alpha (bisection)."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, df: int, lam: float) -> float:
    """P(noncentral chi2(df, lam) > x): a Poisson(lam/2) mixture of central chi-squares."""
    total, half = 0.0, lam / 2
    for j in range(int(half + 12 * math.sqrt(half + 1) + 40)):
        weight = math.exp(-half + j * math.log(half) - math.lgamma(j + 1)) if half > 0 else float(j == 0)
        total += weight * chi2_sf(x, df + 2 * j)
    return min(1.0, total)


def detectable_tv(n: int, df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest total variation any bias can have and still be rejected with `power` at `alpha`.

    A bias d gives the statistic a non-centrality lam = n * sum(d_i^2 / p_i) >= n * (2 TV)^2
    (Cauchy-Schwarz; equality for the least detectable shape, d_i proportional to +-p_i), so
    TV = sqrt(lam* / (4 n)) where lam* is the non-centrality reaching the power.
    """
    df = max(df, 1)
    crit = chi2_isf(alpha, df)
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2_sf(crit, df, mid) < power else (lo, mid)
    return math.sqrt(hi / (4 * n))


def pooled_cells(p: Tensor, n: int) -> tuple[list[list[int]], list[float]]:
    """Tokens grouped into cells of expected count >= 5 (the small ones pooled), with each cell's probability."""
    probs = p.double().tolist()
    order = sorted((i for i, v in enumerate(probs) if v > 0), key=lambda i: -probs[i])
    cells = [[i] for i in order if n * probs[i] >= 5]
    small = [i for i in order if n * probs[i] < 5]
    if small:
        if n * sum(probs[i] for i in small) < 5 and cells:
            cells[-1] = cells[-1] + small
        else:
            cells.append(small)
    return cells, [sum(probs[i] for i in c) for c in cells]


def chi_square(counts: Counter, p: Tensor) -> tuple[float, int, float]:
    """(p-value, degrees of freedom, statistic) of the token counts against the distribution p.

    A token drawn where p = 0 returns p-value 0."""
    n = sum(counts.values())
    if any(float(p[t]) == 0.0 for t in counts):
        return 0.0, 0, math.inf
    cells, probs = pooled_cells(p, n)
    stat = 0.0
    for cell, prob in zip(cells, probs):
        observed = sum(counts.get(t, 0) for t in cell)
        stat += (observed - n * prob) ** 2 / (n * prob)
    df = len(cells) - 1
    return chi2_sf(stat, df), df, stat


def wrong_q_distribution(p: Tensor, tokens: Sequence[int], q: Tensor) -> Tensor:
    """The exact first-token distribution of the wrong-q verifier on a deterministic root: what it is biased to.

    Mirrors `sampled_node_rule` applied to fixed proposals: accept x_i w.p. min(1, r(x)/q_i(x)), else
    r <- residual(r, q_i), q_{i+1} = q_i without x_i; finally draw from r.
    """
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    from stagedspec.verification import residual

    r, qq = p.double(), q.double() / q.double().sum()
    out = torch.zeros_like(r)
    reach = 1.0
    for x in tokens:
        a = min(1.0, float(r[x]) / float(qq[x])) if float(qq[x]) > 0 else 0.0
        out[x] += reach * a
        reach *= 1.0 - a
        r = residual(r, qq)
        qq = qq.clone()
        qq[x] = 0.0
        if float(qq.sum()) <= 0:
            break
        qq = qq / qq.sum()
    return out + reach * r


def power_against(p: Tensor, biased: Tensor, n: int) -> float:
    """Power of the pooled chi-square test at `ALPHA` against samples from `biased` (non-centrality on the cells)."""
    cells, probs = pooled_cells(p, n)
    b = biased.double().tolist()
    lam = n * sum((sum(b[i] for i in c) - pc) ** 2 / pc for c, pc in zip(cells, probs))
    df = len(cells) - 1
    return ncx2_sf(chi2_isf(ALPHA, df), df, lam) if df > 0 else 0.0


# ----------------------------------------------------------------------------------------------------------
# Reuse wrappers (exact: see the module docstring)
# ----------------------------------------------------------------------------------------------------------


class _ReusedOracle:
    """A `ModelOracle` at one fixed context whose tree scores are computed once per distinct tree."""

    bit_exact = False  # its scores are memoised per tree, not kept slot-aligned

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.memo: dict[tuple, Tensor] = {}
        self.forward_passes = 0
        self._ids: list[int] = []
        self.last_tree: TokenTree | None = None

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self._ids = list(prompt_ids)

    def score(self, tree: TokenTree) -> Tensor:
        self.last_tree = tree
        key = (tuple(self._ids), tuple(tree.tokens), tuple(tree.parents))
        if key not in self.memo:
            self.inner.prefill(self._ids)
            self.memo[key] = self.inner.score(tree).detach()
            self.inner.commit([])  # keeps the context (and the root) cached for the next distinct tree
            self.forward_passes += 1
        return self.memo[key]

    def commit(self, accepted: Sequence[int]) -> None:
        pass


class _ReusedDrafter(Drafter):
    """A drafter whose proposal is reused for the same context when it drew nothing from the generator."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.memo: dict[tuple, TokenTree] = {}
        self.draws = False  # did a proposal consume randomness? Then nothing is reused.
        self._begun: list[int] | None = None
        self.forward_passes = 0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._begun = list(prompt_ids)
        self._fresh = True

    def attach_oracle(self, oracle: Any) -> None:
        """A feature draft reads the loop's oracle's hidden states (`stagedspec.drafters.feature`)."""
        self.inner.attach_oracle(oracle)

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        key = (tuple(context), max_tokens)
        if not self.draws and key in self.memo:
            return self.memo[key]
        if self._fresh:
            self.inner.begin(self._begun)
            self._fresh = False
        before = generator.get_state() if generator is not None else None
        tree = self.inner.propose(context, sampling, generator, max_tokens)
        self.forward_passes = self.inner.forward_passes
        if before is not None and not torch.equal(before, generator.get_state()):
            self.draws = True
        elif not self.draws:
            self.memo[key] = tree
        return tree


class _ControlDrafter(Drafter):
    """The negative control's proposal: the draft's top tokens at the root, fixed, with the draft's q recorded."""

    forward_passes = 0

    def __init__(self, tokens: list[int], q: Tensor) -> None:
        self.tokens, self.q = tokens, q

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, context, sampling, generator, max_tokens):  # noqa: ANN001, ANN201
        return TokenTree([context[-1], *self.tokens], [-1] + [0] * len(self.tokens), child_q={0: self.q})


def wrong_q_verifier(tree: TokenTree, logits: Tensor, sampling: SamplingParams, generator: Any) -> Any:
    """NEGATIVE CONTROL: a deterministic tree verified with min(1, p/q) as if its children were draws from q."""
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    from stagedspec.verification import verify

    return verify(dataclasses.replace(tree, sampled=True), logits, sampling, generator)


def _real_verifier(tree: TokenTree, logits: Tensor, sampling: SamplingParams, generator: Any) -> Any:
    """The verifier every method uses (looked up at call time, as the loop does)."""
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    import stagedspec.generation as generation

    return generation.verify(tree, logits, sampling, generator)


# ----------------------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------------------


@dataclass
class CheckConfig:
    oracle: str = "default"
    draft: str | None = None
    ngram: str | None = None
    quant: str = "none"
    device: str = "cpu"
    dtype: str = "auto"
    quick: bool = False
    user_sampling: SamplingParams = SamplingParams(temperature=1.0, top_k=50)
    budget: Budget | None = None  # None: FULL or QUICK

    def __post_init__(self) -> None:
        if self.user_sampling.greedy:
            raise StagedSpecError("check's sampling test needs --temperature > 0")
        if self.budget is None:
            self.budget = QUICK if self.quick else FULL


class _Loaded:
    """The oracle in one dtype, its drafts and the n-gram: what every pipeline of that dtype shares.

    `reference_only`: these models are only the fp32 reference of the greedy test, not what the user serves
    (`--quant`, or bf16).  Then nothing about their speed is measured: they run plain `F.linear` (timing
    the fp32 kernels of the Qwen2.5-Coder 1.5B/0.5B pair took 7 minutes on two cores) and `auto` is priced
    by `reference_profile` (their fp32 cost profile took 3.5 minutes more).  Neither changes what is
    tested: every method still runs the same kernels as `ar`, and every speed row comes from the serving
    dtype's runs.
    """

    def __init__(self, cfg: CheckConfig, dtype: torch.dtype, quant: str, ngram: Any,
                 reference_only: bool = False) -> None:
        # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
        from stagedspec.models.loading import load_model
        from stagedspec.pipeline import load_draft_model

        with _plain_matmuls() if reference_only else contextlib.nullcontext():
            self.model, self.tokenizer = load_model(cfg.oracle, dtype=dtype, device=cfg.device, quant=quant)
            self.drafts = [load_draft_model(cfg.draft, self.model, self.tokenizer, dtype, cfg.device)] \
                if cfg.draft else []
        self.ngram, self.quant, self.device = ngram, quant, cfg.device
        self.auto_profile = reference_profile() if reference_only else None

    def pipeline(self, method: str, bit_exact: bool = False, every_arm: bool = False) -> Any:
        """A pipeline of `method` over these models.  `every_arm`: `auto` prices every pass as nearly free
        (`reference_profile`), so it runs each of its arms in turn, as it always does on reference-only models."""
        # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
        from stagedspec.pipeline import Pipeline, SpeculationConfig

        spec = SpeculationConfig.tuned(method, self.quant, ngram="given" if self.ngram is not None else None)
        drafts = self.drafts if METHODS[method].uses_drafts else []
        pipe = Pipeline(self.model, self.tokenizer, drafts, spec, self.ngram)
        pipe.bit_exact = bit_exact
        profile = reference_profile() if every_arm else self.auto_profile
        if METHODS[method].always_measured and profile is not None:
            # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
            from stagedspec.auto import AutoPolicy, arms_for

            arms = arms_for(self.ngram is not None or spec.context, bool(drafts), self.device, has_context=spec.context)
            pipe.learned.set_policy("auto", AutoPolicy(arms, profile, learn_times=False))
        return pipe

    def release_models(self) -> None:
        """Drop the models (the tokenizer and n-gram stay): the fp32 reference of a 1.5B pair is 8 GB, and the
        serving models are loaded after it."""
        self.model, self.drafts = None, []


@contextlib.contextmanager
def _plain_matmuls() -> Iterator[None]:
    """Models loaded inside run every fp32 linear layer as `F.linear`, untimed (`models.matmul_plan`'s switch)."""
    import os

    before = os.environ.get(OFF_ENV)
    os.environ[OFF_ENV] = "off"
    try:
        yield
    finally:
        if before is None:
            del os.environ[OFF_ENV]
        else:
            os.environ[OFF_ENV] = before


def reference_profile() -> Any:
    """Prices for `auto` on reference-only models: every pass nearly free, so it takes every arm (lookup,
    trees, staged) in turn by acceptance alone rather than settling on one; a hand-made profile is never
    saved, so nothing learned here reaches the user's cache."""
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    from stagedspec.costs import CostProfile

    return CostProfile(oracle={1: 0.01, 64: 0.01}, drafts=[{1: 1e-4, 8: 1e-4}])


def methods_for(has_draft: bool) -> list[tuple[str, str | None]]:
    """(method, reason it is skipped or None) for every method, `ar` (the reference) first."""
    need = None if has_draft else "needs a draft model (--draft)"
    return [("ar", None), ("chain", need), ("tree", need), ("lookup", None), ("staged", need), ("auto", None)]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_check(cfg: CheckConfig, out: Callable[[str], None] = print) -> Report:
    """Run every part and return the report (the CLI prints its table)."""
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    from stagedspec.bench.prompts import chat_instruction, humaneval_prompts
    from stagedspec.pipeline import check_device, dtype_name, resolve_dtype

    check_device(cfg.device)
    serve_dtype, why = resolve_dtype(cfg.dtype, cfg.device, cfg.quant)
    budget = cfg.budget
    report = Report()
    t_start = time.perf_counter()

    serving_is_fp32 = serve_dtype == torch.float32 and cfg.quant == "none"
    fp32 = _Loaded(cfg, torch.float32, "none", None, reference_only=not serving_is_fp32)
    tok = fp32.tokenizer
    if cfg.ngram:
        # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
        from stagedspec.drafters.ngram_files import load_ngram

        fp32.ngram = load_ngram(cfg.ngram, tok)
    chat = bool(tok.chat_template)
    texts = [chat_instruction(p) if chat else p for p in humaneval_prompts(budget.prompts)]
    prompts = [tok.encode(tok.apply_chat_template(t) if chat else t) for t in texts]
    room = fp32.model.config.max_position - max(budget.new_tokens, budget.candidates) - 80  # 80: tree slack
    if any(len(ids) > room for ids in prompts):
        if room < 8:
            raise StagedSpecError(f"the oracle's context ({fp32.model.config.max_position} tokens) is too short "
                                  "for the check's prompts")
        prompts = [ids[-room:] for ids in prompts]
        report.notes.append(f"prompts cut to their last {room} tokens to fit the oracle's context")
    out(f"stagedspec check: oracle {cfg.oracle}, draft {cfg.draft or 'none'}, n-gram {cfg.ngram or 'none'} "
        f"(prompt lookup always); serving dtype {dtype_name(serve_dtype)}"
        f"{' with --quant ' + cfg.quant if cfg.quant != 'none' else ''} ({why}); "
        f"{len(prompts)} {'chat-formatted ' if chat else ''}HumanEval prompts x {budget.new_tokens} tokens; "
        f"{budget.samples} samples per sampling row")

    speeds = _greedy(report, fp32, "fp32", prompts, budget.new_tokens, cfg.draft is not None, bit_exact=False)
    serve = fp32
    if not serving_is_fp32:
        report.notes.append("fp32 is the reference here, not the serving dtype: its auto run priced every arm as "
                            "nearly free (each takes turns), and its speed was not measured")
        fp32.release_models()
        serve = _Loaded(cfg, serve_dtype, cfg.quant, fp32.ngram)
        label = dtype_name(serve_dtype) + (f"+{cfg.quant}" if cfg.quant != "none" else "") + " bit-exact"
        _greedy(report, serve, label, prompts, budget.new_tokens, cfg.draft is not None, bit_exact=True)
        speeds = _speed_runs(serve, prompts, budget.new_tokens, cfg.draft is not None)
    _speed_rows(report, speeds, dtype_name(serve_dtype) + (f"+{cfg.quant}" if cfg.quant != "none" else ""))

    configs = [SamplingParams(temperature=1.0)]
    if cfg.user_sampling != configs[0]:
        configs.append(cfg.user_sampling)
    context_tokens = _greedy_continuation(serve, prompts[0], budget.candidates)
    for sampling in configs:
        _sampling(report, serve, cfg, prompts[0], context_tokens, sampling, budget.samples)
    report.notes.append(f"total {time.perf_counter() - t_start:.1f} s")
    return report


def _greedy(report: Report, loaded: _Loaded, label: str, prompts: list[list[int]], new_tokens: int,
            has_draft: bool, bit_exact: bool) -> dict[str, float]:
    """Greedy rows of one dtype; returns tokens/s per method (measured on the same runs).

    A row also needs drafted tokens accepted: a method that drafted nothing, or whose every draft was
    rejected, emits `ar`'s tokens by construction, so its identity with `ar` would test nothing
    (`_drafts_used`)."""
    speeds: dict[str, float] = {}
    refs: list[list[int]] = []
    for method, skip in methods_for(has_draft):
        if skip:
            report.add("greedy", f"{method} = ar ({label})", "SKIP", skip)
            continue
        pipe = loaded.pipeline(method, bit_exact)
        results = [pipe.generate(ids, max_new_tokens=new_tokens) for ids in prompts]
        tokens = sum(r.stats.new_tokens for r in results)
        seconds = sum(r.stats.seconds for r in results)
        speeds[method] = tokens / seconds if seconds > 0 else 0.0
        if not METHODS[method].speculates:  # `ar`: the reference
            refs = [r.token_ids for r in results]
            continue
        rerun = ""
        if METHODS[method].always_measured and _drafts_used(results)[2] == 0:
            # `auto` chose `ar` on every step by this machine's costs: its arms are then run in turn (every
            # pass priced as nearly free), so that the identity covers what it would run elsewhere
            pipe = loaded.pipeline(method, bit_exact, every_arm=True)
            results = [pipe.generate(ids, max_new_tokens=new_tokens) for ids in prompts]
            rerun = "; auto chose ar on every step by this machine's costs, so its arms were run in turn"
        outs = [r.token_ids for r in results]
        bad = [(i, first_difference(o, r)) for i, (o, r) in enumerate(zip(outs, refs)) if o != r]
        same = len(prompts) - len(bad)
        accepted, steps, proposed = _drafts_used(results)
        mean = (accepted + steps) / steps if steps else 0.0
        detail = (f"{same}/{len(prompts)} prompts identical ({sum(len(o) for o in outs)} tokens); "
                  f"mean accepted length {mean:.2f}{rerun}")
        if bad:
            detail += "; first difference: " + ", ".join(f"prompt {i} token {j}" for i, j in bad)
        if accepted == 0:
            why = "none was proposed" if proposed == 0 else f"all {proposed} proposed were rejected"
            detail += (f"; no drafted token was accepted ({why}), so the outputs are ar's by construction "
                       "and this row tested nothing")
        report.add("greedy", f"{method} = ar ({label})", "PASS" if not bad and accepted > 0 else "FAIL", detail)
    return speeds


def _drafts_used(results: Sequence[Any]) -> tuple[int, int, int]:
    """(draft tokens accepted, oracle steps, draft tokens proposed) over `results`' runs."""
    accepted = sum(sum(r.stats.accepted_lengths) for r in results)
    steps = sum(len(r.stats.accepted_lengths) for r in results)
    proposed = sum(sum(r.stats.tree_sizes) for r in results)
    return accepted, steps, proposed


def _speed_runs(loaded: _Loaded, prompts: list[list[int]], new_tokens: int, has_draft: bool) -> dict[str, float]:
    speeds = {}
    for method, skip in methods_for(has_draft):
        if skip:
            continue
        pipe = loaded.pipeline(method)
        tokens, seconds = 0, 0.0
        for ids in prompts:
            res = pipe.generate(ids, max_new_tokens=new_tokens)
            tokens, seconds = tokens + res.stats.new_tokens, seconds + res.stats.seconds
        speeds[method] = tokens / seconds if seconds > 0 else 0.0
    return speeds


def _speed_rows(report: Report, speeds: dict[str, float], label: str) -> None:
    ar = speeds.get("ar", 0.0)
    for method, tps in speeds.items():
        ratio = f"{tps / ar:.2f}x ar" if ar > 0 else "-"
        report.add("speed", f"{method} ({label}, greedy)", "INFO", f"{tps:.1f} tok/s, {ratio} (a measurement, not a test)")


def _greedy_continuation(loaded: _Loaded, ids: list[int], n: int) -> list[int]:
    pipe = loaded.pipeline("ar")
    return pipe.generate(ids, max_new_tokens=n).token_ids


def _rows_along(model: Any, ids: list[int], continuation: list[int]) -> Tensor:
    """Next-token logits after ids + continuation[:j] for j = 0..len(continuation) (one pass over the chain)."""
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    from stagedspec.request import context_budget

    oracle = ModelOracle(model, context_budget(model, len(ids), len(continuation) + 1, len(continuation) + 1))
    oracle.prefill(ids)
    with torch.inference_mode():
        return oracle.score(TokenTree.chain(ids[-1], list(continuation))).float()


def _sampling(report: Report, loaded: _Loaded, cfg: CheckConfig, prompt: list[int], continuation: list[int],
              sampling: SamplingParams, n: int) -> None:
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    from stagedspec.request import context_budget
    from stagedspec.models.draft_formats import truncated_copy

    label = _sampling_label(sampling)
    method = "tree" if loaded.drafts else "lookup"
    if loaded.drafts:
        q_model, q_name = loaded.drafts[0], "the draft"
    elif loaded.model.config.n_layers >= 2:
        q_model, q_name = truncated_copy(loaded.model, 1), "the oracle's first layer (no draft given)"
    else:
        q_model, q_name = None, ""

    # The context: the position of prompt 0's greedy continuation where the control's bias is largest
    # among those where the oracle is not nearly certain (a near-one-hot p can hide no bias).
    p_rows = _rows_along(loaded.model, prompt, continuation)
    q_rows = _rows_along(q_model, prompt, continuation) if q_model is not None else None
    best = (-1.0, 0, None, None)
    for j in range(len(continuation) + 1):
        p = probs_from_logits(p_rows[j], sampling).double()
        if q_rows is None:
            score = float(1 - p.max())
            best = max(best, (score, j, None, None), key=lambda b: b[0])
            continue
        q = probs_from_logits(q_rows[j], sampling).double()
        top = q.topk(min(CONTROL_BRANCHES, int((q > 0).sum()))).indices.tolist()
        tv = 0.5 * float((wrong_q_distribution(p, top, q) - p).abs().sum())
        score = tv if float(p.max()) < 0.9 else tv * 1e-3
        if score > best[0]:
            best = (score, j, top, q)
    _, j, top, q = best
    context = prompt + continuation[:j]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the samples are small-tensor work: one thread avoids barrier costs
    try:
        max_len = context_budget(loaded.model, len(context), 4, loaded.pipeline(method).speculation.max_tree_budget)
        real_oracle = _ReusedOracle(ModelOracle(loaded.model, max_len))
        drafter = _ReusedDrafter(loaded.pipeline(method).drafter(max_len))
        t0 = time.perf_counter()
        counts, first_tree = _draw_first_tokens(real_oracle, drafter, context, sampling, n, _real_verifier)
        seconds = time.perf_counter() - t0
        p = probs_from_logits(real_oracle.memo[next(iter(real_oracle.memo))][0], sampling).double()
        pvalue, df, _ = chi_square(counts, p)
        tv = detectable_tv(n, df)
        status = "PASS" if pvalue > ALPHA else "FAIL"
        shape = (f"tree of {len(first_tree) - 1} nodes, {len(first_tree.children(0))} at the root"
                 if first_tree is not None else "")
        report.add("sampling", f"{method} first token ~ p ({label})", status,
                   f"chi-square p = {pvalue:.3g} (df {df}, alpha {ALPHA:g}); N = {n} detects TV >= {tv:.3f} "
                   f"with power {POWER:g}; context of {len(context)} tokens, {shape}; "
                   f"{real_oracle.forward_passes} oracle passes, {seconds:.1f} s")

        if q_model is None:
            report.add("control", f"wrong-q verifier ({label})", "NO POWER",
                       "no draft and a one-layer oracle: nothing to take a q from; the sampling row's power "
                       "is not demonstrated on this pair")
            return
        control_oracle = _ReusedOracle(ModelOracle(loaded.model, max_len))
        biased = wrong_q_distribution(p, top, q)
        true_tv = 0.5 * float((biased - p).abs().sum())
        predicted = power_against(p, biased, n)
        t0 = time.perf_counter()
        ccounts, _ = _draw_first_tokens(control_oracle, _ControlDrafter(top, q.float()), context, sampling, n,
                                        wrong_q_verifier)
        cp, cdf, _ = chi_square(ccounts, p)
        flagged = cp < ALPHA
        detail = (f"chi-square p = {cp:.3g} (df {cdf}); its bias here: TV {true_tv:.3f} (predicted power "
                  f"{predicted:.2f}); q from {q_name}, top-{len(top)} at the root; {time.perf_counter() - t0:.1f} s")
        if not flagged:
            detail += ("; the control was NOT caught, so this pair and context give the sampling row no "
                       "demonstrated power against this mistake (raise N, or a sharper draft/oracle pair)")
        report.add("control", f"wrong-q verifier ({label})", "FLAGGED" if flagged else "NO POWER", detail)
    finally:
        torch.set_num_threads(threads)


def _draw_first_tokens(oracle: Any, drafter: Any, context: list[int], sampling: SamplingParams, n: int,
                       verifier: Callable) -> tuple[Counter, TokenTree | None]:
    """The first emitted token of one step of the real loop, for seeds 0..n-1."""
    # deferred: the CLI's parser loads this module (cli.check); a check's stack loads when it runs
    from stagedspec.generation import iter_steps

    counts: Counter = Counter()
    first_tree = None
    with torch.inference_mode():
        for seed in range(n):
            step = next(iter_steps(oracle, drafter, context, max_new_tokens=4, sampling=sampling, seed=seed,
                                   verifier=verifier))
            counts[step[0]] += 1
            if first_tree is None:
                first_tree = getattr(oracle, "last_tree", None)
    return counts, first_tree


def _sampling_label(s: SamplingParams) -> str:
    parts = [f"T={s.temperature:g}"]
    if s.top_k:
        parts.append(f"top-k {s.top_k}")
    if s.top_p < 1:
        parts.append(f"top-p {s.top_p:g}")
    return ", ".join(parts)
