"""Measuring what a forward pass costs on this machine, by row count (`CostProfile`), and caching it.

Runs the models as the decoding loop runs them: tree passes over a cached
context, ragged passes of several segments, a step's verification and a
draft's tree growth.  `stagedspec.costs` holds the data this produces, and
`auto` prices with that data alone.  Measured once per models and machine,
cached (`load_or_measure`); `stagedspec tune` re-measures.
"""

from __future__ import annotations

import hashlib
import math
import sys
import threading
import time
from typing import Mapping, Sequence

import torch

from stagedspec import costs, hardware
from stagedspec.costs import CostProfile, VERIFY_ROWS, interpolate, monotone
from stagedspec.drafters.model import ModelDrafter
from stagedspec.kernels import native
from stagedspec.models.pass_spec import PassSpec
from stagedspec.models.quant import kernel_name
from stagedspec.models.ragged import Segment, forward_ragged
from stagedspec.models.transformer import Transformer
from stagedspec.paths import write_text_atomic
from stagedspec.runner import ModelOracle, StaticRunner, is_compiled, pass_mode, runner_capacity, wants_fixed_width
from stagedspec.sampling import SamplingParams
from stagedspec.threads import SPARE_CPU
from stagedspec.tree import TokenTree
from stagedspec.verification import verify

# Row counts measured on each kind of device (a GPU's curve stays flat much longer).  The larger ones are
# the loads of the batched server's shared passes, where `auto` prices a request's rows by the curve's slope
# there (`stagedspec.auto.SharedLoad`); a solo run's trees stay within the first ones.
CPU_ORACLE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
CUDA_ORACLE_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
DRAFT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
RAGGED_SEGMENTS = 8  # segments of the ragged pass timed for the per-segment cost
MIN_REPEATS, SECONDS_PER_SHAPE = 2, 0.5  # a shape is timed `repeats` times, or as often as fits in this


def _tree_mask(rows: int) -> tuple[torch.Tensor, list[int]]:
    """A bushy tree's mask and depths: node i's parent is (i - 1) // 2, like a binary tree."""
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    depth = [0] * rows
    for i in range(rows):
        mask[i, i] = True
        if i > 0:
            parent = (i - 1) // 2
            mask[i] |= mask[parent]
            depth[i] = depth[parent] + 1
    return mask, depth


def forward_cost_curve(
    model: Transformer,
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 24, 32, 48, 64),
    context: int = 256,
    repeats: int = 7,
    fixed_width: bool | None = None,
) -> dict[int, float]:
    """Seconds of one forward of n tree nodes on top of `context` cached tokens (fastest of `repeats`).

    `fixed_width` (default: as `ModelOracle` runs the model) times passes over
    the whole cache's key width, with a throwaway second row when n = 1 (see
    `ModelOracle.score`); draft stages run with `fixed_width=False`.
    """
    device = model.embed.weight.device
    context = max(1, min(context, model.config.max_position - max(sizes) - 2))
    cache = model.new_cache(context + max(sizes) + 1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict[int, float] = {}
    fixed = wants_fixed_width(model) if fixed_width is None else fixed_width

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    runner = None
    if pass_mode(model) != "eager":  # time the static-shape passes (CUDA graphs) the loop runs
        runner = StaticRunner(model, runner_capacity(context + max(sizes) + 1), graphs=pass_mode(model) == "graphs",
                              min_rows=2 if fixed and device.type == "cpu" else 1)
        cache = runner.cache
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
        if runner is not None:
            runner.run(prompt[0].tolist(), torch.arange(context), None, logits_rows=slice(-1, None))
        else:
            model(prompt, torch.arange(context, device=device), cache, PassSpec(logits_rows=slice(-1, None)))
        cache.commit()
        for n in sizes:
            rows = max(n, 2) if fixed and runner is None else n
            toks = torch.randint(0, vocab, (1, rows), generator=g).to(device)
            mask, depth = _tree_mask(rows)
            pos = torch.tensor(depth, device=device) + context
            times: list[float] = []
            wanted = repeats + 1
            r = 0
            while r < wanted:  # the first pass of a new shape warms caches and kernels
                sync()
                t = time.perf_counter()
                if runner is not None:
                    runner.run(toks[0].tolist(), pos.cpu(), mask, logits_rows=slice(0, n))
                else:
                    model(toks, pos, cache, PassSpec(tree_mask=mask.to(device) if rows > 1 else None,
                                                     logits_rows=slice(0, n), key_width=cache.max_len if fixed else None))
                sync()
                if r:
                    times.append(time.perf_counter() - t)
                    if r == 1:  # slow shapes (a big model's wide passes) take fewer repeats: the whole stays seconds
                        wanted = 1 + max(MIN_REPEATS, min(repeats, int(SECONDS_PER_SHAPE / max(times[0], 1e-9))))
                r += 1
                cache.discard()
            out[n] = min(times)
    return monotone(out)


def ragged_segment_cost(model: Transformer, context: int = 256, segments: int = RAGGED_SEGMENTS, rows: int = 2,
                        repeats: int = 5, fixed_width: bool | None = None) -> float:
    """Seconds one more request's segment adds to a ragged pass (`stagedspec.models.ragged`) beyond its rows.

    A segment has its own attention call per layer against its own cache, and the work around it; the
    cost curves (one sequence) do not see that.  Times `segments` segments of `rows` rows each against one
    segment of all those rows (same rows, same cache length and key width), fastest of `repeats`, and
    returns the difference per extra segment (0 where ragged passes do not run: static passes, or an error).
    """
    if pass_mode(model) != "eager" or segments < 2:
        return 0.0
    device = model.embed.weight.device
    total = segments * rows
    context = max(1, min(context, model.config.max_position - total - 2))
    cache = model.new_cache(context + total + 1)
    fixed = wants_fixed_width(model) if fixed_width is None else fixed_width
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def seg(n: int) -> Segment:
        toks = torch.randint(0, vocab, (1, n), generator=g).to(device)
        mask, depth = _tree_mask(n)
        return Segment(toks, torch.tensor(depth, device=device) + context, cache,
                       PassSpec(tree_mask=mask.to(device), key_width=cache.max_len if fixed else None))

    try:
        with torch.inference_mode():
            prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
            model(prompt, torch.arange(context, device=device), cache, PassSpec(logits_rows=slice(-1, None)))
            cache.commit()
            best = {"one": math.inf, "many": math.inf}
            shapes = {"one": [seg(total)], "many": [seg(rows) for _ in range(segments)]}
            for r in range(2 * repeats + 1):  # alternating, so that both shapes see the same machine
                for key, parts in shapes.items():  # every segment reserves the same slots: the cost, not the result
                    sync()
                    t = time.perf_counter()
                    forward_ragged(model, parts)
                    sync()
                    if r:
                        best[key] = min(best[key], time.perf_counter() - t)
                    cache.discard()
    except Exception:  # noqa: BLE001 - a model ragged passes cannot run: no segment cost to price
        return 0.0
    return max(0.0, (best["many"] - best["one"]) / (segments - 1))


def model_fingerprint(model: Transformer) -> str:
    """A short key for 'the same weights in the same format' (config, dtype, quantisation, weight samples, the
    fp32 kernel plan, and the native path that runs quantised layers)."""
    h = hashlib.sha256(repr(sorted(vars(model.config).items())).encode())
    h.update(str(model.embed.weight.dtype).encode())
    h.update(str(model.quantised).encode())
    h.update(str(len(model.layers)).encode())
    if model.head_q is not None:  # int4, int8, or int8 up to some rows (`draft_weights`)
        kinds = {f"{type(m).__name__}:{getattr(m, 'max_rows', '')}" for m in model.modules()}
        h.update(repr(sorted(kinds)).encode())
    if model.subset_ids is not None:  # a head over part of the vocabulary (`--draft-vocab`) costs less
        h.update(f"subset={model.subset_ids.numel()}".encode())
    sample = model.embed.weight.detach().flatten()[:512].float().cpu()
    h.update(sample.numpy().tobytes())
    # Drafts distilled from one oracle share its config and embedding: a sample of their last layer tells them
    # apart (else two rounds of a draft would share a profile and what `auto` learned of the other's acceptance).
    for tensor in model.layers[-1].state_dict().values():
        h.update(tensor.detach().flatten()[:64].float().cpu().numpy().tobytes())
    plan = model.runtime.matmul_plan_signature  # fp32 CPU: which kernel runs which passes
    if plan is not None:
        h.update(f"plan={plan}".encode())
    # Which native path runs the quantised layers: on one CPU the 256-bit VNNI tiles and their 512-bit pairs
    # (chosen at load by `native.wide_vnni_pays`, or forced by STAGEDSPEC_QKERNELS) cost differently by rows.
    name = kernel_name(model)
    h.update(f"kernels={name}".encode())
    if name.startswith("stagedspec-native"):  # and which build of them: a change to the kernels re-measures
        h.update(native.build_dir().name.encode())
    return h.hexdigest()[:16]


def profile_key(oracle: Transformer, drafts: Sequence[Transformer], device: str) -> str:
    """The cache key: the models, their dtype and format, the device, the thread count, the machine."""
    parts = [model_fingerprint(oracle), *(model_fingerprint(d) for d in drafts), device,
             hardware.fingerprint(device)]
    if pass_mode(oracle) != "eager":  # static passes and CUDA graphs cost differently (`stagedspec.runner`)
        parts.append(pass_mode(oracle) + ("+compiled" if is_compiled(oracle) else ""))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


class OthersLoad:
    """CPUs' worth of other processes' work since construction (0.0 where `/proc/stat` is not readable)."""

    def __init__(self) -> None:
        # deferred: looked up at each call, so a test's stand-in for threads.allowed_cpus/read_busy_seconds is used
        from stagedspec.threads import allowed_cpus, read_busy_seconds

        self._cpus, self._read = allowed_cpus(), read_busy_seconds
        self._start = (time.perf_counter(), self._read(self._cpus), time.process_time())

    def since_start(self) -> float:
        wall0, busy0, own0 = self._start
        busy = self._read(self._cpus)
        wall = time.perf_counter() - wall0
        if busy is None or busy0 is None or wall <= 0:
            return 0.0
        return max(0.0, ((busy - busy0) - (time.process_time() - own0)) / wall)


def measure_profile(oracle: Transformer, drafts: Sequence[Transformer], device: str, *, repeats: int = 5,
                    quiet: bool = False) -> CostProfile:
    """Time the oracle's and every draft's passes by row count, as the loop runs them (a few seconds)."""
    if not quiet:
        print(f"stagedspec: measuring pass costs on {hardware.describe(device)} (once; cached)...",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    load = OthersLoad()
    rows = CUDA_ORACLE_ROWS if device.startswith("cuda") else CPU_ORACLE_ROWS
    oracle_curve = forward_cost_curve(oracle, sizes=rows, context=256, repeats=repeats)
    draft_curves = [forward_cost_curve(d, sizes=DRAFT_ROWS, context=256, repeats=repeats, fixed_width=False)
                    for d in drafts]
    overhead = draft_pass_overhead(drafts[0], draft_curves[0], repeats=repeats) if drafts else {}
    # A segment's own work cannot cost more than a whole one-row pass (a noisy machine can make it look so).
    segment = [min(ragged_segment_cost(oracle, repeats=repeats), oracle_curve[min(oracle_curve)])]
    segment += [min(ragged_segment_cost(d, repeats=repeats, fixed_width=False), c[min(c)])
                for d, c in zip(drafts, draft_curves)]
    verify = verify_step_overhead(oracle, repeats=repeats)
    return CostProfile(oracle_curve, draft_curves, hardware.describe(device), profile_key(oracle, drafts, device),
                       time.perf_counter() - t0, overhead, segment, verify, load.since_start())


def verify_step_overhead(oracle: Transformer, repeats: int = 5) -> dict[str, list[float]]:
    """Host seconds of a step's verification beyond the oracle's pass, at `VERIFY_ROWS` rows.

    Runs the loop's own calls (`ModelOracle.score`, then `verify` and
    `commit`) on chains of random tokens, greedy and sampled (T=1, top-k 50),
    over the curve's 256-token context, and times what follows the pass:
    reading the decisions back and, at T > 0, each row's softmax, top-k and
    draws.  The fastest of `repeats`.  Why: `auto` priced a step as its pass
    alone, so on a GPU at T=1 a tree whose verification cost more than `ar`'s
    looked as cheap as `ar` (docs/measurements.md, "Verification overhead on an H100 at T=1").
    An earlier form subtracted the curve from a whole step timed over a shorter
    context; on a CPU that came out below zero and priced a sampled row's host
    work at nothing
    (docs/measurements.md, "Verification host work as a step less the curve on an AVX2 EPYC").
    """
    g = torch.Generator().manual_seed(2)
    vocab = oracle.config.vocab_size
    steps = repeats + 1
    context = max(2, min(256, oracle.config.max_position - steps * max(VERIFY_ROWS) - 2))
    on_gpu = oracle.embed.weight.device.type == "cuda"
    out: dict[str, list[float]] = {}
    with torch.inference_mode():
        for key, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=1.0, top_k=50))):
            points = []
            for rows in VERIFY_ROWS:
                runner = ModelOracle(oracle, context + steps * rows + 2)
                runner.prefill(torch.randint(0, vocab, (context,), generator=g).tolist())
                root = int(torch.randint(0, vocab, (), generator=g))
                best = math.inf
                for i in range(steps):  # the first step runs the context and warms this shape up
                    tree = TokenTree.chain(root, torch.randint(0, vocab, (rows - 1,), generator=g).tolist())
                    scores = runner.score(tree)
                    if on_gpu:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    result = verify(tree, scores, sampling, g)
                    runner.commit(result.accepted)
                    seconds = time.perf_counter() - t
                    root = result.next_token
                    if i:
                        best = min(best, seconds)
                points.append(best)
            out[key] = points
    return out


def draft_pass_overhead(draft: Transformer, curve: Mapping[int, float], repeats: int = 5) -> dict[str, float]:
    """Host seconds per draft pass beyond the pass itself, when the draft grows small trees.

    Times real tree proposals (8 nodes, depth 4, as `auto`'s tree arms grow
    them), greedy and sampled (T=1, top-k 50), one new context token each
    time, and subtracts the passes' cost from `curve`; the fastest of
    `repeats`.
    """
    g = torch.Generator().manual_seed(1)
    vocab = draft.config.vocab_size
    out = {}
    with torch.inference_mode():
        for key, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=1.0, top_k=50))):
            # over the curve's 256-token context: a shorter one made the passes cheaper than the curve says,
            # and the host work came out too small
            length = max(2, min(256, draft.config.max_position - repeats - 16))
            drafter = ModelDrafter(draft, method="tree", tree_budget=8, max_depth=4, branching=2,
                                   max_len=length + repeats + 16)
            context = torch.randint(0, vocab, (length,), generator=g).tolist()
            drafter.begin(context)
            drafter.propose(context, sampling, g, 8)  # the context's own catch-up pass, not timed
            best = math.inf
            for _ in range(repeats):
                context.append(int(torch.randint(0, vocab, (), generator=g)))
                passes = drafter.forward_passes
                t = time.perf_counter()
                drafter.propose(context, sampling, g, 8)
                seconds = time.perf_counter() - t
                passes = drafter.forward_passes - passes
                best = min(best, max(0.0, seconds - passes * interpolate(curve, 3)) / max(1, passes))
            out[key] = best
    return out


# One measurement at a time in a process.  The server's first requests arrive together, each on a thread of its
# own: without this, each could measure a profile of its own (timings differ run to run), one on disk and others
# in memory, and a seeded request priced by one in memory could choose other arms than the same request run
# alone against the file.  The first caller measures and writes; the others wait and read what it wrote.
_MEASURING = threading.Lock()


def load_or_measure(oracle: Transformer, drafts: Sequence[Transformer], device: str, *, remeasure: bool = False,
                    quiet: bool = False) -> CostProfile:
    """The cached profile for these models on this machine, measuring (and caching) it when missing."""
    key = profile_key(oracle, drafts, device)
    path = costs.profile_path(key)  # through the module: one place says where profiles live
    with _MEASURING:
        if not remeasure and path.exists():
            try:
                return CostProfile.from_json(path.read_text())
            except (ValueError, KeyError, TypeError, OSError):
                pass  # a corrupt or old cache entry is simply measured again
        profile = measure_profile(oracle, drafts, device, quiet=quiet)
        if profile.others_load >= SPARE_CPU:
            if not quiet:
                print(f"stagedspec: other processes kept {profile.others_load:.1f} CPUs busy while pass costs were "
                      "measured; using them for this run only (measured again next time)", file=sys.stderr)
            return profile
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, profile.to_json())  # processes measuring at once never share a temporary
        except OSError as e:  # a read-only cache folder costs a re-measure next time, nothing else
            if not quiet:
                print(f"stagedspec: could not cache the cost profile in {path.parent}: {e}", file=sys.stderr)
        return profile


def print_cost_curve(curve: Mapping[int, float]) -> None:
    base = curve[min(curve)]
    print("rows  ms/forward  cost vs 1 row")
    for n, secs in sorted(curve.items()):
        print(f"{n:4d}  {1000 * secs:10.2f}  {secs / base:6.2f}x")
