"""The agent's side of managed jobs and migration: signed `launch`, `checkpoint`, `stop` and `relaunch` commands,
the per-lane iteration gate on the SDK socket, and reaping the jobs this agent started.

Importing the module registers the four command kinds with collector.command_runner; `install(agent)` (called by
the agent at start) puts the enforcer's `LaneGate` behind the SDK socket and starts the reaper. Every handler is
idempotent, because the enforcer re-sends a command whose outcome it never saw (agent killed, database away):
launching or relaunching a job that already runs returns the running process, stopping one that is gone says so.

A relaunch runs only the command line registered for the workflow in the store (never one from the command),
and resumes only from a checkpoint inside the workflow's own checkpoint folder.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from collector.command_runner import CommandContext, register_handler
from collector.launch import find_job_processes, job_env, spawn_job
from enforcer.gate import LaneGate
from store.errors import DatabaseUnavailable, InvalidInput, NotFound
from store.models import Workflow
from store.paths import log_path_for
from store.placements import end_placements, mark_started

log = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 3.0  # seconds a started job must survive (or say hello sooner)
DEFAULT_STOP_GRACE_S = 10.0
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


# ---- the children this agent started, reaped so they never linger as zombies -----------------------------

class _Reaper:
    """Waits for the jobs this agent started; when one ends, its placement ends (unless it is being moved)."""

    def __init__(self) -> None:
        self.children: dict[int, tuple[Any, str]] = {}  # pid -> (Popen, workflow)
        self.pending: list[tuple[str, int, str]] = []  # endings the database could not take yet
        self.lock = threading.Lock()
        self.agent: Any = None
        self._thread: threading.Thread | None = None

    def add(self, popen: Any, workflow_id: str) -> None:
        with self.lock:
            self.children[popen.pid] = (popen, workflow_id)

    def start(self, agent: Any) -> None:
        self.agent = agent
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="fleetlens-reaper", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
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
            gate = getattr(getattr(self.agent, "sdk_handler", None), "gate", None)
            for pid, popen, wf in ended:
                if gate is not None and hasattr(gate, "release"):
                    gate.release(wf, pid)  # a job that died mid-step must not keep its lane's turn
                outcome = "finished" if popen.returncode == 0 else "failed"
                log.info("managed job %s (pid %d) ended with exit code %s", wf, pid, popen.returncode)
                self.pending.append((wf, pid, outcome))
            pending, self.pending = self.pending, []
        agent = self.agent
        if agent is None or not pending:
            return
        flush_steps = getattr(agent, "flush_sdk", None)
        if callable(flush_steps):
            flush_steps()  # a job's last steps reach the store before the job is marked ended
        left = []
        for wf, pid, outcome in pending:
            try:
                end_placements(agent.store, wf, pid, outcome)
            except DatabaseUnavailable:
                left.append((wf, pid, outcome))
        with self.lock:
            self.pending.extend(left)


REAPER = _Reaper()


def install(agent: Any) -> None:
    """Called by the agent once it serves the SDK socket: the lane gate goes behind the socket, the reaper starts."""
    handlers = getattr(agent, "sdk_handler", None)
    if handlers is not None and hasattr(handlers, "gate") and handlers.gate is None:
        handlers.gate = LaneGate(agent.settings.policy, total_steps=_total_steps_lookup(handlers))
    REAPER.start(agent)


def _total_steps_lookup(handlers: Any) -> Any:
    def lookup(workflow: str) -> int | None:
        for job in handlers.jobs():
            if job.get("workflow") == workflow and job.get("total_steps"):
                return int(job["total_steps"])
        return None

    return lookup


# ---- starting a job -----------------------------------------------------------------------------------------

def _workflow(ctx: CommandContext, workflow_id: str) -> dict[str, Any]:
    with ctx.store.session() as session:
        wf = session.get(Workflow, workflow_id)
        if wf is None:
            raise NotFound(f"workflow {workflow_id!r} is not in the store")
        if not wf.managed or not wf.command:
            raise InvalidInput(f"workflow {workflow_id!r} is not a managed job with a registered command line")
        return {"command": list(wf.command), "cwd": wf.cwd or "/", "checkpoint_dir": wf.checkpoint_dir}


def _start(ctx: CommandContext, workflow_id: str, device_ids: list[int], lane_id: int | None, *,
           resume_from: str | None, resume_step: int | None, timeout_s: float) -> dict[str, Any]:
    running = [p for p in find_job_processes(workflow_id, ctx.host_id) if _alive(p)]
    if running:  # a re-sent command, or the previous agent started it before it died
        return {"pid": running[0].pid, "already_running": True, "connected": True}
    wf = _workflow(ctx, workflow_id)
    if resume_from is not None:
        folder = Path(wf["checkpoint_dir"] or "").resolve()
        target = Path(resume_from).resolve()
        if not wf["checkpoint_dir"] or not target.is_relative_to(folder):
            raise InvalidInput(f"refusing to resume {workflow_id!r} from {resume_from}: not inside its checkpoint "
                               f"folder {wf['checkpoint_dir']}")
        if not target.exists():
            raise InvalidInput(f"the checkpoint {resume_from} to resume {workflow_id!r} from does not exist")
    with ctx.store.session() as session:
        env, cores = job_env(session, workflow_id, device_ids, lane_id, host_id=ctx.host_id,
                             resume_from=resume_from, resume_step=resume_step, mps_dirs=ctx.settings.mps_dirs)
    log_path = log_path_for(ctx.settings, workflow_id)
    with open(log_path.parent.mkdir(parents=True, exist_ok=True) or log_path, "ab") as f:
        f.write(f"--- fleetlens: starting at {time.ctime()} on devices {device_ids} lane {lane_id}"
                f"{' resuming from ' + resume_from if resume_from else ''}\n".encode())
    popen = spawn_job(wf["command"], wf["cwd"], env, cores=cores, log_path=log_path, detach=True)
    REAPER.add(popen, workflow_id)
    return _confirm(ctx, popen, workflow_id, log_path, timeout_s)


def _confirm(ctx: CommandContext, popen: Any, workflow_id: str, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Wait until the job says hello on the SDK socket or has run `timeout_s`: an exit before that is a failure."""
    handlers = getattr(ctx.agent, "sdk_handler", None)
    jobs = getattr(handlers, "jobs", None)
    # a job without the SDK never says hello: surviving `timeout_s` (a few seconds) is all we can check then
    deadline = time.monotonic() + timeout_s
    connected = False
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            tail = _tail(log_path)
            raise RuntimeError(f"{workflow_id} exited at once with code {popen.returncode}: {tail}")
        if callable(jobs) and any(j.get("workflow") == workflow_id and j.get("pid") == popen.pid for j in jobs()):
            connected = True
            break
        time.sleep(0.05)
    return {"pid": popen.pid, "log": str(log_path), "connected": connected}


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return "(no log)"


def handle_launch(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Start a registered managed job where `fleetlens run --detach` placed it; its placement gets the pid."""
    workflow_id = str(payload["workflow_id"])
    result = _start(ctx, workflow_id, [int(d) for d in payload["device_ids"]], payload.get("lane_id"),
                    resume_from=None, resume_step=None,
                    timeout_s=float(payload.get("timeout_s", DEFAULT_START_TIMEOUT_S)))
    mark_started(ctx.store, workflow_id, [int(p) for p in payload.get("placement_ids", [])], result["pid"])
    return result


def handle_relaunch(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Start the workflow's registered command on a device / lane, resuming from its checkpoint."""
    return _start(ctx, str(payload["workflow_id"]), [int(payload["device_id"])], payload.get("lane_id"),
                  resume_from=payload.get("resume_from"), resume_step=payload.get("resume_step"),
                  timeout_s=float(payload.get("timeout_s", DEFAULT_START_TIMEOUT_S)))


# ---- checkpoint and stop ----------------------------------------------------------------------------------------

def handle_checkpoint(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Ask the running job (through the SDK socket) to checkpoint, and wait for its answer.

    Result `status`: done (path, step), failed (the job's error), timeout (no answer in time; the request is
    withdrawn and the job goes on), gone (the job is not running, or died before answering)."""
    workflow_id, request_id = str(payload["workflow_id"]), str(payload["request_id"])
    timeout_s = float(payload.get("timeout_s", ctx.settings.checkpoint_timeout_s))
    handlers = getattr(ctx.agent, "sdk_handler", None)
    if handlers is None or not hasattr(handlers, "request_checkpoint"):
        raise InvalidInput("this agent serves no job SDK socket, so it cannot ask a job to checkpoint")
    procs = [p for p in find_job_processes(workflow_id, ctx.host_id) if _alive(p)]
    if not procs:
        return {"status": "gone", "error": f"{workflow_id} is not running on {ctx.host_id}"}
    handlers.request_checkpoint(workflow_id, request_id, payload["directory"])
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    while True:
        result = handlers.checkpoint_result(request_id)
        if result is not None:
            out = {"status": result["status"], "path": result.get("path"), "step": result.get("step"),
                   "error": result.get("error"), "pids": [p.pid for p in procs]}
            handlers.cancel_checkpoint(request_id)
            return out
        now = time.monotonic()
        if now >= next_check:
            next_check = now + 0.5
            if not any(_alive(p) for p in procs):
                handlers.cancel_checkpoint(request_id)
                return {"status": "gone", "error": f"{workflow_id} exited before answering the checkpoint request"}
        if now >= deadline:
            handlers.cancel_checkpoint(request_id)
            delivered = handlers.checkpoint_delivered(request_id) if hasattr(handlers, "checkpoint_delivered") else None
            return {"status": "timeout", "delivered": delivered, "error": (
                f"{workflow_id} did not answer the checkpoint request within {timeout_s:.0f} s "
                f"({'it was told, but never saved' if delivered else 'it never polled the agent: no fleetlens SDK?'})"
            )}
        time.sleep(0.02)


def handle_stop(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """SIGTERM the job (and its children), SIGKILL what is left after the grace period."""
    workflow_id = str(payload["workflow_id"])
    grace = float(payload.get("grace_s", DEFAULT_STOP_GRACE_S))
    procs = [p for p in find_job_processes(workflow_id, ctx.host_id) if _alive(p)]
    if not procs:
        return {"already_stopped": True, "stopped": [], "killed": []}
    tree: list[psutil.Process] = []
    for p in procs:
        try:
            tree.extend([p, *p.children(recursive=True)])
        except _GONE:
            continue
    for p in tree:
        try:
            p.terminate()
        except _GONE:
            pass
    _, left = psutil.wait_procs(tree, timeout=grace)
    for p in left:
        try:
            p.kill()
        except _GONE:
            pass
    psutil.wait_procs(left, timeout=5)
    REAPER.reap()
    gate = getattr(getattr(ctx.agent, "sdk_handler", None), "gate", None)
    if gate is not None and hasattr(gate, "release"):
        gate.release(workflow_id)  # a turn the stopped job held in its lane passes on at once
    return {"stopped": [p.pid for p in procs], "killed": [p.pid for p in left]}


for _kind, _fn in (("launch", handle_launch), ("relaunch", handle_relaunch), ("checkpoint", handle_checkpoint),
                   ("stop", handle_stop)):
    register_handler(_kind, _fn)
