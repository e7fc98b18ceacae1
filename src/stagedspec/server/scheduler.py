"""Continuous batching over exact per-request decoding loops, with batched model passes.

One worker thread owns the scheduling.  Requests wait in a FIFO queue until
a running slot is free (`max_batch`) and their KV cache fits the memory
budget; then they join the running set at the next step boundary.  Each
round advances every running request by one step of its own decoding loop
(`iter_steps`: propose a tree, verify it in one oracle pass, commit the
accepted path) and hands the step's text to that request's stream.  A
request leaves when it finishes, or at the first step boundary after its
client went away (`Job.cancel`), which frees its slot and memory.

With `batch_passes` (the default) a round's steps run on their requests'
lanes (`stagedspec.server.batching`) and all their model passes that are
ready at the same time run as one ragged pass per model: every request's
tree is verified in one oracle pass, each against its own KV cache.
Without it (`--no-batch-passes`) the worker runs the steps one after the
other, each with its own passes (the interleaved scheduler).

Exactness: a running request owns everything that changes while it decodes:
its `ModelOracle` (KV cache sized by `context_budget`, exactly as a solo run
sizes it), its drafter (built by `Pipeline.drafter`, with its own draft
caches) and its `torch.Generator` (seeded from the request's `seed` inside
`iter_steps`).  The models' weights are shared but read-only.  Interleaved,
the tensor operations a request runs are its solo run's; batched, they are
too except that its rows share the row-wise matmuls with its neighbours'
(docs/serving.md, "Batched passes", has the measured agreement).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable


from stagedspec.auto import SharedLoad
from stagedspec.auto.drafter import AutoDrafter
from stagedspec.constraints.processor import LogitsProcessor
from stagedspec.errors import StagedSpecError, first_line
from stagedspec.methods import METHODS
from stagedspec.threads import governor_for
from stagedspec.request import stage_report, start_request
from stagedspec.request_plan import RequestPlan
from stagedspec.runner import RequestPasses
from stagedspec.server.engine import Engine, format_size
from stagedspec.server.exactness import batch_exactness
from stagedspec.server.batching import Lane, PassBatcher
from stagedspec.server.metrics import Metrics
from stagedspec.server.pressure import CappedDrafter, level_tree_budget, root_only_level
from stagedspec.server.schemas import APIError

Event = tuple  # ("text", str) | ("done", finish_reason, info) | ("error", status, message)


@dataclass
class Job:
    """One generation request as the scheduler sees it; `deliver` must be callable from any thread."""

    plan: RequestPlan  # what to run, checked (`stagedspec.request_plan`)
    deliver: Callable[[Event], None]
    kv_bytes: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    processor: LogitsProcessor | None = None  # the request's logit bias and grammar (`stagedspec.constraints`)

    @property
    def reproducible(self) -> bool:
        """A seeded sampled request: its tokens must equal the same request run alone (as `Pipeline.generate`
        decides for a solo run), so its arm choices and trees may not depend on the server's load."""
        return self.plan.seed is not None and not self.plan.sampling.greedy

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class _Joining:
    """A job admitted this round, not started yet: its trees may still shrink for the jobs behind it."""

    job: Job
    level: int


class _Running:
    """A job's decoding state: the `Request` `start_request` builds for a solo run too, with the server's
    lane, tree cap and step outcome around it."""

    def __init__(self, job: Job, engine: Engine, lane: Lane | None = None, level: int = 0) -> None:
        """`lane`: where the steps run with batched passes (None: on the caller's thread); `level`: the
        shrink level its trees start at (0: full; higher under memory pressure, see `server.pressure`)."""
        self.job = job
        pipe = engine.pipeline(job.plan.speculation)
        max_len = engine.cache_slots(len(job.plan.prompt_ids), job.plan.max_new_tokens, job.plan.speculation)
        # Its passes go to its lane (when batched), and the runners its oracle and drafters lease are given
        # back when the request ends (`Scheduler._finish`).
        self.passes = RequestPasses(router=lane)
        try:
            self.request = start_request(pipe, job.plan, max_len, processor=job.processor, passes=self.passes,
                                         wrap=lambda d: CappedDrafter(d, job.plan.speculation.max_tree_budget, level))
        except BaseException:
            self.passes.release()
            raise
        self.switch: CappedDrafter = self.request.stepper  # type: ignore[assignment] - what `wrap` made
        # `auto` prices its arms by the batched round it shares (`auto.SharedLoad`), except for a seeded
        # sampled request: its tree shapes, and so its draws, must be its solo run's.
        self.load_aware = isinstance(self.request.drafter, AutoDrafter) and not job.reproducible
        self.lane = lane
        self.outcome: tuple[tuple[list[int], int] | None, BaseException | None] = (None, None)

    def step(self) -> tuple[list[int], int] | None:
        """One step of this request's own loop: (tokens, oracle passes it took), or None when over."""
        passes = self.request.oracle.forward_passes
        tokens = self.request.step()
        return None if tokens is None else (tokens, self.request.oracle.forward_passes - passes)

    def run_step(self) -> None:
        """`step`, keeping its result or error in `outcome` (a lane's task must not raise)."""
        try:
            self.outcome = (self.step(), None)
        except Exception as e:  # noqa: BLE001 - handed to the request by the scheduler
            self.outcome = (None, e)

    @property
    def level(self) -> int:
        return self.switch.level

    @level.setter
    def level(self, level: int) -> None:
        self.switch.level = level

    @property
    def over(self) -> bool:
        return self.request.over

    def summary(self) -> dict[str, Any]:
        st = self.request.finish_stats()
        st.stages = stage_report(st, self.request.drafter)
        return {
            "speculation_off_steps": self.switch.skipped_steps,
            # steps proposed at each shrink level (0: full trees; see `server.pressure`), and their node caps
            "tree_levels": {str(k): v for k, v in sorted(self.switch.level_steps.items())},
            "tree_caps": {str(k): level_tree_budget(self.job.plan.speculation.max_tree_budget, k)
                          for k in sorted(self.switch.level_steps)},
            "method": self.job.plan.speculation.method,
            "mean_accepted_length": st.mean_accepted_length,
            "tokens_by_stage": dict(Counter(st.token_origins)),
            "oracle_passes": st.oracle_forward_passes,
            "stages": st.stages,
            "seconds": st.seconds,
            "token_ids": list(self.request.token_ids),
        }


class LoadTracker:
    """What the batched rounds cost and carry, for `auto`'s pricing of a request's next step (`auto.SharedLoad`).

    Per lane, from the latest round: its rows in the oracle's ragged pass, its draft passes and their rows.
    Over rounds (an exponential mean, rounds with a prompt's prefill left out): the round's wall time and
    emitted tokens per request in it, and how the round's oracle passes and the rest of it (drafting, host
    work) compare with the cost profile's prediction for them.  A request's view is then the other lanes'
    latest rows and draft phases, and their share (per request) of a round's seconds and tokens.  Only finished rounds are read,
    so a step's choice depends on server state known before it.
    """

    SMOOTHING = 0.3  # weight of the newest round in the means

    def __init__(self, oracle: Any) -> None:
        self.oracle = oracle
        self.lanes: dict[int, tuple[int, int, int]] = {}  # id(lane) -> (oracle rows, draft passes, draft rows)
        self.lane_seconds: float | None = None  # round seconds / requests in the round
        self.lane_tokens: float | None = None  # round tokens / requests in the round
        self.oracle_scale = 1.0  # measured / predicted seconds of the oracle's ragged passes
        self.draft_scale = 1.0  # measured / predicted seconds of the rest of the round (drafting, host work)

    def _scale(self, old: float, measured: float, predicted: float) -> float:
        if measured <= 0 or predicted <= 0:
            return old
        ratio = min(20.0, max(0.25, measured / predicted))
        return (1 - self.SMOOTHING) * old + self.SMOOTHING * ratio

    def _rescale(self, record: Any, profile: Any) -> None:
        """Compare the round's passes with what the cost profile predicts for them (`auto.SharedLoad`'s scales)."""
        oracle_measured = oracle_predicted = draft_predicted = 0.0
        lane_passes = 0
        for p in record.passes:
            rows, segments = sum(p.rows.values()), len(p.rows)
            if p.model is self.oracle:
                oracle_measured += p.seconds
                oracle_predicted += profile.oracle_seconds(rows) + (segments - 1) * profile.segment_cost(-1)
            elif profile.drafts:
                draft_predicted += profile.draft_seconds(0, rows) + (segments - 1) * profile.segment_cost(0)
                lane_passes += segments
        self.oracle_scale = self._scale(self.oracle_scale, oracle_measured, oracle_predicted)
        if lane_passes:  # the rest of the round: draft passes, and the lanes' host work, one lane at a time
            draft_predicted += lane_passes * profile.draft_pass_overhead(False)
            self.draft_scale = self._scale(self.draft_scale, record.seconds - oracle_measured, draft_predicted)

    def observe(self, record: Any, tokens: dict[int, int], first: set[int], profile: Any = None) -> None:
        """Fold in a finished round (`batching.RoundRecord`); `tokens`: id(lane) -> tokens its step emitted,
        `first`: lanes whose step was their request's first (its prompt's prefill); `profile`: the cost
        profile `auto` prices with (None: no scales are learned)."""
        lanes: dict[int, list[int]] = {lane: [0, 0, 0] for lane in record.lanes}
        for p in record.passes:
            for lane, rows in p.rows.items():
                if lane in lanes:
                    if p.model is self.oracle:
                        lanes[lane][0] += rows
                    else:
                        lanes[lane][1] += 1
                        lanes[lane][2] += rows
        self.lanes = {lane: tuple(v) for lane, v in lanes.items() if lane not in first}  # type: ignore[misc]
        n = len(record.lanes)
        if not n or first or record.seconds <= 0 or not tokens:
            return
        if profile is not None:
            self._rescale(record, profile)
        a = self.SMOOTHING
        seconds, emitted = record.seconds / n, sum(tokens.values()) / n
        self.lane_seconds = seconds if self.lane_seconds is None else (1 - a) * self.lane_seconds + a * seconds
        self.lane_tokens = emitted if self.lane_tokens is None else (1 - a) * self.lane_tokens + a * emitted

    def view(self, lane: Any, lanes: list[Any]) -> Any:
        """`lane`'s `auto.SharedLoad` for the next round of `lanes` (None: nothing measured yet)."""
        others = [x for x in lanes if x is not lane]
        if not others:
            return SharedLoad()
        if self.lane_seconds is None or self.lane_tokens is None:
            return None
        seen = [self.lanes[id(x)] for x in others if id(x) in self.lanes]
        phases = max((s[1] for s in seen), default=0)
        return SharedLoad(others=len(others), oracle_rows=float(sum(s[0] for s in seen)), draft_phases=phases,
                          draft_rows=sum(s[2] for s in seen) / phases if phases else 0.0,
                          seconds=self.lane_seconds * len(others), tokens=self.lane_tokens * len(others),
                          oracle_scale=self.oracle_scale, draft_scale=self.draft_scale)


class Scheduler:
    """Owns the models; runs every admitted request's loop, one step each per round (see the module docstring)."""

    def __init__(self, engine: Engine, *, max_batch: int = 8, max_memory: int | None = None,
                 metrics: Metrics | None = None, round_pause: float = 0.0, batch_passes: bool = True,
                 step_timeout: float = 300.0) -> None:
        """`round_pause`: seconds to sleep after each round of steps (0 in service; tests set it through
        $STAGEDSPEC_SERVE_ROUND_PAUSE to keep tiny models' requests in flight long enough to cancel).
        `batch_passes`: gather the round's passes into ragged passes (`--no-batch-passes`: interleave).
        `step_timeout`: seconds a batched step may compute between passes before its request is failed."""
        if max_batch < 1:
            raise StagedSpecError(f"--max-batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.batch_passes = batch_passes
        model = getattr(engine, "model", None)  # thread count follows the machine's load (`stagedspec.threads`)
        self.governor = governor_for(model, getattr(engine, "threads", "auto")) if model is not None else None
        engine.batched_passes = batch_passes
        # what a request's output is guaranteed to share with its solo run (said at start and in /v1/models)
        self.exactness = batch_exactness(model, engine.draft_models, batch_passes=batch_passes,
                                         bit_exact=engine.bit_exact)
        self.memory = engine.memory_model()
        nodes = engine.speculation.max_tree_budget
        # Tree scratch: one pass's activations.  Interleaved, one request's pass runs at a time, so it is
        # counted once; batched, every running request's tree rows share the pass, so each request is
        # charged for its own rows (`_charge`), and those are what shrink under pressure (`server.pressure`).
        self.row_bytes = self.memory.row_bytes
        self.base_bytes = self.memory.weights + (0 if batch_passes else self.memory.scratch)
        full = engine.full_context_slots()
        uses_drafts = bool(engine.draft_models)
        per_request = self.memory.request_kv(full, nodes, uses_drafts) + (self.memory.scratch if batch_passes else 0)
        default_budget = self.memory.weights + self.memory.scratch + max_batch * per_request
        if batch_passes:
            default_budget -= self.memory.scratch
        self.max_memory = default_budget if max_memory is None else max_memory
        if self.max_memory < self.base_bytes + (self.memory.tree_scratch(0) if batch_passes else 0):
            raise StagedSpecError(f"--max-memory {format_size(self.max_memory)} is below what the models "
                                  f"need ({format_size(self.memory.weights + self.memory.scratch)})")
        self.metrics = metrics or Metrics()
        self.round_pause = round_pause
        self.batcher = PassBatcher(step_timeout, last=engine.model) if batch_passes else None
        self.load = LoadTracker(engine.model)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[_Running] = []
        self._kv_in_use = 0  # KV (and, batched, tree rows) charged to admitted requests
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="stagedspec-scheduler", daemon=True)
        self.metrics.update(memory_budget=self.max_memory, memory_in_use=self.base_bytes)

    def describe(self) -> str:
        text = self.memory.describe(self.max_memory, self.max_batch, self.engine.full_context_slots(),
                                    self.engine.speculation.max_tree_budget)
        if self.batch_passes:
            text += (f"; batched passes: tree scratch {format_size(self.row_bytes)}/row charged per request "
                     "(tree budgets shrink by halves under memory pressure)")
        return text

    # ---------------------------------------------------------------- client side (any thread)
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a job; a job that could never fit the memory budget is refused (400) at once."""
        uses_drafts = METHODS[job.plan.speculation.method].needs_drafts
        slots = self.engine.cache_slots(len(job.plan.prompt_ids), job.plan.max_new_tokens, job.plan.speculation)
        job.kv_bytes = self.memory.request_kv(slots, job.plan.speculation.max_tree_budget, uses_drafts)
        if self.base_bytes + self._charge(job, self._floor(job)) > self.max_memory:
            if job.reproducible and self.base_bytes + self._charge(job, root_only_level(
                    job.plan.speculation.max_tree_budget)) <= self.max_memory:
                raise APIError(400, "a seeded sampled request runs its full tree (its sample must not depend on "
                                    "what else the server runs), and that does not fit the server's memory budget: "
                                    "lower speculation.tree_budget, or drop the seed",
                               "speculation.tree_budget", "memory_budget_exceeded")
            # a request whose own tree is bigger than the server's trees is told to shrink the tree
            tree = job.plan.speculation.max_tree_budget > self.engine.speculation.max_tree_budget
            param, advice = (("speculation.tree_budget", "lower speculation.tree_budget") if tree
                             else ("max_tokens", "lower max_tokens or the prompt"))
            raise APIError(400, f"this request's KV cache ({format_size(job.kv_bytes)}) does not fit the server's "
                                f"memory budget ({format_size(self.max_memory - self.base_bytes)} after the "
                                f"models): {advice}", param, "memory_budget_exceeded")
        with self._cond:
            self._waiting.append(job)
            self.metrics.update(queued=len(self._waiting))
            self._cond.notify_all()

    def wake(self) -> None:
        """Let the worker see a cancellation now even if it is idle."""
        with self._cond:
            self._cond.notify_all()

    # ---------------------------------------------------------------- memory
    @staticmethod
    def _floor(job: Job) -> int:
        """A job's last shrink level: root-only trees; 0 for a seeded sampled request.

        Why 0: a seeded sample depends on the trees its steps verified (which arms ran, how the draws fall),
        and it must equal the same request run alone, whatever else the server runs.  Shrunk trees keep the
        distribution but not the sample.  So such a request never shrinks; it waits for room at its full
        tree, and others shrink to make it."""
        if job.reproducible:
            return 0
        return root_only_level(job.plan.speculation.max_tree_budget)

    def _charge(self, job: Job, level: int = 0) -> int:
        """What a request holds: its KV, plus (batched) its tree rows of the shared pass at shrink `level`."""
        if not self.batch_passes:
            return job.kv_bytes
        return job.kv_bytes + self.memory.tree_scratch(level_tree_budget(job.plan.speculation.max_tree_budget, level))

    def _free(self) -> int:
        return self.max_memory - self.base_bytes - self._kv_in_use

    def _set_level(self, r: _Running | _Joining, level: int) -> None:
        """Move a request to shrink `level` (a running one proposes under the new cap from its next step)."""
        self._kv_in_use += self._charge(r.job, level) - self._charge(r.job, r.level)
        r.level = level

    def _make_room(self, need: int, joining: list[_Joining]) -> bool:
        """Shrink admitted requests' trees a level at a time, newest request first, until `need` bytes are
        free; False (and nothing shrunk) if even root-only trees for all would not free enough."""
        newest_first = [*reversed(joining), *reversed(self._running)]
        spare = sum(self._charge(r.job, r.level) - self._charge(r.job, self._floor(r.job)) for r in newest_first)
        if self._free() + spare < need:
            return False
        for r in newest_first:
            while self._free() < need and r.level < self._floor(r.job):
                self._set_level(r, r.level + 1)
        return True

    def _regrow(self, joining: list[_Joining]) -> None:
        """Give trees back a level at a time, oldest request first, while the next level fits."""
        for r in [*self._running, *joining]:
            while r.level > 0 and self._charge(r.job, r.level - 1) - self._charge(r.job, r.level) <= self._free():
                self._set_level(r, r.level - 1)

    # ---------------------------------------------------------------- worker
    def _admit(self) -> list[_Joining]:
        """Under the lock: the waiting jobs that join now, each with the shrink level it starts at.

        FIFO, so a big job is not starved by small ones; with batched passes, trees shrink (the
        newcomer's to the largest that fits, then running requests', newest first, a level at a time)
        before a job is kept waiting.  What is left over goes back to shrunk trees, oldest first."""
        joining: list[_Joining] = []
        while self._waiting and len(self._running) + len(joining) < self.max_batch:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                self.metrics.record_finish("cancelled", [])
                continue
            levels = range(self._floor(job) + 1) if self.batch_passes else range(1)
            level = next((lv for lv in levels if self._charge(job, lv) <= self._free()), None)
            if level is None:
                if not self.batch_passes or not self._make_room(self._charge(job, self._floor(job)), joining):
                    break
                level = self._floor(job)
            self._waiting.popleft()
            self._kv_in_use += self._charge(job, level)
            joining.append(_Joining(job, level))
        if self.batch_passes:
            self._regrow(joining)
        return joining

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._running and not self._waiting:
                    self._cond.wait()
                if self._stop:
                    for r in list(self._running):
                        if r.lane is not None:
                            r.lane.close()
                    return
                joining = self._admit()
                self._publish()
            for j in joining:
                self._start(j.job, j.level)
            if joining:
                with self._cond:
                    self._publish()
            if self.governor is not None:
                self.governor.tick()
            self._round()
            if self.round_pause and self._running:
                time.sleep(self.round_pause)
            if not joining and not self._running:
                with self._cond:  # everything waiting was cancelled or cannot fit yet: wait for a change
                    if self._waiting and not self._stop:
                        self._cond.wait(0.05)

    def _round(self) -> None:
        """One step of every running request: batched on their lanes, or one after the other."""
        active = []
        for r in list(self._running):
            if r.job.cancelled.is_set():
                self._finish(r, "cancelled")
            else:
                active.append(r)
        if self.batcher is not None and len(active) != 1:
            for r in active:
                if r.load_aware:
                    r.request.drafter.shared_load = self.load.view(r.lane, [x.lane for x in active])
            first = {id(r.lane) for r in active if not r.request.token_ids}  # prompt prefill: not a step's load
            abandoned = set(map(id, self.batcher.run_round([(r.lane, r.run_step) for r in active])))
            record = self.batcher.last_round
            if record is not None:
                self.load.observe(record, {id(r.lane): len(r.outcome[0][0]) for r in active
                                           if r.outcome[0] is not None}, first,
                                  getattr(self.engine.learned.existing_policy("auto"), "profile", None))
            for r in active:
                if id(r.lane) in abandoned:
                    r.outcome = (None, StagedSpecError("this request's step took too long and was stopped"))
                self._after_step(r)
            self.metrics.update(ragged_passes=self.batcher.ragged_passes, ragged_segments=self.batcher.segments)
        else:
            # One after the other; a request alone in a batched round too: it has nothing to share a pass with,
            # so its step runs here and its lane's passes, called off the lane's thread, run as plain passes
            # (`Lane.__call__`), bit for bit a solo run's.  That saves the lane's two thread hand-offs a pass
            # (docs/measurements.md, "A lone request's step on the scheduler's thread on a Zen 4 EPYC").
            for r in active:
                if self.batcher is not None and r.load_aware:
                    r.request.drafter.shared_load = self.load.view(r.lane, [r.lane])
                r.run_step()
                self._after_step(r)

    def _start(self, job: Job, level: int = 0) -> None:
        lane = None
        try:
            if self.batcher is not None:
                lane = self.batcher.lane(f"stagedspec-request-{id(job):x}")
            r = _Running(job, self.engine, lane, level)
        except Exception as e:  # noqa: BLE001 - a request must never take the worker down
            if lane is not None:
                lane.close()
            self._release(job, "error", level)
            job.deliver(("error", 400 if isinstance(e, StagedSpecError) else 500, first_line(e)))
            return
        self.metrics.record_prompt(len(job.plan.prompt_ids))
        self._running.append(r)

    def _after_step(self, r: _Running) -> None:
        job = r.job
        out, error = r.outcome
        r.outcome = (None, None)
        if error is not None:
            if not isinstance(error, StagedSpecError):
                traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
            self._finish(r, "error")
            job.deliver(("error", 400 if isinstance(error, StagedSpecError) else 500, first_line(error)))
            return
        if out is not None:
            tokens, passes = out
            st = r.request.stats
            self.metrics.record_step(st.token_origins[-len(tokens):], st.accepted_lengths[-1], passes)
            piece = r.request.text.push(tokens)
            if piece:
                job.deliver(("text", piece))
        if out is None or r.over:
            piece = r.request.text.finish()
            if piece:
                job.deliver(("text", piece))
            stopped = r.request.text.stopped or r.request.stats.finish_reason == "stop"
            info = r.summary()
            self._finish(r, "completed", info)
            job.deliver(("done", "stop" if stopped else "length", info))

    def _finish(self, r: _Running, outcome: str, info: dict[str, Any] | None = None) -> None:
        self._running.remove(r)
        if r.lane is not None:
            r.lane.close()
        if info is None:
            info = r.summary()
        self.metrics.record_finish(outcome, info["stages"])
        with self._cond:
            self._kv_in_use -= self._charge(r.job, r.level)
            self._publish()
        r.passes.release()  # its pooled runners serve the next requests
        r.request.close()  # free the KV caches now, not when the HTTP side lets go
        del r.switch

    def _release(self, job: Job, outcome: str, level: int = 0) -> None:
        self.metrics.record_finish(outcome, [])
        with self._cond:
            self._kv_in_use -= self._charge(job, level)
            self._publish()

    def _publish(self) -> None:
        self.metrics.update(running=len(self._running), queued=len(self._waiting),
                            memory_in_use=self.base_bytes + self._kv_in_use,
                            trees_off=sum(1 for r in self._running if r.level >= self._floor(r.job)),
                            tree_levels=dict(Counter(r.level for r in self._running if r.level > 0)))
