"""Batched passes across requests: each request's step on its own thread, their passes run as one.

Why this shape: a request's decoding step (`iter_steps`: propose, verify,
commit) calls its models deep inside drafters and verification, a different
number of times per method.  Rewriting every drafter as resumable phases
would duplicate the solo loop; instead each running request gets a *lane*:
a thread that runs its step with the solo code, and whose eager model passes
(`stagedspec.runner.RequestPasses.run`: the oracle's, a draft's or a draft
stage's, feature drafts included, hidden states and input features and all)
are routed here instead of to the model: the request's `RequestPasses` has
its lane as router.

The scheduler thread is the batcher.  A round dispatches one step to every
lane, then repeats: wait until no lane is computing (each is either waiting
for a pass or done with its step: a barrier), take the waiting passes, run
them as one ragged pass per model (`forward_ragged`: each draft model's
passes together; the oracle's together, once no draft pass is waiting), and
hand each lane its logits.  The
round ends when every lane is done.  Only the scheduler thread runs model
arithmetic while lanes wait, so there is no contention for the cores.

Exactness: a lane's pass is its solo pass (same cache, positions, mask, key
width), sharing only the row-wise matmuls with its neighbours; its random
draws come from its own generator on its own thread.  So batching changes a
request's numbers only through the matmuls' row count (see docs/serving.md).

Robustness: an error in a ragged pass is raised in every lane that took part
(each request then ends with an error event); a lane that neither asks for a
pass nor finishes within `timeout` seconds is abandoned (its request ends
with an error, and any pass it asks for later fails), so the server never
hangs on one request.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from stagedspec.cache import KVCache
from stagedspec.errors import StagedSpecError
from stagedspec.models.pass_spec import PLAIN, PassSpec
from stagedspec.models.ragged import PAD_BY_DEFAULT, Segment, forward_ragged
from stagedspec.models.transformer import Transformer
from stagedspec.runner import PassRouter
from stagedspec.threads import no_parallel_regions_here

IDLE, RUNNING, WAITING, DONE, ABANDONED = "idle", "running", "waiting", "done", "abandoned"
IDLE_LANES = 16  # finished lanes kept for reuse (above the largest --max-batch in practice: the rest end)


@dataclass
class RaggedPass:
    """One ragged pass of a round: its model, each lane's rows in it, and how long it took."""

    model: Transformer
    rows: dict[int, int]  # id(lane) -> rows
    seconds: float


@dataclass
class RoundRecord:
    """What one round ran: its lanes, its ragged passes in order, and its wall time.

    The scheduler turns it into each request's view of the load (`stagedspec.auto.SharedLoad`), which
    `auto` prices the next step's arms by: a step's choice then depends only on earlier rounds."""

    lanes: list[int]  # id(lane) of each lane in the round
    passes: list[RaggedPass] = field(default_factory=list)
    seconds: float = 0.0


class _Call:
    """One lane's pass, waiting for the next ragged pass of its model."""

    __slots__ = ("lane", "model", "segment", "out", "error", "done")

    def __init__(self, lane: "Lane", model: Transformer, segment: Segment) -> None:
        self.lane, self.model, self.segment = lane, model, segment
        self.out: Tensor | tuple[Tensor, Tensor] | None = None
        self.error: BaseException | None = None
        self.done = False


class PassBatcher:
    """Runs the steps of several requests as rounds whose model passes are gathered into ragged passes."""

    def __init__(self, timeout: float = 300.0, last: Transformer | None = None, pad: bool | None = None) -> None:
        """`timeout`: seconds a lane may compute without asking for a pass or finishing its step.
        `last` (the oracle): its passes wait while any other model's are pending.  A step drafts
        before it verifies, so holding the oracle's passes until every lane has finished drafting
        puts all the round's verifications in one pass, rather than one pass per drafting phase.
        `pad`: pad each ragged pass's rows to a few sizes (`models.ragged.padded_rows`), which keeps a long-running
        server's resident memory flat (default: on; `STAGEDSPEC_RAGGED_PAD=0` turns it off)."""
        self.timeout = timeout
        self.pad = PAD_BY_DEFAULT if pad is None else pad
        self.last = last
        self._cond = threading.Condition()
        self._calls: list[_Call] = []
        self.ragged_passes = 0  # ragged passes run (one per model per barrier)
        self.segments = 0  # lane passes they carried
        self._idle: list[Lane] = []  # finished requests' lanes, whose threads wait for the next request
        self.last_round: RoundRecord | None = None  # the latest round run (set when it ends)
        self._record: RoundRecord | None = None

    def lane(self, name: str) -> "Lane":
        """A lane for a new request: a finished request's lane when one is idle, else a new thread.

        Why reuse: a thread per request meant hundreds of short-lived threads in a long run, each one
        leaving per-thread allocator and OpenMP state behind; a pool bounded by the running set keeps the
        server's resident memory flat (`bench-serve --soak-minutes`)."""
        with self._cond:
            if self._idle:
                return self._idle.pop()
        return Lane(self, name)

    def recycle(self, lane: "Lane") -> bool:
        """Keep a finished, healthy lane for the next request (at most `IDLE_LANES` idle); False: end it."""
        with self._cond:
            if lane.state in (RUNNING, WAITING, ABANDONED) or len(self._idle) >= IDLE_LANES:
                return False
            lane.assign(None, IDLE)
            self._idle.append(lane)
            return True

    def finished(self, lane: "Lane") -> None:
        """A lane's step is over (its thread's report): DONE unless the round gave up on it."""
        with self._cond:
            if lane.state != ABANDONED:
                lane.state = DONE
            self._cond.notify_all()

    def submit(self, call: "_Call") -> None:
        """A lane's pass joins the round's waiting passes; returns once a ragged pass has run it."""
        with self._cond:
            if call.lane.state == ABANDONED:
                raise StagedSpecError("this request's step took too long and was stopped")
            self._calls.append(call)
            call.lane.state = WAITING
            self._cond.notify_all()
            while not call.done:
                self._cond.wait()

    def run_round(self, work: list[tuple["Lane", Callable[[], None]]]) -> list["Lane"]:
        """Run one step on every lane (`task` must catch its own errors); returns the lanes abandoned."""
        lanes = [lane for lane, _ in work]
        record = self._record = RoundRecord([id(lane) for lane in lanes])
        t0 = time.perf_counter()
        with self._cond:
            for lane, task in work:
                lane.assign(task, RUNNING)
        for lane in lanes:
            lane.wake()
        abandoned: list[Lane] = []
        while True:
            with self._cond:
                idle = self._cond.wait_for(lambda: all(lane.state != RUNNING for lane in lanes), self.timeout)
                if not idle:
                    for lane in lanes:
                        if lane.state == RUNNING:
                            lane.state = ABANDONED
                            abandoned.append(lane)
                calls = [c for c in self._calls if c.model is not self.last] or self._calls
                self._calls = [c for c in self._calls if c not in calls]
            if not calls:
                record.seconds = time.perf_counter() - t0
                self.last_round = record
                return abandoned
            self._execute(calls)
            with self._cond:
                for call in calls:
                    call.done = True
                    if call.lane.state == WAITING:
                        call.lane.state = RUNNING
                self._cond.notify_all()

    def _execute(self, calls: list[_Call]) -> None:
        """One ragged pass per model; an error is handed to every call of that pass."""
        by_model: dict[int, list[_Call]] = defaultdict(list)
        for call in calls:
            by_model[id(call.model)].append(call)
        for group in by_model.values():
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    outs = forward_ragged(group[0].model, [c.segment for c in group], pad=self.pad)
                for call, out in zip(group, outs):
                    call.out = out
                self.ragged_passes += 1
                self.segments += len(group)
                if self._record is not None:
                    rows: dict[int, int] = defaultdict(int)
                    for call in group:
                        rows[id(call.lane)] += call.segment.tokens.shape[1]
                    self._record.passes.append(RaggedPass(group[0].model, dict(rows), time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - raised again in each lane's own thread
                for call in group:
                    call.error = e


class Lane(PassRouter):
    """One request's side of the batcher: a thread for its steps, and its passes' way into the ragged pass."""

    def __init__(self, batcher: PassBatcher, name: str) -> None:
        self._batcher = batcher
        self.state = IDLE
        self._task: Callable[[], None] | None = None
        self._wake = threading.Semaphore(0)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def assign(self, task: Callable[[], None] | None, state: str) -> None:
        """The batcher's: the step this lane runs when woken, and its state (under the batcher's lock)."""
        self._task, self.state = task, state

    def wake(self) -> None:
        """The batcher's: run the assigned step now."""
        self._wake.release()

    def close(self) -> None:
        """The request is over: the lane goes back to its batcher's pool, or its thread ends once its
        current step (if any) is over (an abandoned lane is never reused)."""
        if self._batcher.recycle(self):
            return
        self._closed = True
        self._wake.release()

    def _loop(self) -> None:
        # A lane's own operations are small (its passes run on the scheduler's thread): it opens no OpenMP
        # pool of its own, which would slow every pass of the process (`threads.no_parallel_regions_here`).
        no_parallel_regions_here()
        while True:
            self._wake.acquire()
            if self._closed:
                return
            task = self._task
            try:
                if task is not None:
                    with torch.inference_mode():
                        task()
            finally:
                self._batcher.finished(self)

    def __call__(self, model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
                 spec: PassSpec = PLAIN) -> Tensor | tuple[Tensor, Tensor]:
        # Not a lane pass (a batch, or a pass run off this lane's thread, where no step waits for it): run it here.
        if tokens.shape[0] != 1 or positions.dim() != 1 or threading.current_thread() is not self._thread:
            return model(tokens, positions, cache, spec)
        call = _Call(self, model, Segment(tokens, positions, cache, spec))
        self._batcher.submit(call)
        if call.error is not None:
            raise call.error
        assert call.out is not None
        return call.out

