"""The job-side SDK a training script uses: step timing, on-demand profiling, checkpoint and resume hooks.

    from collector.job import job

    with job(name="resnet", total_steps=10_000, checkpoint=save, restore=load) as j:
        for batch in j.steps(loader):
            train_step(batch)

`j.steps()` times every step in memory and sends summaries to the host's agent about once a second (never a
socket round trip per step); each send is also the job's poll for work: a profile request (the next N steps
are traced with torch.profiler into gzipped Kineto JSON) or a checkpoint request (the `checkpoint` callback
runs between steps), both carried out by collector.job_requests. Without an agent the loop runs exactly the same
and the SDK tries to connect again only every `sdk_retry_s`. Nothing the SDK does may stop training: agent errors are
logged at debug level.

In a lane a step's turn ends when the step's GPU work is done, not when the loop body returns (CUDA runs
asynchronously): the SDK records a CUDA event at the end of the step and hands the turn on once it has completed,
renewing the turn's lease while the event is pending (collector.turns), and releasing the step's cached memory
(`torch.cuda.empty_cache()`) before it does. A loop left mid-step (`break`, an exception) gives its turn up at once.
On a CPU device (no torch, or no CUDA) there is nothing to wait for and nothing extra is done. `step_done=` gives
a waiter of the job's own instead (a job that runs its work on streams of its own, say).

Environment (through store.settings): FLEETLENS_WORKFLOW names the workflow; FLEETLENS_RESUME_FROM (and
FLEETLENS_RESUME_STEP) say where to resume; FLEETLENS_MEMORY_FRACTION caps this process's CUDA memory (in a lane:
during its turn, and FLEETLENS_IDLE_MEMORY_FRACTION outside it);
FLEETLENS_LANE turns on the per-step lane gate; RANK (or FLEETLENS_RANK) is the trace's rank. Under Slurm
(collector.slurm_job): FLEETLENS_MOVABLE (or `movable=True`) opts the job in to be moved, and a shard job caps its
CUDA memory at its shards' share of the GPU unless FLEETLENS_MEMORY_FRACTION says otherwise.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from collector import protocol as p
from collector.device_caps import DeviceCaps
from collector.job_capture import TraceCapture
from collector.job_memory import StepMemory
from collector.job_origin import default_workflow_id, start_step
from collector.job_requests import act, capture_step, send_finished_captures
from collector.sdk_settings import job_settings
from collector.slurm_job import SlurmSide
from collector.turns import CudaStepWaiter, LeaseKeeper, TurnMemory
from store.errors import InvalidInput
from store.settings import Settings

log = logging.getLogger(__name__)

MAX_OUTBOX = 600  # step summaries kept while no agent listens (about ten minutes at one a second)
MAX_BATCHES_PER_MESSAGE = 200

CheckpointFn = Callable[[str], "str | os.PathLike[str] | None"]
RestoreFn = Callable[[str], "int | None"]
StepDoneFn = Callable[[], None]  # blocks until the step's device work has finished


def job(
    name: str | None = None,
    *,
    total_steps: int | None = None,
    checkpoint: CheckpointFn | None = None,
    restore: RestoreFn | None = None,
    workflow: str | None = None,
    rank: int | None = None,
    settings: Settings | None = None,
    step_done: StepDoneFn | None = None,
    movable: bool | None = None,
) -> Job:
    """A `Job` to use as a context manager around the training loop (see the module's docstring). Without
    `settings`, the job's environment is read here, once (collector.sdk_settings). `movable=True` (or
    FLEETLENS_MOVABLE=true) asks fleetlens to move this job when it runs under Slurm (collector.slurm_job)."""
    if settings is None:
        settings = job_settings()
    return Job(name, total_steps=total_steps, checkpoint=checkpoint, restore=restore, workflow=workflow,
               rank=rank, settings=settings, step_done=step_done, movable=movable)


def cuda_step_waiter(torch: Any) -> StepDoneFn:
    """A step-done waiter for CUDA: record an event on the current stream after the step's last kernel was queued,
    then block (without spinning: a blocking event) until the device has run it."""
    return CudaStepWaiter(torch)


class Job:
    """One training process as fleetlens sees it. Use `job(...)`; see the module's docstring."""

    def __init__(
        self,
        name: str | None = None,
        *,
        total_steps: int | None = None,
        checkpoint: CheckpointFn | None = None,
        restore: RestoreFn | None = None,
        workflow: str | None = None,
        rank: int | None = None,
        settings: Settings,
        step_done: StepDoneFn | None = None,
        movable: bool | None = None,
    ) -> None:
        if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                        or total_steps < 0):
            raise InvalidInput(f"total_steps must be a whole number of steps >= 0, not {total_steps!r}")
        self.settings = settings
        self.name = name
        self.total_steps = total_steps
        self._checkpoint_fn = checkpoint
        self._restore_fn = restore
        if workflow:
            self.workflow_id, self.id_source = workflow, "env"
        else:
            self.workflow_id, self.id_source = default_workflow_id(self.settings)
        self.rank = self.settings.rank if rank is None else int(rank)
        self.pid = os.getpid()
        self.lane = self.settings.lane
        self.resume_from: Path | None = self.settings.resume_from
        self.start_step = 0
        self.memory_fraction_applied: float | None = None
        # in a lane, the turn passes on only once this returns (the step's GPU work is done); None: at once
        self.step_waiter: StepDoneFn | None = step_done
        self.step_wait_s = 0.0  # seconds spent in the waiter, all steps together
        self._renew_every_s = 20.0  # a third of the gate's lease, once the gate said it
        self._holding: int | None = None  # the step whose lane turn this job holds now
        # renewals go over a connection of their own, from the keeper's thread, while this one waits on the step
        self._renew_conn = p.AgentConnection(self.settings.socket_path, self.settings.sdk_timeout_s)
        self._lease = LeaseKeeper(self._renew)
        self._turn_memory: TurnMemory | None = None
        self._device_caps: DeviceCaps | None = None  # the memory cap, on each device as the process uses it
        self.checkpoints: list[dict[str, Any]] = []  # what this job saved on request: path, step, request_id
        self.traces: list[str] = []  # trace files this job wrote
        self._step = 0
        self._times: list[float] = []
        self._last_step_end = 0.0  # perf_counter at the end of the newest step timed
        self._outbox: deque[dict[str, Any]] = deque(maxlen=MAX_OUTBOX)
        self._conn = p.AgentConnection(self.settings.socket_path, self.settings.sdk_timeout_s)
        self._next_connect = 0.0
        self._next_flush = 0.0
        self._torch: Any = None
        self._cuda = False
        self._step_memory = StepMemory()  # the CPU's until start() finds CUDA
        self._capture: TraceCapture | None = None
        self._finished_captures: list[dict[str, Any]] = []  # filled by capture threads, sent by the loop
        self._capture_threads: list[threading.Thread] = []
        self._started = False
        self._closed = False
        self._warned: set[str] = set()
        self._slurm = SlurmSide.from_settings(  # None outside a Slurm job; `movable` (else FLEETLENS_MOVABLE) opts in
            self.settings, self.workflow_id, movable=self.settings.movable if movable is None else bool(movable))

    # ---- lifecycle -----------------------------------------------------------------------------------

    def __enter__(self) -> Job:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            outcome = "finished"
        elif issubclass(exc_type, KeyboardInterrupt | SystemExit):
            outcome = "stopped"
        else:
            outcome = "failed"
        self.close(outcome)

    def start(self) -> Job:
        """Resume if asked to, apply the memory cap, and say hello to the agent (if one listens)."""
        if self._started:
            return self
        self._started = True
        if self._slurm is not None:
            self._slurm.install()
            if self.resume_from is None:
                self.resume_from = self._slurm.resume_path()
        self.start_step = start_step(self.resume_from, self._restore_fn, self.settings.resume_step)
        self._torch = sys.modules.get("torch")  # only a job that uses torch has CUDA memory to watch
        if self.settings.memory_fraction is not None:
            self._apply_memory_fraction(self.settings.memory_fraction)
        elif self._slurm is not None and self._torch is not None and (self._slurm.memory_fraction or 1.0) < 1.0:
            self._apply_memory_fraction(self._slurm.memory_fraction)  # a shard job: its share of the GPU
        if self._slurm is not None:
            self._slurm.started(self.start_step, enforced=self.memory_fraction_applied is not None)
        self._cuda = bool(self._torch is not None and self._torch.cuda.is_available())
        if self._cuda:
            self._step_memory = StepMemory(self._torch)
        if self._cuda and self.lane is not None:
            turn = self.memory_fraction_applied
            idle = self.settings.idle_memory_fraction if turn is not None else None
            self._turn_memory = TurnMemory(self._torch, turn or 1.0, idle)
            if idle is not None:
                self._torch.cuda.set_per_process_memory_fraction(idle)  # outside a turn: the persistent share
        if self.step_waiter is None and self._cuda and self.lane is not None:
            self.step_waiter = cuda_step_waiter(self._torch)  # CPU devices get none: nothing to wait for
        self._step = self.start_step
        self._next_flush = time.perf_counter() + self.settings.sdk_flush_interval_s
        self._link_ready()
        return self

    def close(self, outcome: str = "finished") -> None:
        """Finish any capture, send the last step summaries and say goodbye. Never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._holding is not None:  # left its loop holding the turn (an exception, a kept generator)
                self._release_turn(self._holding, again=False)
            if self._capture is not None:
                self._capture.finish()
                self._capture = None
            for thread in self._capture_threads:
                thread.join()
            self._flush(time.perf_counter())
            send_finished_captures(self)
            if self._conn.connected:
                self._send(self._msg(p.BYE, outcome=outcome, last_step=self._step - 1))
        except Exception:
            log.debug("fleetlens job close failed", exc_info=True)
        finally:
            self._lease.close()
            self._renew_conn.close()
            self._conn.close()

    # ---- the training loop -----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps done so far, counting from 0 at the very start of training (so the next step's index)."""
        return self._step

    @property
    def connected(self) -> bool:
        return self._conn.connected

    @property
    def renewals(self) -> int:
        """Lease renewals sent while waiting for steps' device work."""
        return self._lease.renewals

    def _renew(self) -> None:
        """From the lease keeper's thread: the step whose turn we hold is still running on the device."""
        if self._holding is not None and self._conn.connected:
            self._renew_conn.request(self._msg(p.GATE, lane=self.lane, step=self._holding, phase="renew"))

    def steps(self, iterable: Iterable[Any] | None = None) -> Iterator[Any]:
        """Yield the items of `iterable` (or the step indices) one step at a time, up to `total_steps`.

        A step is timed from asking `iterable` for its item to the loop body handing control back, so data
        loading counts. In a lane the turn is taken before the item is asked for (a batch the loader moves to the
        GPU is within the turn's memory cap), the step lasts until its device work is done (the step waiter), and
        only then is the lane's turn handed on, so lane-mates' kernels never run at the same time. Counting starts at
        the resume step; call `steps()` again for the next epoch.
        """
        if not self._started:
            self.start()
        source = iter(iterable) if iterable is not None else itertools.count()
        indices = iterable is None
        limit, times, clock = self.total_steps, self._times, time.perf_counter
        in_lane, cuda, waiter = self.lane is not None, self._cuda, self.step_waiter
        flush_steps = self.settings.sdk_flush_steps
        last = clock()
        caps = self._device_caps
        while limit is None or self._step < limit:
            if cuda:
                if caps is not None:
                    caps.apply()
                self._step_memory.begin()
            if in_lane:  # the turn covers data loading too: a batch the loader puts on the GPU is within its cap
                self.gate()
            try:
                item = next(source)
            except StopIteration:  # the data ran out: the turn taken for it passes on now
                self._leave_turn()
                return
            except BaseException:
                self._leave_turn()
                raise
            try:
                yield self._step if indices else item
            except GeneratorExit:  # the loop was left mid-step (`break`): its turn passes on now, not at the lease
                self._leave_turn()
                raise
            if in_lane and waiter is not None:
                waited = clock()
                self._lease.wait(waiter, self._renew_every_s)
                self.step_wait_s += clock() - waited
            now = clock()
            times.append(now - last)
            last = now
            self._step += 1
            self._last_step_end = now
            if cuda:
                self._step_memory.end()
            if in_lane:
                self._end_turn(self._step - 1, again=True)
            if self._capture is not None:
                capture_step(self)
            if self._slurm is not None and self._slurm.asked:
                self._slurm.checkpoint(self._checkpoint_fn, self._step)
                last = clock()
            if now >= self._next_flush or len(times) >= flush_steps:
                self._flush(now)
                last = clock()  # the poll's own work (a checkpoint, say) is not the next step's

    def gate(self) -> None:
        """The per-step lane gate: outside a lane a no-op; in one, wait until the agent says it is our turn."""
        if self.lane is not None:
            self._gate_request("begin", self._step)
            self._holding = self._step
            if self._turn_memory is not None:
                self._turn_memory.begin()

    def _end_turn(self, step: int, *, again: bool) -> None:
        """The step's device work is done: release its cached memory, then hand the turn on."""
        if self._turn_memory is not None:
            self._turn_memory.end()
        self._holding = None
        self._gate_request("end", step, again=again)

    def _leave_turn(self) -> None:
        """The loop stops (data ran out, `break`, an error) while holding a turn: give it up for good."""
        if self._holding is not None:
            self._release_turn(self._holding, again=False)

    def _release_turn(self, step: int, *, again: bool) -> None:
        """Give the turn up from outside the loop's normal path: wait for what the step queued, then end it."""
        try:
            if self.step_waiter is not None:
                self.step_waiter()
        except Exception:
            log.debug("waiting for the abandoned step's device work failed", exc_info=True)
        try:
            self._end_turn(step, again=again)
        except Exception:
            log.debug("releasing the lane turn failed", exc_info=True)

    # ---- memory -----------------------------------------------------------------------------

    def _apply_memory_fraction(self, fraction: float) -> None:
        torch = self._torch
        if torch is None:
            import torch  # asked for a CUDA memory cap: this job uses torch
            self._torch = torch
        if torch.cuda.is_available():
            self._device_caps = DeviceCaps(torch, fraction)
            self._device_caps.apply(initialise=True)  # the current device now; others as the steps come to use them
            self.memory_fraction_applied = fraction

    # ---- talking to the agent --------------------------------------------------------------------------

    def _msg(self, op: str, **fields: Any) -> dict[str, Any]:
        return {"op": op, "v": p.VERSION, "workflow": self.workflow_id, "pid": self.pid, "rank": self.rank,
                **fields}

    def _flush(self, now: float) -> None:
        times = self._times
        if times:
            n, ordered, total = len(times), sorted(times), math.fsum(times)
            persistent, peak, source = self._step_memory.summary()
            # the wall time the newest step ended, not now: a summary sent later (at close, after an evaluation,
            # in the next epoch's loop) keeps the time its steps ran
            wall = time.time() - max(0.0, time.perf_counter() - self._last_step_end)
            self._outbox.append({
                "first_step": self._step - n, "last_step": self._step - 1, "n_steps": n,
                "ts_start": wall - total, "ts_end": wall, "mean_s": total / n,
                "p50_s": ordered[(n - 1) // 2], "p95_s": ordered[max(0, math.ceil(0.95 * n) - 1)],
                "max_s": ordered[-1], "mem_persistent": persistent, "mem_peak": peak, "mem_source": source,
                "mem_reserved": self._step_memory.reserved(),
            })
            times.clear()  # in place: steps() holds this list
        self._next_flush = now + self.settings.sdk_flush_interval_s
        send_finished_captures(self)
        if not self._link_ready():
            return
        if self._outbox:
            batches = list(itertools.islice(self._outbox, MAX_BATCHES_PER_MESSAGE))
            reply = self._send(self._msg(p.STEPS, batches=batches))
            if reply is not None and (reply.get("ok") or not reply.get("retry")):
                for _ in batches:  # taken (or refused for good: resending would not help)
                    self._outbox.popleft()
        else:
            reply = self._send(self._msg(p.POLL))
        if reply is not None:
            act(self, reply)  # a checkpoint or a profile the agent asks for (collector.job_requests)

    def _link_ready(self) -> bool:
        """Connected to the agent, connecting (and saying hello) if it is time to try again."""
        if self._conn.connected:
            return True
        now = time.monotonic()
        if now < self._next_connect:
            return False
        try:
            self._conn.connect()
        except OSError as exc:
            self._next_connect = now + self.settings.sdk_retry_s
            self._note_once("connect", "no fleetlens agent at %s (%s); training goes on without one",
                            self.settings.socket_path, exc)
            return False
        reply = self._send(self._msg(
            p.HELLO, name=self.name, total_steps=self.total_steps, start_step=self._step, lane=self.lane,
            id_source=self.id_source, host=socket.gethostname(), sweep=self.settings.sweep, trial=self.settings.trial,
        ))
        if reply is None:
            return False
        act(self, reply)
        return self._conn.connected

    def _send(self, message: dict[str, Any], *, wait_forever: bool = False) -> dict[str, Any] | None:
        try:
            reply = self._conn.request(message, wait_forever=wait_forever)
        except OSError as exc:
            self._next_connect = time.monotonic() + self.settings.sdk_retry_s
            self._note_once("lost", "lost the fleetlens agent (%s); training goes on", exc)
            return None
        if not reply.get("ok"):
            log.debug("the agent refused %s: %s", message.get("op"), reply.get("error"))
        return reply

    def _note_once(self, key: str, fmt: str, *args: Any) -> None:
        level = logging.DEBUG if key in self._warned else logging.INFO
        self._warned.add(key)
        log.log(level, fmt, *args)

    def _gate_request(self, phase: str, step: int, *, again: bool = True) -> None:
        if not self._link_ready():
            return  # no agent: a job never waits for a gate nobody keeps
        extra = {} if again else {"again": False}
        reply = self._send(self._msg(p.GATE, lane=self.lane, step=step, phase=phase, **extra),
                           wait_forever=phase == "begin")
        if reply is not None and not reply.get("ok"):
            self._note_once("gate", "lane gate refused (%s); running ungated", reply.get("error"))
        elif reply is not None and isinstance(reply.get("lease_s"), int | float) and reply["lease_s"] > 0:
            self._renew_every_s = float(reply["lease_s"]) / 3.0

    # ---- what the agent asks for (collector.job_requests) ------------------------------------------------

    def _capture_finished(self, result: dict[str, Any]) -> None:
        """Called from a capture's writer thread; the training loop sends it at its next flush."""
        self._finished_captures.append(result)
