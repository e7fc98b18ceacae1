"""Static-shape passes: a few fixed row counts, device-side cache writes, and CUDA graphs of them.

Why: at batch size 1 a small model's pass costs far more than its kernels.
On a GPU, one eager SmolLM2-135M pass launches about 900 kernels and takes
18 ms whatever its row count, while the same pass replayed as a CUDA graph
takes 2.3 ms (issue 12).  A graph fixes every shape and every address, so a
pass must not depend on where in the cache it runs or how many rows it has:

- rows are padded up to a *bucket* (1, 2, 4, ..., 64); padding rows see the
  committed prefix and themselves, write their keys/values past the pending
  ones (into the cache's spare slots at worst) and are never kept;
- the key width is the cache's whole slot count, every pass;
- tokens, positions, write slots and the attention mask are copied into
  preallocated device buffers, two host-to-device copies per pass;
- the keys/values are written with `index_copy_` at device-side slots
  (`Transformer.forward_static`), so one captured pass serves every position.

`StaticRunner` owns those buffers, one cache, and one graph per bucket,
captured at first use.  Graphs bake in addresses, so runners are pooled per
model and reused by later requests (`acquire_runner`): the capture cost
(about 0.1-0.3 s per bucket) is paid once per process, not per request.

The mode of a model's passes is a property of the loaded model
(`set_pass_mode`): "eager" (the CPU default: the original variable-shape
path), "static" (this path without graphs: the same arithmetic, which is how
the CPU suites test it) and "graphs" (the CUDA default).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Sequence

import torch
from torch import Tensor

from stagedspec.models.transformer import Transformer

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows of a static pass; a pass over more rows runs eagerly, unpadded
PASS_MODES = ("eager", "static", "graphs")
MIN_CAPACITY = 256  # the smallest cache a pooled runner holds (capacities are powers of two from here)
POOL_LIMIT = 8  # runners kept per model (one per concurrent request or stage, per capacity)


_cuda_graphs = os.environ.get("STAGEDSPEC_CUDA_GRAPHS", "1") not in ("0", "false", "no", "off")


def use_cuda_graphs(enabled: bool) -> None:
    """`--cuda-graphs` / `--no-cuda-graphs`: whether CUDA models' static passes are replayed as graphs.

    Applies to models whose mode was not set explicitly (`set_pass_mode`);
    the environment variable STAGEDSPEC_CUDA_GRAPHS=0 sets the same default.
    """
    global _cuda_graphs
    _cuda_graphs = bool(enabled)


def pass_mode(model: Transformer) -> str:
    """How `model`'s passes run: "eager", "static" or "graphs" (see the module docstring).

    Unless set with `set_pass_mode`: "graphs" on CUDA ("static" with CUDA
    graphs turned off), "eager" on the CPU.
    """
    mode = model.__dict__.get("_pass_mode")
    return mode if mode is not None else default_pass_mode(str(model.embed.weight.device))


def set_pass_mode(model: Transformer, mode: str) -> None:
    """Choose how the oracle and drafters run `model`'s passes from now on (pooled runners are dropped)."""
    if mode not in PASS_MODES:
        raise ValueError(f"unknown pass mode {mode!r}: use one of {', '.join(PASS_MODES)}")
    if mode == "graphs" and model.embed.weight.device.type != "cuda":
        mode = "static"  # CUDA graphs need CUDA; the static path is the same arithmetic
    model.__dict__["_pass_mode"] = mode
    model.__dict__["_runner_pool"] = []


_static_on_cpu = False


def use_static_on_cpu(enabled: bool) -> None:
    """`--static-passes`: CPU models (mode not set explicitly) run the static-shape path too."""
    global _static_on_cpu
    _static_on_cpu = bool(enabled)


def default_pass_mode(device: str) -> str:
    """CUDA: static passes replayed as graphs (static with eager launches under `--no-cuda-graphs`); CPU: eager
    (static under `--static-passes`)."""
    if str(device).startswith("cuda"):
        return "graphs" if _cuda_graphs else "static"
    return "static" if _static_on_cpu else "eager"


def set_compiled(model: Transformer, enabled: bool = True) -> None:
    """`--compile`: run `model`'s static passes through `torch.compile` (inductor, one graph per bucket).

    Inductor fuses the norms, RoPE, SiLU and casts that otherwise cost one
    kernel (and, without a CUDA graph, one dispatch) each.  Compiling takes
    tens of seconds per bucket the first time; inductor keeps what it built in
    its on-disk cache (TORCHINDUCTOR_CACHE_DIR), so later processes pay far
    less.  A compile that fails falls back to the uncompiled pass.
    """
    model.__dict__["_compiled"] = bool(enabled)
    model.__dict__.pop("_compiled_forward", None)


_compile_default = False


def use_compile(enabled: bool) -> None:
    """`--compile`: compile the static passes of every model whose choice was not set (`set_compiled`)."""
    global _compile_default
    _compile_default = bool(enabled)


def is_compiled(model: Transformer) -> bool:
    """Whether `model`'s static passes go through `torch.compile` (`set_compiled`, `--compile`)."""
    return bool(model.__dict__.get("_compiled", _compile_default))


def _static_forward(model: Transformer):  # noqa: ANN202 - the model's static pass, compiled when asked
    if not is_compiled(model):
        return model.forward_static
    compiled = model.__dict__.get("_compiled_forward")
    if compiled is None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        compiled = torch.compile(model.forward_static, dynamic=False)
        model.__dict__["_compiled_forward"] = compiled
    return compiled


class StaticRunner:
    """A model's static-shape passes over one KV cache, replayed as CUDA graphs when asked."""

    def __init__(self, model: Transformer, max_len: int, *, graphs: bool = False, min_rows: int = 1) -> None:
        """`max_len`: cache entries a request may keep; `min_rows`: the smallest bucket (2 keeps every
        CPU bf16 pass multi-row, see `ModelOracle`)."""
        self.model = model
        self.buckets = tuple(b for b in BUCKETS if b >= min_rows) or (BUCKETS[-1],)
        self.min_rows = min_rows
        rows = self.buckets[-1]
        self.cache = model.new_cache(max_len, spare=rows)
        self.device = model.embed.weight.device
        slots = self.cache.slots
        self.index = torch.zeros(3, rows, dtype=torch.long, device=self.device)  # tokens, positions, slots
        self.mask = torch.zeros(rows, slots, dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        self._host_index = torch.zeros(3, rows, dtype=torch.long, pin_memory=pin)
        self._host_mask = torch.zeros(rows, slots, dtype=torch.bool, pin_memory=pin)
        self.use_graphs = graphs and self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Tensor] = {}
        self._pool = None
        self._copied: torch.cuda.Event | None = None  # marks the last host-to-device copies (pinned buffers)
        self.busy = False

    @property
    def capacity(self) -> int:
        return self.cache.max_len

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`, or None (the pass then runs eagerly at its own size)."""
        return next((b for b in self.buckets if b >= rows), None)

    def release(self) -> None:
        self.busy = False

    def run(self, tokens: Sequence[int], positions: Sequence[int] | Tensor, mask: Tensor | None,
            logits_rows: slice | None = None) -> Tensor:
        """Run `tokens` on top of the committed cache; returns logits [T', V] of `logits_rows`.

        `positions` [T] and `mask` as `Transformer.forward` takes them (None:
        causal; [T, T]: among the new tokens, which also see the whole
        prefix; [T, cached + T]: the complete mask).  The new entries are the
        cache's pending ones, as with the eager forward.  More rows than the
        biggest bucket (a prompt) run as several bucket passes, each seeing
        the chunks before it.
        """
        T = len(tokens)
        start = self.cache.reserve(T)
        full = self._full_mask(T, start, mask)
        pos = torch.as_tensor(positions, dtype=torch.long).cpu()
        toks = torch.as_tensor(tokens, dtype=torch.long)
        wanted = range(T)[logits_rows] if logits_rows is not None else range(T)
        if not wanted:
            raise ValueError(f"logits_rows {logits_rows} selects none of {T} rows")
        step = self.buckets[-1]
        outs = []
        for r0 in range(0, T, step):
            r1 = min(T, r0 + step)
            lo, hi = max(r0, wanted.start), min(r1, wanted.stop)
            out = self._pass(toks[r0:r1], pos[r0:r1], full[r0:r1], start + r0)
            if lo < hi:
                outs.append(out[lo - r0:hi - r0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _full_mask(T: int, start: int, mask: Tensor | None) -> Tensor:
        """The host mask [T, start + T] of a pass (see `run` for the forms `mask` takes)."""
        end = start + T
        if mask is not None and mask.shape[-1] == end:
            return mask.to(device="cpu", dtype=torch.bool)
        full = torch.zeros(T, end, dtype=torch.bool)
        full[:, :start] = True
        full[:, start:] = torch.ones(T, T, dtype=torch.bool).tril_() if mask is None else mask.cpu()
        return full

    def _pass(self, tokens: Tensor, positions: Tensor, mask: Tensor, first_slot: int) -> Tensor:
        """One bucket pass of n <= max-bucket rows written from `first_slot`; logits [n, V]."""
        n = len(tokens)
        rows = self.bucket(n)
        assert rows is not None
        if self._copied is not None:  # the last pass's host-to-device copies must be done with the buffers
            self._copied.synchronize()
        index, host_mask = self._host_index[:, :rows], self._host_mask[:rows]
        host_mask.zero_()
        index[0, :n] = tokens
        index[0, n:] = 0
        index[1, :n] = positions
        index[1, n:] = positions[-1]  # a valid position: never past the RoPE table
        torch.arange(first_slot, first_slot + rows, out=index[2])
        host_mask[:n, :mask.shape[-1]] = mask
        if rows > n:  # padding rows: what precedes this pass, and themselves, so no softmax row is empty
            host_mask[n:, :first_slot] = True
            pad = torch.arange(n, rows)
            host_mask[pad, first_slot + pad] = True
        cuda = self.device.type == "cuda"
        self.index[:, :rows].copy_(index, non_blocking=cuda)
        self.mask[:rows].copy_(host_mask, non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if self.use_graphs:
            graph = self.graphs.get(rows) or self._capture(rows)
            if graph is not None:
                graph.replay()
                return self._outputs[rows][0, :n].clone()
        return self._forward(self.index[0:1, :rows], self.index[1, :rows], self.index[2, :rows],
                             self.mask[:rows], self.cache)[0, :n]

    def _forward(self, *args) -> Tensor:  # noqa: ANN002
        """The static pass, compiled under `--compile`; a failed compile falls back to the plain one."""
        forward = _static_forward(self.model)
        if forward is self.model.forward_static:
            return forward(*args)
        try:
            return forward(*args)
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported op: run uncompiled
            set_compiled(self.model, False)
            print(f"stagedspec: torch.compile failed ({type(exc).__name__}); running uncompiled passes",
                  file=sys.stderr)
            return self.model.forward_static(*args)

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        """Record bucket's pass as a CUDA graph (its inputs are already in place); None if capture fails."""
        args = (self.index[0:1, :bucket], self.index[1, :bucket], self.index[2, :bucket], self.mask[:bucket],
                self.cache)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up passes (lazy inits, autotuning) off the capture
                for _ in range(2):
                    self._forward(*args)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[bucket] = self._forward(*args)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager launches
            self.use_graphs = False
            print(f"stagedspec: CUDA graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                  "running passes eagerly", file=sys.stderr)
            return None
        self.graphs[bucket] = graph
        return graph


_POOL_LOCK = threading.Lock()


def runner_capacity(max_len: int) -> int:
    """The cache size a pooled runner holds for `max_len` entries: the next power of two >= 256.

    Exact-size matches only (never a bigger free runner): a pass's key width
    is the cache size, so equal requests must get equal widths to compute
    equal numbers.
    """
    cap = MIN_CAPACITY
    while cap < max_len:
        cap *= 2
    return cap


def acquire_runner(model: Transformer, max_len: int, owner: object, *, min_rows: int = 1) -> StaticRunner:
    """A free pooled runner of `model` with room for `max_len` entries, leased until `owner` is collected."""
    mode = pass_mode(model)
    cap = runner_capacity(max_len)
    with _POOL_LOCK:
        pool: list[StaticRunner] = model.__dict__.setdefault("_runner_pool", [])
        runner = next((r for r in pool if not r.busy and r.capacity == cap and r.min_rows == min_rows), None)
        if runner is None:
            runner = StaticRunner(model, cap, graphs=mode == "graphs", min_rows=min_rows)
            if len(pool) >= POOL_LIMIT:  # make room: forget a free runner (of another size)
                idle = next((r for r in pool if not r.busy), None)
                if idle is not None:
                    pool.remove(idle)
            if len(pool) < POOL_LIMIT:
                pool.append(runner)
        runner.busy = True
    runner.cache.reset()
    weakref.finalize(owner, runner.release)
    return runner
