"""The agent's side of the job SDK: what it does with each message a training job sends over the socket.

The agent's socket server calls `SdkHandlers.handle(message)` from one thread per connection, so everything
here is thread-safe, and `handle` answers from memory only: a slow or absent database never stalls a job.
Database work (step summaries into `step_stats`, memory profiles onto the workflow, profile requests claimed
and traces registered) happens in `flush()`, which a small writer thread runs every `sync_interval_s` (and
the agent's flusher calls too); what the database cannot take yet stays queued, bounded, for the next try.

Every poll is answered with what the job should do next: capture a profile (requests in the store, cached
here by `flush`), or save a checkpoint (requests the enforcer makes through `request_checkpoint`, held in
memory because a checkpoint is only ever wanted from a job that runs now: collector.sdk_checkpoints). Lane gating
is delegated to an optional gate object the enforcer provides. What is known of each process served (heard from
lately, steps taken, its goodbye, what is kept once it ended) is collector.sdk_processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session

from collector import protocol as p
from collector.sdk_checkpoints import CheckpointRequests
from collector.sdk_context import ContextMeter
from collector.sdk_memory import ProcessMemory, as_int, note_memory, workflow_memory
from collector.sdk_processes import ProcessBook
from collector.sdk_step_writer import RefusalLog, RefusedCounts, StepWriter
from collector.sdk_workflows import touch_fields, touch_workflow
from collector.serving_sink import ServingSink
from store import profiling
from store.db import Store
from store.errors import DatabaseUnavailable, FleetlensError
from store.paths import trace_dir_for
from store.settings import Settings

log = logging.getLogger(__name__)

# a capturing request is handed to more ranks of the workflow only this long after the first one claimed it
PROFILE_JOIN_WINDOW_S = 30.0
MAX_QUEUED_STEP_ROWS = 200_000  # step summaries waiting for the database; past this the oldest are dropped
MAX_QUEUED_OPS = 10_000


class LaneGate(Protocol):
    """The enforcer's per-lane iteration gate (enforcer.gate.LaneGate, which the agent builds and passes in). `handle`
    may block until it is the job's turn to run a step; `release` forgets a process that stopped or ended."""

    def handle(self, message: dict[str, Any]) -> dict[str, Any]: ...

    def release(self, workflow: str, pid: int | None = None) -> int: ...


@dataclass
class _OpenProfile:
    """A profile request as last read from the store (or as this agent changed it since)."""

    id: int
    steps: int
    status: str
    claimed_at: float | None
    delivered: set[tuple[int, int]] = field(default_factory=set)


class SdkHandlers:
    """Answers the job SDK's requests on behalf of one host's agent."""

    def __init__(self, store: Store, host_id: str, settings: Settings, *, sync_interval_s: float = 1.0,
                 gate: LaneGate | None = None, stats: RefusedCounts | None = None) -> None:
        self.store, self.host_id, self.settings = store, host_id, settings
        # what the database refused of the SDK's rows is counted here: in the agent's stats, which the agent hands in
        self.stats = stats if stats is not None else RefusedCounts()
        self._refusals = RefusalLog(self.stats)
        self.sync_interval_s = sync_interval_s
        self.gate = gate  # the lane gate the agent built (None: no lanes here, every step may run)
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._checkpoints = CheckpointRequests()
        self._profiles: dict[str, list[_OpenProfile]] = {}  # workflow -> its open requests
        # (wf, pid) -> P, E, source, and how many steps the memory was seen for
        self._mem: ProcessMemory = {}
        self._dirty_mem: set[str] = set()
        self._context = ContextMeter()  # C per process: NVML's used memory less the allocator's reserved
        # the processes served: heard from lately, steps taken, goodbyes, ended (collector.sdk_processes)
        self._processes = ProcessBook(self._mem, self._context)
        self._step_rows: deque[dict[str, Any]] = deque()
        self._ops: deque[tuple[str, Callable[[Session], None]]] = deque()  # (what, db work), in order
        self._over_cap_logged = False  # the drops past the cap of this outage were logged
        self.duplicate_batches = 0  # step summaries sent again and not taken a second time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.serving = ServingSink(settings)  # serving loops' request histograms (collector.serving)

    # ---- the socket server's entry point -------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """One request in, one reply out, from memory; never raises (a bad message gets an error reply)."""
        try:
            self._ensure_writer()
            op = p.check_request(msg)
            return getattr(self, f"_on_{op}")(msg)
        except FleetlensError as exc:
            return p.error_reply(str(exc))
        except Exception as exc:  # a bug here must not take down the agent's socket thread
            log.exception("job SDK message %r failed", msg.get("op"))
            return p.error_reply(f"agent error: {type(exc).__name__}: {exc}")

    # ---- what the enforcer calls ---------------------------------------------------------------------

    def request_checkpoint(self, workflow_id: str, request_id: Any, directory: str | Path) -> None:
        """Ask the workflow's running job to checkpoint into `directory` at its next poll (between steps)."""
        with self._lock:
            self._checkpoints.request(workflow_id, request_id, directory)

    def checkpoint_result(self, request_id: Any) -> dict[str, Any] | None:
        """The job's answer, or None while there is none yet (or for an unknown request).

        Answered means rank 0 answered, or every rank told about it did. The dict holds request_id,
        workflow_id, status ("done" | "failed"), path, step (the next step to run), error, and `ranks`
        (each rank's answer).
        """
        with self._lock:
            return self._checkpoints.result(request_id)

    def checkpoint_delivered(self, request_id: Any) -> bool:
        """Whether a job has been told about the checkpoint request yet (it saves between steps after that)."""
        with self._lock:
            return self._checkpoints.delivered(request_id)

    def cancel_checkpoint(self, request_id: Any) -> None:
        with self._lock:
            self._checkpoints.cancel(request_id)

    def take_outcome(self, workflow_id: str, pid: int) -> str | None:
        """How the job's process said it ended (finished, failed, stopped), once; None if it never said goodbye."""
        with self._lock:
            return self._processes.outcomes.pop((workflow_id, pid), None)

    def said_goodbye(self, workflow_id: str, pid: int) -> bool:
        """Whether the job's process said how it ended, even if the reaper has taken its outcome since."""
        with self._lock:
            return (workflow_id, pid) in self._processes.byes

    def total_steps(self, workflow: str) -> int | None:
        """The step count a running job of `workflow` declared (SRTF's remaining work in the lane gate), if any."""
        for job in self.jobs():
            if job.get("workflow") == workflow and job.get("total_steps"):
                return int(job["total_steps"])
        return None

    def jobs(self) -> list[dict[str, Any]]:
        """The SDK jobs heard from recently: workflow, pid, rank, lane, step, total_steps, last_seen."""
        with self._lock:
            self._processes.forget_silent(time.time())
            return [dict(job) for job in self._processes.jobs.values()]

    # ---- the database side: the writer thread and the agent's flusher ------------------------------------

    def flush(self) -> None:
        """Write what is queued, and refresh the open profile requests of the jobs we serve.

        Raises DatabaseUnavailable when the database is away; nothing queued is lost then.
        """
        with self._flush_lock:
            # Only the updates that arrived before the steps written now: a job's "finished" (its goodbye) must
            # never reach the store ahead of the last steps it sent just before it.
            with self._lock:
                ops_before = len(self._ops)
            self._write_steps()
            self.serving.write(self.store)
            self._run_ops(ops_before)
            self._refresh_profiles()

    def close(self) -> None:
        """Stop the writer thread and write what is left (what cannot be written now is logged as lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        try:
            self.flush()
            self.flush()  # the updates that came in while the first flush wrote its steps
        except DatabaseUnavailable as exc:
            log.warning("job SDK data not written at shutdown (%d step summaries, %d updates): %s",
                        len(self._step_rows), len(self._ops), exc)

    def _ensure_writer(self) -> None:
        if self._thread is None and not self._stop.is_set():
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._writer, name="fleetlens-sdk-writer", daemon=True)
                    self._thread.start()

    def _writer(self) -> None:
        down = False
        while not self._stop.wait(self.sync_interval_s):
            try:
                self.flush()
                if down:
                    log.info("job SDK writes reach the database again")
                down = False
            except DatabaseUnavailable as exc:
                if not down:
                    log.warning("job SDK writes wait for the database: %s", exc)
                down = True
            except Exception:
                log.exception("job SDK write failed")

    def _write_steps(self) -> None:
        # What is written is taken off the queues first, so a summary or a memory change that arrives during the
        # write stays queued for the next one; on DatabaseUnavailable what was not written goes back in front, in
        # order. What the database refuses (not for being away) is given up alone: the rest is written
        # (collector.sdk_step_writer).
        with self._lock:
            self._processes.prune_ended(self._dirty_mem)
            rows = list(self._step_rows)
            self._step_rows.clear()
            dirty = set(self._dirty_mem)
            self._dirty_mem.clear()
            mem = {wf: workflow_memory(self._mem, wf) for wf in dirty}
            contexts = {wf: self._context.workflow_context(wf) for wf in dirty}
        if not rows and not mem:
            return
        writer = StepWriter(self.store, self.host_id, rows, mem, contexts)
        try:
            writer.write()
            self._over_cap_logged = False  # the database is back: a later outage's drops are logged again
        except DatabaseUnavailable:
            with self._lock:  # what was not written (nor given up) before the database went away: kept for the next try
                self._step_rows.extendleft(reversed([r for i, r in enumerate(rows) if i not in writer.done_rows]))
                self._trim_step_rows()
                self._dirty_mem |= dirty - writer.done_memory
            raise
        finally:
            for r in writer.refusals:
                self._refusals.note(r)

    def _trim_step_rows(self) -> None:
        """Drop the oldest queued step summaries past MAX_QUEUED_STEP_ROWS (the database has been away long).
        Call under the lock."""
        over = len(self._step_rows) - MAX_QUEUED_STEP_ROWS
        if over <= 0:
            return
        for _ in range(over):
            self._step_rows.popleft()
        self.stats.sdk_rows_over_cap += over
        if not self._over_cap_logged:
            self._over_cap_logged = True
            log.warning("job SDK: the database has been away so long that the step summaries waiting for it passed "
                        "%d; the oldest are dropped from now on while it stays away, counted in the agent's stats "
                        "(sdk_rows_over_cap)", MAX_QUEUED_STEP_ROWS)

    def _run_ops(self, limit: int) -> None:
        """Carry out the first `limit` queued updates, in order."""
        for _ in range(limit):
            with self._lock:
                if not self._ops:
                    return
                what, work = self._ops[0]
            try:
                with self.store.session() as session:
                    work(session)
            except DatabaseUnavailable:
                raise
            except FleetlensError as exc:  # this one cannot be done (gone workflow, missing file): say so, go on
                log.warning("job SDK %s not recorded: %s", what, exc)
            except Exception:
                log.exception("job SDK %s failed; dropped", what)
            with self._lock:
                self._ops.popleft()

    def _refresh_profiles(self) -> None:
        now = time.time()
        with self._lock:
            self._processes.forget_silent(now)
            workflows = {wf for wf, _pid in self._processes.jobs}
        if not workflows:
            return
        with self.store.session() as session:
            profiling.expire_stale(session, capture_timeout_s=self.settings.profile_capture_timeout_s, now=now)
            fresh = {wf: profiling.open_requests(session, wf, now=now) for wf in workflows}
        with self._lock:
            for wf, requests in fresh.items():
                known = {o.id: o for o in self._profiles.get(wf, [])}
                merged = []
                for r in requests:
                    mine = known.get(r.id)
                    if mine is not None and mine.status == profiling.CAPTURING:
                        merged.append(mine)  # our claim may not be written yet: keep what we told jobs
                    else:
                        merged.append(_OpenProfile(r.id, r.steps, r.status, r.claimed_at,
                                                   mine.delivered if mine else set()))
                self._profiles[wf] = merged
            for wf in set(self._profiles) - workflows:
                del self._profiles[wf]

    def _queue(self, what: str, work: Callable[[Session], None]) -> None:
        with self._lock:
            if len(self._ops) >= MAX_QUEUED_OPS:
                dropped, _ = self._ops.popleft()
                log.warning("job SDK queue full: dropped %s", dropped)
            self._ops.append((what, work))

    # ---- one method per op ---------------------------------------------------------------------------

    def _on_hello(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._seen(msg, step=msg.get("start_step"))
        start = as_int(msg.get("start_step"))
        key = (msg["workflow"], int(msg["pid"]))
        with self._lock:
            self._processes.hello(key, start)
        touch = touch_fields(msg)
        restart = int(msg.get("rank") or 0) == 0

        def work(session: Session) -> None:
            workflow = touch_workflow(session, touch)
            if restart and workflow.state in ("finished", "failed"):
                workflow.state = "running"  # the same workflow started again

        self._queue(f"hello from {msg['workflow']}", work)
        return self._instructions(msg)

    def _on_poll(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._seen(msg)
        return self._instructions(msg)

    def _on_steps(self, msg: dict[str, Any]) -> dict[str, Any]:
        batches = msg["batches"]
        self._seen(msg, step=int(batches[-1]["last_step"]) + 1 if batches else None)
        wf, pid, rank = msg["workflow"], int(msg["pid"]), int(msg.get("rank") or 0)
        with self._lock:
            fresh = self._processes.fresh((wf, pid), batches)
            self.duplicate_batches += len(batches) - len(fresh)
        batches = fresh
        rows = []
        for b in batches:
            row = {f: b[f] for f in p.BATCH_FIELDS}
            row.update(workflow_id=wf, host_id=self.host_id, pid=pid, rank=rank,
                       mem_persistent=as_int(b.get("mem_persistent")), mem_peak=as_int(b.get("mem_peak")),
                       mem_source=b.get("mem_source") if b.get("mem_source") in ("cuda", "rss") else None)
            rows.append(row)
        if rows:
            rows[0]["_touch"] = touch_fields(msg)  # the workflow row must exist before its step rows
        with self._lock:
            self._step_rows.extend(rows)
            self._trim_step_rows()
            if note_memory(self._mem, (wf, pid), batches):
                self._dirty_mem.add(wf)
            for b in batches:
                if b.get("mem_source") == "cuda" and self._context.note_reserved(
                        wf, pid, as_int(b.get("mem_reserved")), float(b["ts_end"])):
                    self._dirty_mem.add(wf)
        return self._instructions(msg)

    def note_process_memory(self, readings: list[tuple[int, int | None, float]]) -> None:
        """The agent's NVML readings of processes' used device memory, (pid, bytes, ts): paired with the SDK's
        reserved bytes of the same process, they measure its memory outside the allocator (collector.sdk_context)."""
        with self._lock:
            for pid, used, ts in readings:
                wf = self._context.note_nvml(pid, used, ts)
                if wf is not None:
                    self._dirty_mem.add(wf)

    def _on_serving(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.serving.handle(msg) is False:
            return {"ok": True, "duplicate": True}  # merged already: this is a resend of a late-answered message
        return {"ok": True}

    def _on_profile_done(self, msg: dict[str, Any]) -> dict[str, Any]:
        request_id, wf, rank = int(msg["request_id"]), msg["workflow"], int(msg.get("rank") or 0)
        path, steps, size = msg["path"], as_int(msg.get("steps")), as_int(msg.get("size_bytes"))

        def work(session: Session) -> None:
            try:
                profiling.register_trace(session, wf, path, rank, request_id, host_id=self.host_id, steps=steps,
                                         size_bytes=size)
            except FleetlensError as exc:
                profiling.fail(session, request_id, f"the job's trace could not be registered: {exc}")
                return
            profiling.complete(session, request_id)

        self._queue(f"trace of profile request #{request_id}", work)
        return {"ok": True}

    def _on_profile_failed(self, msg: dict[str, Any]) -> dict[str, Any]:
        request_id, error = int(msg["request_id"]), f"the job could not capture: {msg['error']}"

        def work(session: Session) -> None:
            profiling.fail(session, request_id, error)

        self._queue(f"failure of profile request #{request_id}", work)
        return {"ok": True}

    def _on_checkpoint_done(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self._checkpoint_answer(msg, {"status": "done", "path": msg["path"], "step": int(msg["step"])})

    def _on_checkpoint_failed(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self._checkpoint_answer(msg, {"status": "failed", "path": None, "step": as_int(msg.get("step")),
                                             "error": str(msg["error"])})

    def _on_gate(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg["phase"] not in ("begin", "end", "renew"):
            return p.error_reply(f"gate phase must be begin, end or renew, not {msg['phase']!r}")
        gate = self.gate
        if gate is None:  # no lanes on this host: every step may run
            return {"ok": True, "granted": True}
        return gate.handle(msg)

    def _on_bye(self, msg: dict[str, Any]) -> dict[str, Any]:
        wf, pid, outcome = msg["workflow"], int(msg["pid"]), msg["outcome"]
        with self._lock:
            self._processes.bye((wf, pid), outcome)
        if int(msg.get("rank") or 0) == 0 and outcome in ("finished", "failed"):
            touch = touch_fields(msg)

            def work(session: Session) -> None:
                workflow = touch_workflow(session, touch)
                if workflow.state == "running":  # a job being moved ("moving") is the enforcer's to settle
                    workflow.state = outcome

            self._queue(f"end of {wf}", work)
        return {"ok": True}

    # ---- helpers -------------------------------------------------------------------------------------

    def _seen(self, msg: dict[str, Any], step: int | None = None) -> None:
        with self._lock:
            self._processes.seen(msg, step)

    def _checkpoint_answer(self, msg: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if not self._checkpoints.answer(msg["request_id"], msg.get("rank"), answer):
                return p.error_reply(f"no checkpoint request {msg['request_id']!r} is waiting (cancelled?)")
        return {"ok": True}

    def _instructions(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The poll reply: a checkpoint to save and/or a profile to capture, if any is waiting for this job."""
        reply: dict[str, Any] = {"ok": True}
        wf, who, now = msg["workflow"], (int(msg["pid"]), int(msg.get("rank") or 0)), time.time()
        with self._lock:
            checkpoint = self._checkpoints.deliver(wf, who)
            if checkpoint is not None:
                reply["checkpoint"] = checkpoint
            for request in self._profiles.get(wf, []):
                if who in request.delivered:
                    continue
                if request.status == profiling.PENDING:
                    request.status, request.claimed_at = profiling.CAPTURING, now
                    self._ops.append((f"claim of profile request #{request.id}", _claimer(request.id, now)))
                elif request.claimed_at is None or now - request.claimed_at > PROFILE_JOIN_WINDOW_S:
                    continue
                request.delivered.add(who)
                reply["profile"] = {
                    "request_id": request.id, "steps": request.steps,
                    "trace_dir": str(trace_dir_for(self.settings.trace_dir, wf, request.id)),
                }
                break
        return reply


def _claimer(request_id: int, now: float) -> Callable[[Session], None]:
    def work(session: Session) -> None:
        profiling.claim(session, request_id, now=now)

    return work
