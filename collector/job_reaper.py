"""The job reaper: waits for the managed jobs this agent started or took up, so none lingers as a zombie, and ends
the placement of each one that ends (out of memory or not, as its log says), with its lane's turn released."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
from sqlalchemy import select

from collector.launch import find_managed_processes
from collector.oom import ran_out_of_memory
from collector.sdk_handlers import LaneGate, SdkHandlers
from store.db import Store
from store.errors import DatabaseUnavailable
from store.models import Placement
from store.paths import log_path_for
from store.placements import end_placements
from store.settings import Settings

log = logging.getLogger(__name__)

GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def alive(proc: psutil.Process) -> bool:
    """Whether the process runs (a zombie does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except GONE:
        return False


@dataclass(frozen=True)
class ReaperHost:
    """What the reaper needs of the agent it serves: where to record endings, and whom to tell."""

    store: Store
    settings: Settings
    jobs: SdkHandlers | None  # the SDK socket's handlers: how a job said it ended
    gate: LaneGate | None  # the lane gate: a job that died mid-step gives its turn back
    flush_sdk: Callable[[], None]  # writes the steps the SDK reported, before a job is marked ended

class _Adopted:
    """A detached job an earlier agent on this host started: not our child, so watched through psutil; its exit
    code is unknown (its SDK goodbye says how it ended)."""

    returncode = None

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return None if alive(self.proc) else -1


class _Reaper:
    """Waits for the jobs this agent started or took up; when one ends, its placement ends (unless it is being
    moved). Its thread runs while an agent of this process runs, and ends when the last one stops (the jobs go on;
    an agent started later takes them up again)."""

    def __init__(self) -> None:
        self.children: dict[int, tuple[Any, str]] = {}  # pid -> (Popen, workflow)
        self.pending: list[tuple[str, int, str, bool]] = []  # endings the database could not take yet
        self.lock = threading.Lock()
        self.host: ReaperHost | None = None
        self._thread: threading.Thread | None = None
        self._running: list[threading.Event] = []  # the stop events of the agents it serves

    def add(self, popen: Any, workflow_id: str) -> None:
        with self.lock:
            self.children[popen.pid] = (popen, workflow_id)

    def forget(self, pids: list[int]) -> None:
        """No longer watch these jobs: their end is not theirs to record (a stale copy fenced, collector.job_fence,
        whose end must not end the job's placement elsewhere, or fail its workflow)."""
        with self.lock:
            for pid in pids:
                self.children.pop(pid, None)

    def adopt(self, store: Store, host_id: str) -> list[tuple[int, str]]:
        """Take up the detached jobs already running on this host (an agent restarted: its jobs went on).

        Found by their environment, and only those placed on this host in this agent's store; only session
        leaders, the way the agent starts jobs (a job run in the foreground by `fleetlens run` is that command's
        to reap). Returns (pid, workflow) of each one taken up."""
        running = find_managed_processes(host_id)
        if not running:
            return []
        try:
            with store.session() as session:
                placed = set(session.scalars(select(Placement.workflow_id).where(
                    Placement.host_id == host_id, Placement.state.in_(("active", "pending")),
                    Placement.workflow_id.in_(list(running)))))
        except DatabaseUnavailable:
            log.warning("the database is away: the jobs already running here are not taken up")
            return []
        taken = []
        for workflow, procs in running.items():
            if workflow not in placed:
                continue
            for proc in procs:
                try:
                    if os.getsid(proc.pid) != proc.pid:
                        continue
                except OSError:
                    continue
                with self.lock:
                    if proc.pid in self.children:
                        continue
                    self.children[proc.pid] = (_Adopted(proc), workflow)
                taken.append((proc.pid, workflow))
        for pid, workflow in taken:
            log.info("took up managed job %s (pid %d), started before this agent", workflow, pid)
        return taken

    def start(self, host: ReaperHost, stop: threading.Event) -> None:
        """Serve `host` (its agent's store, SDK handlers and gate) until `stop` is set."""
        with self.lock:
            self.host = host
            self._running = [e for e in self._running if not e.is_set()] + [stop]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="fleetlens-reaper", daemon=True)
                self._thread.start()

    def join_if_idle(self, timeout_s: float) -> None:
        """Wait for the thread to end once no agent of this process runs (one that still runs keeps it going)."""
        thread = self._thread
        if thread is not None and not self._serving():
            thread.join(timeout=timeout_s)

    def _serving(self) -> bool:
        with self.lock:
            return any(not e.is_set() for e in self._running)

    def _loop(self) -> None:
        while self._serving():
            time.sleep(0.5)
            try:
                self.reap()
            except Exception:
                log.exception("reaping managed jobs failed")

    def reap(self) -> None:
        with self.lock:
            ended = [(pid, popen, wf) for pid, (popen, wf) in self.children.items() if popen.poll() is not None]
            for pid, _, _ in ended:
                del self.children[pid]
            host = self.host
            gate = host.gate if host is not None else None
            handlers = host.jobs if host is not None else None
            for pid, popen, wf in ended:
                if gate is not None:
                    gate.release(wf, pid)  # a job that died mid-step must not keep its lane's turn
                said = handlers.take_outcome(wf, pid) if handlers is not None else None
                if popen.returncode is not None:
                    outcome = "finished" if popen.returncode == 0 else "failed"
                else:  # taken up from an earlier agent: no exit code, only what the job said on its way out
                    outcome = "finished" if said == "finished" else "failed"
                oom = outcome == "failed" and host is not None and ran_out_of_memory(
                    log_path_for(host.settings, wf))
                log.log(logging.WARNING if oom else logging.INFO, "managed job %s (pid %d) ended: %s%s", wf, pid,
                        outcome if popen.returncode is None else f"exit code {popen.returncode}",
                        ": out of memory (its lane-mates run on)" if oom else "")
                self.pending.append((wf, pid, outcome, oom))
            pending, self.pending = self.pending, []
        host = self.host
        if host is None or not pending:
            return
        try:
            host.flush_sdk()  # a job's last steps reach the store before the job is marked ended
        except Exception:  # the steps wait in the SDK's queue; the ending must not be lost with them
            log.exception("writing the job SDK's steps before recording how jobs ended failed")
        left = []
        for wf, pid, outcome, oom in pending:
            try:
                end_placements(host.store, wf, pid, outcome, out_of_memory=oom)
            except DatabaseUnavailable:
                left.append((wf, pid, outcome, oom))
            except Exception:  # this ending cannot be recorded (and would fail again): the others still are
                log.exception("the end of managed job %s (pid %d) could not be recorded", wf, pid)
        with self.lock:
            self.pending.extend(left)


REAPER = _Reaper()
