"""The model runner: `ModelOracle` (the oracle, and every draft stage) and its static-shape passes.

`ModelOracle` runs a `Transformer` over its own KV cache for the decoding
loop (`stagedspec.generation`).  Its passes run eagerly at their own shapes
(the CPU default) or through `StaticRunner`: a few fixed row counts,
device-side cache writes, and CUDA graphs of them.

Why: at batch size 1 a small model's pass costs far more than its kernels.
On a GPU, one eager SmolLM2-135M pass launches hundreds of kernels and takes
the same time whatever its row count, while the same pass replayed as a CUDA
graph takes a fraction of it (docs/measurements.md, "Eager passes against CUDA graphs on an H100").
A graph fixes every shape and every address, so a
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
is paid once per process, not per request.

The mode of a model's passes is a property of the loaded model: the
`PassOptions` it was loaded with (`stagedspec.pass_options`; the CLI's
`--cuda-graphs`, `--static-passes`, `--compile`), held with its pool of
runners in `Transformer.runtime.passes`, and changed with `set_pass_mode`:
"eager" (the CPU default: the original variable-shape path), "static" (this
path without graphs: the same arithmetic, which is how the CPU suites test
it) and "graphs" (the CUDA default).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from stagedspec.cache import KVCache
from stagedspec.models.feature_draft import is_feature_draft
from stagedspec.models.pass_spec import PLAIN, PassSpec
from stagedspec.models.quant import row_exact
from stagedspec.models.transformer import Transformer, decoding_mode
from stagedspec.tree import TokenTree

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows of a static pass; more rows run as several passes of the biggest
MIN_CAPACITY = 256  # the smallest cache a pooled runner holds (capacities are powers of two from here)
POOL_LIMIT = 8  # runners kept per model (one per concurrent request or stage, per capacity)


def pass_mode(model: Transformer) -> str:
    """How `model`'s passes run: "eager", "static" or "graphs" (see the module docstring).

    The mode its options name (`set_pass_mode`, or the options it was loaded
    with), else its device's default: "graphs" on CUDA ("static" with CUDA
    graphs turned off), "eager" on the CPU ("static" with static passes on).
    """
    return model.runtime.passes.options.mode_on(model.embed.weight.device)


def set_pass_mode(model: Transformer, mode: str) -> None:
    """Choose how the oracle and drafters run `model`'s passes from now on (pooled runners are dropped)."""
    runtime = model.runtime.passes
    options = replace(runtime.options, mode=mode)  # an unknown mode: ValueError
    with runtime.lock:
        runtime.options = options
        runtime.runners = []


def set_compiled(model: Transformer, enabled: bool = True) -> None:
    """`--compile`: run `model`'s static passes through `torch.compile` (inductor, one graph per bucket).

    Inductor fuses the norms, RoPE, SiLU and casts that otherwise cost one
    kernel (and, without a CUDA graph, one dispatch) each.  Compiling takes
    tens of seconds per bucket the first time; inductor keeps what it built in
    its on-disk cache (TORCHINDUCTOR_CACHE_DIR), so later processes pay far
    less.  A compile that fails falls back to the uncompiled pass.
    """
    runtime = model.runtime.passes
    runtime.options = replace(runtime.options, compile=bool(enabled))
    runtime.compiled_forward = None


def is_compiled(model: Transformer) -> bool:
    """Whether `model`'s static passes go through `torch.compile` (`set_compiled`, `--compile`)."""
    return model.runtime.passes.options.compile


def _static_forward(model: Transformer):  # noqa: ANN202 - the model's static pass, compiled when asked
    if not is_compiled(model):
        return model.forward_static
    runtime = model.runtime.passes
    if runtime.compiled_forward is None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        runtime.compiled_forward = torch.compile(model.forward_static, dynamic=False)
    return runtime.compiled_forward


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
        self._outputs: dict[int, tuple[Tensor, Tensor]] = {}  # per captured bucket: (logits, hidden)
        # `keep_hidden`: `run` also keeps the normalised hidden states of all its rows in `hidden` (what a
        # feature draft reads, see `ModelOracle.prepare_features`).  Every static pass returns them anyway
        # (the norm's output, no extra work), so a graph captured without them serves with them too.
        self.keep_hidden = False
        self.hidden: Tensor | None = None
        # A feature draft's passes also read one input feature per row (`models.feature_draft`): a device
        # buffer like the others, so that a captured graph reads each pass's features from it.
        self.features: Tensor | None = None
        if is_feature_draft(model):
            self.features = torch.zeros(1, rows, model.feature_width, dtype=model.embed.weight.dtype,
                                        device=self.device)
        self._specs: dict[int, PassSpec] = {}  # per bucket (`_spec`)
        self._pool = None
        self._copied: torch.cuda.Event | None = None  # marks the last host-to-device copies (pinned buffers)
        self.lease: RunnerLease | None = None  # who holds this runner, when pooled (`acquire_runner`)

    @property
    def capacity(self) -> int:
        return self.cache.max_len

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`, or None (more rows than the biggest: `run` splits them)."""
        return next((b for b in self.buckets if b >= rows), None)

    @property
    def busy(self) -> bool:
        """Whether an owner holds this runner (a busy runner is never leased to another)."""
        return self.lease is not None

    def run(self, tokens: Sequence[int], positions: Sequence[int] | Tensor, mask: Tensor | None,
            logits_rows: slice | None = None, features: Tensor | None = None) -> Tensor:
        """Run `tokens` on top of the committed cache; returns logits [T', V] of `logits_rows`.

        `positions` [T] and `mask` as `Transformer.forward` takes them (None:
        causal; [T, T]: among the new tokens, which also see the whole
        prefix; [T, cached + T]: the complete mask).  The new entries are the
        cache's pending ones, as with the eager forward.  More rows than the
        biggest bucket (a prompt) run as several bucket passes, each seeing
        the chunks before it.  `features` [T, H]: a feature draft's input
        features (zeros when None).
        """
        T = len(tokens)
        start = self.cache.reserve(T)
        if T <= self.buckets[-1] and (mask is None or mask.shape[-1] != start + T):
            # one bucket and a mask over the new tokens (the common case): written straight into the
            # pinned buffer, no full-width mask built first
            pos = torch.as_tensor(positions, dtype=torch.long).cpu()
            out, hidden = self._pass(torch.as_tensor(tokens, dtype=torch.long), pos, None, start, new_mask=mask,
                                     features=features)
            self.hidden = hidden if self.keep_hidden else None
            return out if logits_rows is None else out[logits_rows]
        full = self._full_mask(T, start, mask)
        pos = torch.as_tensor(positions, dtype=torch.long).cpu()
        toks = torch.as_tensor(tokens, dtype=torch.long)
        wanted = range(T)[logits_rows] if logits_rows is not None else range(T)
        if not wanted:
            raise ValueError(f"logits_rows {logits_rows} selects none of {T} rows")
        step = self.buckets[-1]
        outs, hiddens = [], []
        for r0 in range(0, T, step):
            r1 = min(T, r0 + step)
            lo, hi = max(r0, wanted.start), min(r1, wanted.stop)
            out, hidden = self._pass(toks[r0:r1], pos[r0:r1], full[r0:r1], start + r0,
                                     features=None if features is None else features[r0:r1])
            if lo < hi:
                outs.append(out[lo - r0:hi - r0])
            if self.keep_hidden:
                hiddens.append(hidden)
        self.hidden = torch.cat(hiddens) if self.keep_hidden else None
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def run_on_device(self, tokens: Tensor, position: int, tree_mask: Tensor, tree_start: int) -> Tensor:
        """One pass whose inputs are already on the device: no host copy, no wait (`tree_levels`).

        `tokens` [n] (device), all at `position`; each row sees the committed
        slots before `tree_start`, and from `tree_start` on the slots flagged in
        its row of `tree_mask` [n, used + n] (the last n columns: the rows' own
        new slots, which must come right after the `used` ones).  Returns the
        logits [n, V]: on a GPU a view of the captured graph's output buffer,
        valid until the next pass of the same bucket (stream order keeps work
        queued before that pass reading the right values).
        """
        n = tokens.shape[0]
        rows = self.bucket(n)
        if rows is None:
            raise ValueError(f"a device-side pass takes at most {self.buckets[-1]} rows, got {n}")
        start = self.cache.reserve(n)
        if start + n != tree_start + tree_mask.shape[1]:
            raise ValueError(f"tree mask of width {tree_mask.shape[1]} from slot {tree_start} does not end at "
                             f"this pass's last slot {start + n}")
        index, mask = self.index[:, :rows], self.mask[:rows]
        index[0, :n].copy_(tokens)
        index[0, n:].zero_()
        index[1].fill_(position)
        torch.arange(start, start + rows, out=index[2])
        mask.zero_()
        mask[:, :tree_start] = True
        mask[:n, tree_start:start + n] = tree_mask
        if rows > n:  # padding rows see the context and themselves
            pad = torch.arange(n, rows, device=self.device)
            mask[pad, start + pad] = True
        if self.features is not None:
            self.features[0, :rows].zero_()
        return self._launch(rows)[0][0, :n]

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

    def _pass(self, tokens: Tensor, positions: Tensor, mask: Tensor | None, first_slot: int,
              new_mask: Tensor | None = None, features: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """One bucket pass of n <= max-bucket rows written from `first_slot`: logits [n, V] and, under
        `keep_hidden`, the rows' hidden states [n, H] (else None).

        `mask` [n, first_slot + n] is the rows' complete mask; when it is None,
        the rows see every slot before `first_slot` and, among themselves,
        `new_mask` [n, n] (None: causal)."""
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
        if mask is not None:
            host_mask[:n, :mask.shape[-1]] = mask
        else:
            host_mask[:n, :first_slot] = True
            if new_mask is None:
                host_mask[:n, first_slot:first_slot + n] = torch.ones(n, n, dtype=torch.bool).tril_()
            else:
                host_mask[:n, first_slot:first_slot + n] = new_mask
        if rows > n:  # padding rows: what precedes this pass, and themselves, so no softmax row is empty
            host_mask[n:, :first_slot] = True
            pad = torch.arange(n, rows)
            host_mask[pad, first_slot + pad] = True
        cuda = self.device.type == "cuda"
        if self.features is not None:  # on the device already: a device-side copy, padding rows zeroed
            self.features[0, n:rows].zero_()
            if features is None:
                self.features[0, :n].zero_()
            else:
                self.features[0, :n].copy_(features)
        self.index[:, :rows].copy_(index, non_blocking=cuda)
        self.mask[:rows].copy_(host_mask, non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        logits, hidden, replayed = self._launch(rows)
        if replayed:  # the graph's output buffers: copies, as the next replay overwrites them
            return logits[0, :n].clone(), hidden[0, :n].clone() if self.keep_hidden else None
        return logits[0, :n], hidden[0, :n] if self.keep_hidden else None

    def _launch(self, rows: int) -> tuple[Tensor, Tensor, bool]:
        """Bucket `rows`' pass on the inputs already in the buffers: (logits, hidden, replayed).

        Replayed: the captured graph's own output buffers (captured on first use); else an eager pass's."""
        if self.use_graphs:
            graph = self.graphs.get(rows) or self._capture(rows)
            if graph is not None:
                graph.replay()
                logits, hidden = self._outputs[rows]
                return logits, hidden, True
        logits, hidden = self._forward(self.index[0:1, :rows], self.index[1, :rows], self.index[2, :rows],
                                       self.mask[:rows], self.cache, self._spec(rows))
        return logits, hidden, False

    def forget_captures(self) -> None:
        """Drop the captured graphs: the passes they recorded changed (a new `ModelRuntime.feature_taps`)."""
        self.graphs.clear()
        self._outputs.clear()

    def _spec(self, rows: int) -> PassSpec:
        """A bucket's pass: logits and hidden states of every row, reading the features buffer's first `rows`
        (one record per bucket, so that a compiled pass sees the same input every time)."""
        spec = self._specs.get(rows)
        if spec is None:
            features = None if self.features is None else self.features[:, :rows]
            spec = self._specs[rows] = PassSpec(hidden="rows", features=features)
        return spec

    def _forward(self, *args) -> tuple[Tensor, Tensor]:  # noqa: ANN002
        """The static pass, compiled under `--compile`; a failed compile falls back to the plain one."""
        forward = _static_forward(self.model)
        if forward is self.model.forward_static:
            return forward(*args)
        try:
            with decoding_mode(self.model):  # entered outside the compiled region (see `decoding_mode`)
                return forward(*args)
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported op: run uncompiled
            set_compiled(self.model, False)
            print(f"stagedspec: torch.compile failed ({type(exc).__name__}); running uncompiled passes",
                  file=sys.stderr)
            return self.model.forward_static(*args)

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        """Record bucket's pass as a CUDA graph (its inputs are already in place); None if capture fails."""
        args = (self.index[0:1, :bucket], self.index[1, :bucket], self.index[2, :bucket], self.mask[:bucket],
                self.cache, self._spec(bucket))
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


class PassRouter:
    """Where a request's eager model passes go instead of straight to the model (`RequestPasses.router`)."""

    def __call__(self, model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
                 spec: PassSpec = PLAIN) -> Tensor | tuple[Tensor, Tensor]:
        raise NotImplementedError


def draft_cache_len(max_len: int, max_tree_budget: int) -> int:
    """Cache entries of a drafter or draft stage: the request's context, its own tree nodes and the root.

    The one place a draft's cache is sized (`Pipeline`, `ModelDrafter`); the
    oracle's comes from `request.context_budget`.
    """
    return max_len + max_tree_budget + 1


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


class RunnerLease:
    """One owner's hold on a pooled runner, from `acquire_runner` until `release`."""

    def __init__(self, runner: StaticRunner, owner: object) -> None:
        self.runner = runner
        # The fallback: an owner dropped without its request's `RequestPasses.release` (an oracle or drafter built
        # by hand, as library code and tests do; a request that failed half-built) gives its runner back when it
        # is collected, so that a pool never fills with runners nobody holds.
        self._on_collect = weakref.finalize(owner, self._give_back)

    def release(self) -> None:
        """Give the runner back to its model's pool (the first call; later ones do nothing)."""
        self._on_collect.detach()
        self._give_back()

    def _give_back(self) -> None:
        # No lock: a finalizer may run inside `acquire_runner`'s, on the same thread.  Clearing only this lease is
        # safe without it: no one else takes the runner while it is still this lease's.
        if self.runner.lease is self:
            self.runner.lease = None


def acquire_runner(model: Transformer, max_len: int, owner: object, *, min_rows: int = 1) -> StaticRunner:
    """A free pooled runner of `model` with room for `max_len` entries, leased to `owner`.

    The lease ends when `owner` is collected, or earlier with the request that
    recorded it (`RequestPasses.acquire`, `RequestPasses.release`).
    """
    mode = pass_mode(model)
    cap = runner_capacity(max_len)
    runtime = model.runtime.passes
    with runtime.lock:
        pool = runtime.runners
        runner = next((r for r in pool if not r.busy and r.capacity == cap and r.min_rows == min_rows), None)
        if runner is None:
            runner = StaticRunner(model, cap, graphs=mode == "graphs", min_rows=min_rows)
            if len(pool) >= POOL_LIMIT:  # make room: forget a free runner (of another size)
                idle = next((r for r in pool if not r.busy), None)
                if idle is not None:
                    pool.remove(idle)
            if len(pool) < POOL_LIMIT:
                pool.append(runner)
        runner.lease = RunnerLease(runner, owner)
    runner.cache.reset()
    runner.keep_hidden = False  # a new lease asks for hidden states again if it wants them
    return runner


class RequestPasses:
    """One request's way to its models: where its eager passes go, and the pooled runners its parts lease.

    The request's own code makes one, hands it to every part that runs
    passes while it builds them (`ModelOracle`, the drafters and draft stages
    `Pipeline.drafter` builds), and calls `release()` when it is done with
    them (`Pipeline.generate`, the server's scheduler when it finishes a
    request).  Why the request and not each part: the parts are built deep
    inside the drafter a pipeline builds for the request, and none of them
    knows when the request is over; the request's code does.  Why an object
    and not the thread: the parts hold what they run through, so whichever
    thread runs them, and however many requests a process runs at once,
    nothing is looked up in process-wide state.

    A part built without one (by hand, as library code and tests do) gets
    one of its own: its passes go straight to the model, and its runner goes
    back to the pool when the part is collected.
    """

    def __init__(self, router: PassRouter | None = None) -> None:
        """`router`: where the eager passes go (None: to the model).  The server's batched scheduler gives
        each request its lane (`stagedspec.server.batching`), which gathers the passes of all running
        requests into one ragged pass while the request's loop stays the solo code."""
        self.router = router
        self.leases: list[RunnerLease] = []

    def run(self, model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
            spec: PassSpec = PLAIN) -> Tensor | tuple[Tensor, Tensor]:
        """An eager pass: `model(tokens, positions, cache, spec)`, or through this request's router when it has
        one.  Tensors on the model's device, with the batch dimension (`Transformer.forward`)."""
        if self.router is None:
            return model(tokens, positions, cache, spec)
        return self.router(model, tokens, positions, cache, spec)

    def run_pass(self, model: Transformer, runner: StaticRunner | None, cache: KVCache, tokens: Sequence[int],
                 positions: Tensor, spec: PassSpec = PLAIN) -> tuple[Tensor, Tensor | None]:
        """One pass of a part of this request (the oracle, a drafter, a draft stage): the one place that
        chooses a pass's path.

        - A part that leased a static runner (pass mode "static" or "graphs", `pass_mode`) runs the runner's
          fixed-shape buckets, replayed as CUDA graphs on a GPU.  They attend over the runner's whole cache,
          so `spec.key_width` is the runner's own, and rows stay independent by the bucket every pass runs
          (`ModelOracle`'s `bit_exact`).
        - Else the pass is eager: through this request's router when it has one (the batched server's lane,
          which runs it in one ragged pass with other requests', `models.ragged`), or straight to
          `Transformer.forward`, which runs the model's one native call per pass where it has one and its
          layers in PyTorch otherwise.

        `tokens` [T] and `positions` [T] on the host; `spec.tree_mask` as `Transformer.forward` takes it;
        `spec.features` [1, T, H].  Returns logits [T', V] of `spec.logits_rows`, and hidden states when
        `spec.hidden` asks ("rows": [T', H] of those rows; "all": [T, H] of every row), else None.
        """
        if runner is not None:
            features = None if spec.features is None else spec.features[0]
            rows = spec.logits_rows
            logits = runner.run(tokens, positions, spec.tree_mask, logits_rows=rows, features=features)
            hidden = runner.hidden if spec.wants_hidden else None
            if hidden is not None and spec.hidden == "rows" and rows is not None:
                hidden = hidden[rows]
            return logits, hidden
        device = model.embed.weight.device
        toks = torch.tensor([list(tokens)], device=device)
        if spec.tree_mask is not None and spec.tree_mask.device != device:
            spec = spec.but(tree_mask=spec.tree_mask.to(device))
        out = self.run(model, toks, positions.to(device), cache, spec)
        if not spec.wants_hidden:
            return out[0], None
        return out[0][0], out[1][0]

    def acquire(self, model: Transformer, max_len: int, owner: object, *, min_rows: int = 1) -> StaticRunner:
        """`acquire_runner`, the lease recorded here so that `release` gives it back."""
        runner = acquire_runner(model, max_len, owner, min_rows=min_rows)
        assert runner.lease is not None
        self.leases.append(runner.lease)
        return runner

    def release(self) -> None:
        """Give every recorded runner back to its pool; the parts that held them must not run passes after."""
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()


def wants_fixed_width(model: Transformer) -> bool:
    """Whether the oracle runs `model` with a fixed key width and >= 2 rows by default: bf16/fp16 passes that
    are not row-exact.

    See `ModelOracle`; the cost curve must time passes
    the way the loop runs them.  A model on the native kernels
    (`models.quant.row_exact`, bf16 activations included) computes every row
    alone, and its attention sees a row's visible keys in rank order whatever
    the width, so neither measure changes a bit there and both would only
    cost: the second row makes every `ar` pass a 2-row pass, and every server
    round of n `ar` requests a 2n-row one
    (docs/measurements.md, "The second row of a fixed-width pass on a Zen 4 EPYC").
    """
    return model.embed.weight.dtype in (torch.bfloat16, torch.float16) and not row_exact(model)


class ModelOracle:
    """Runs a `Transformer` with its own static KV cache as the oracle of the loop.

    The cache survives across calls: `prefill` keeps the longest cached prefix
    of the new context and runs only the rest, which is what lets a model be
    a stage that is re-entered every step of the loop above it.
    """

    def __init__(self, model: Transformer, max_len: int, fixed_width: bool | None = None,
                 bit_exact: bool = False, passes: RequestPasses | None = None) -> None:
        """`fixed_width` (default: on for bf16/fp16 weights): run every pass over the whole cache's key
        width, with at least two rows, and the uncached prompt in a pass of its own, so that a row's
        logits depend as little as possible on the pass it is in (see `Transformer.forward` and
        `score`).  That removes most near-tie flips between a k-token verification and one-token
        decoding in bf16, for about 7% of decoding speed, but not all: the attention kernel's
        rounding still depends on how many rows share a call.  fp32 is left alone: there the
        rounding differences are far below any logit gap the tests ever met, and a two-row pass
        would cost a third more.

        `bit_exact` (with the fixed width): greedy steps drop what was accepted off the tree's
        first-child chain (`keep_slot_aligned`), and a pass's rows do not change one another's bits:
        on the eager path attention runs one token at a time (it costs about 10-20% of `ar`'s speed
        and most of what speculation gains on a CPU, docs/benchmarks-history.md); on the static path (CUDA)
        every pass runs `BUCKETS[-1]` rows, so the BLAS and the attention kernel run one kernel for
        every pass and a row's result depends on that row alone, at little cost on a GPU
        (docs/measurements.md, "`--bit-exact` at 64 rows a pass on an H200").

        `passes`: the request this oracle runs for (its router and runner leases; see `RequestPasses`)."""
        self.model = model
        self.passes = passes if passes is not None else RequestPasses()
        if fixed_width is None:
            fixed_width = wants_fixed_width(model)
        # Attention runs one token at a time (`Transformer.forward`, row_independent), and greedy
        # steps keep only what was verified on slot-aligned rows (`keep_slot_aligned`, in the loop).
        self.bit_exact = bit_exact and fixed_width
        # Static-shape passes (CUDA graphs on a GPU; `stagedspec.runner`) always attend over the
        # whole cache, and their smallest bucket replaces the throwaway second row below.
        self.runner = None
        if pass_mode(model) != "eager":
            if self.bit_exact:
                min_rows = BUCKETS[-1]  # one row count for every pass: one kernel, so rows cannot interact
            else:
                min_rows = 2 if fixed_width and model.embed.weight.device.type == "cpu" else 1
            self.runner = self.passes.acquire(model, max_len, self, min_rows=min_rows)
            self.cache = self.runner.cache
        else:
            self.cache = model.new_cache(max_len)
        self.key_width = self.cache.max_len if fixed_width else None
        self.forward_passes = 0
        self.device = model.embed.weight.device
        self.cached_tokens: list[int] = []  # tokens whose KV entries are committed, in order
        self._catch_up: list[int] = []  # context tokens to run in front of the next tree
        self._tree: TokenTree | None = None
        # For a feature draft (`prepare_features`): the final normalised hidden state of each cached token,
        # row t for cached token t; the first `feature_rows` rows are valid.  Filled from the passes that
        # run anyway (the prompt's, each verification's), never from a pass of their own.
        self.features: Tensor | None = None
        self.feature_rows = 0
        self._hidden: Tensor | None = None  # hidden rows of the last scored pass (catch-up tokens, then tree)

    def prepare_features(self, taps: Sequence[int] = ()) -> None:
        """Record the hidden state of every token this oracle caches from now on (a feature draft reads them).

        `taps`: the layers whose normalised inputs the draft reads too (`FeatureDraftModel.feature_taps`):
        every pass that returns hidden states then appends them (`ModelRuntime.feature_taps`), so a feature
        row is H * (1 + len(taps)) wide.  The setting is the model's: one draft's taps per loaded oracle.

        The uncached prompt is run now, in a pass of its own, so that the
        draft has the prompt's features for its first proposal; the bf16 and
        static paths run it alone anyway (`_run_catch_up`).  `bit_exact`
        keeps the prompt in front of the first tree (its rounding must match
        one-token decoding): the first proposal then has no features for the
        prompt, which costs acceptance, never exactness.
        """
        taps = tuple(taps)
        if self.model.runtime.feature_taps != taps:
            self.model.runtime.feature_taps = taps
            if self.runner is not None:
                self.runner.forget_captures()
        width = self.model.config.hidden_size * (1 + len(taps))
        if self.features is None or self.features.shape[-1] != width:
            p = self.model.embed.weight
            self.features = torch.zeros(self.cache.max_len, width, dtype=p.dtype, device=p.device)
            self.feature_rows = 0
            if self.runner is not None:
                self.runner.keep_hidden = True
        if self._catch_up and not self.bit_exact:
            self._run_catch_up()

    @property
    def committed_features(self) -> Tensor | None:
        """[n, W]: the oracle's final hidden states of its first n cached tokens (and the taps' inputs: W =
        H * (1 + taps)); None before `prepare_features`."""
        return None if self.features is None else self.features[: self.feature_rows]

    def _keep_features(self, start: int, rows: Sequence[int] | slice) -> None:
        """Store the last pass's hidden `rows` as the features of the cached tokens from slot `start` on."""
        if self.features is None or self._hidden is None or self.feature_rows != start:
            return
        kept = self._hidden[rows][..., :self.features.shape[-1]]
        self.features[start:start + kept.shape[0]] = kept
        self.feature_rows = start + kept.shape[0]

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Make every context token but the last (the first step's root) part of the cache.

        Tokens not cached yet are run lazily, in front of the next scored
        tree, so catching up costs no forward pass of its own.
        """
        target = list(prompt_ids[:-1])
        keep = 0
        for a, b in zip(self.cached_tokens, target):
            if a != b:
                break
            keep += 1
        self.cache.truncate(keep)
        self.cached_tokens = target[:keep]
        self._catch_up = target[keep:]
        self.feature_rows = min(self.feature_rows, keep)

    def score(self, tree: TokenTree) -> Tensor:
        if self._catch_up and self.key_width is not None and not self.bit_exact:
            self._run_catch_up()
        lead = self._catch_up
        P, N = len(lead), len(tree)
        tokens = [*lead, *tree.tokens]
        start = self.cache.length
        pos = torch.cat([torch.arange(start, start + P), tree.positions(start + P)])
        if P == 0:
            mask = None if N == 1 else tree.attention_mask()
        else:
            mask = torch.ones(P + N, P + N, dtype=torch.bool).tril_()
            mask[P:, P:] = tree.attention_mask()
        if self.runner is None and self.key_width is not None and P + N == 1:
            # CPU matmul kernels for a single row can round differently from those for
            # several rows (seen for bf16 with K=1536); a throwaway second row (after the
            # real one, so invisible to it, and never committed) keeps every pass multi-row.
            tokens.append(tokens[0])
            pos = torch.cat([pos, pos])  # same position: never past the rope table
            mask = torch.ones(2, 2, dtype=torch.bool).tril_()
        self.forward_passes += 1
        self._tree = tree
        spec = PassSpec(tree_mask=mask, logits_rows=slice(P, P + N), key_width=self.key_width,
                        row_independent=self.bit_exact, hidden="all" if self.features is not None else "none")
        logits, hidden = self.passes.run_pass(self.model, self.runner, self.cache, tokens, pos, spec)
        self._hidden = None if hidden is None else hidden[: P + N]
        return logits

    def _run_catch_up(self) -> None:
        """Run the uncached context in a pass of its own, before the first tree.

        The attention kernel's rounding of a row depends on how many rows share
        its pass; a prompt run alone is the same pass for every method, so the
        cache it leaves, and the tree rows scored after it, do not depend on
        the method's tree size.  One extra pass per request (at the first step).
        """
        lead = self._catch_up
        start = self.cache.length
        spec = PassSpec(tree_mask=torch.ones(len(lead), len(lead), dtype=torch.bool).tril_(),
                        logits_rows=slice(-1, None), key_width=self.key_width,
                        hidden="all" if self.features is not None else "none")
        _, self._hidden = self.passes.run_pass(self.model, self.runner, self.cache, lead,
                                               torch.arange(start, start + len(lead)), spec)
        self.forward_passes += 1  # counted: the bench's passes per token and memory traffic include it
        self.cache.commit()
        self._keep_features(start, slice(0, len(lead)))
        self.cached_tokens.extend(lead)
        self._catch_up = []

    def commit(self, accepted: Sequence[int]) -> None:
        P = len(self._catch_up)
        start = self.cache.length
        rows = [*range(P), *(P + i for i in (0, *accepted))]
        self.cache.commit(rows)
        self._keep_features(start, rows)
        tree = self._tree
        assert tree is not None
        self.cached_tokens.extend(self._catch_up)
        self.cached_tokens.extend(tree.tokens[i] for i in (0, *accepted))
        self._catch_up = []
