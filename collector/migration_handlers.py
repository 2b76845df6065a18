"""The agent's side of managed jobs and migration: signed `launch`, `checkpoint`, `stop` and `relaunch` commands,
the per-lane iteration gate on the SDK socket, and reaping the jobs this agent started or took up.

Importing the module registers the four command kinds with collector.command_runner; `install(agent, stop)` (called by
the agent at start) puts the enforcer's `LaneGate` behind the SDK socket and starts the reaper and the storage
prober (which says in the store which checkpoint locations this host can read). Every handler is
idempotent, because the enforcer re-sends a command whose outcome it never saw (agent killed, database away):
launching or relaunching a job that already runs returns the running process, stopping one that is gone says so.

A launch or relaunch runs only the spec registered for the workflow (never one from the command), and only when
its digest matches the signature made at registration; it resumes only from a recorded checkpoint inside the
workflow's checkpoint location whose sha256 this host has checked. What fails those checks is refused (the
command fails as unsafe, the enforcer puts the job back or leaves it stopped with its checkpoint).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import psutil
from sqlalchemy import select

from collector.command_runner import CommandContext, register_handler
from collector.launch import find_job_processes, find_managed_processes, job_env, spawn_job
from collector.oom import oom_cause
from enforcer.gate import LaneGate
from store.checkpoints import (
    digest,
    get_checkpoint,
    is_local,
    local_path,
    locations_to_probe,
    probe,
    record_checkpoint,
    record_probes,
)
from store.errors import DatabaseUnavailable, InvalidInput, NotFound, UnsafeToRun
from store.models import Placement, Workflow
from store.paths import log_path_for
from store.placements import end_placements, mark_started
from store.workflows import spec_refusal

log = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 3.0  # seconds a started job must survive (or say hello sooner)
DEFAULT_STOP_GRACE_S = 10.0
START_MARK = "--- fleetlens: starting"  # the line the agent writes into a job's log before each start
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


# ---- the children this agent started, reaped so they never linger as zombies -----------------------------

class _Adopted:
    """A detached job an earlier agent on this host started: not our child, so watched through psutil; its exit
    code is unknown (its SDK goodbye says how it ended)."""

    returncode = None

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return None if _alive(self.proc) else -1


class _Reaper:
    """Waits for the jobs this agent started or took up; when one ends, its placement ends (unless it is being
    moved). Its thread runs while an agent of this process runs, and ends when the last one stops (the jobs go on;
    an agent started later takes them up again)."""

    def __init__(self) -> None:
        self.children: dict[int, tuple[Any, str]] = {}  # pid -> (Popen, workflow)
        self.pending: list[tuple[str, int, str, bool]] = []  # endings the database could not take yet
        self.lock = threading.Lock()
        self.agent: Any = None
        self._thread: threading.Thread | None = None
        self._running: list[threading.Event] = []  # the stop events of the agents it serves

    def add(self, popen: Any, workflow_id: str) -> None:
        with self.lock:
            self.children[popen.pid] = (popen, workflow_id)

    def adopt(self, store: Any, host_id: str) -> list[tuple[int, str]]:
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

    def start(self, agent: Any, stop: threading.Event) -> None:
        """Serve `agent` until `stop` is set."""
        with self.lock:
            self.agent = agent
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
            gate = getattr(getattr(self.agent, "sdk_handler", None), "gate", None)
            handlers = getattr(self.agent, "sdk_handler", None)
            for pid, popen, wf in ended:
                if gate is not None and hasattr(gate, "release"):
                    gate.release(wf, pid)  # a job that died mid-step must not keep its lane's turn
                said = handlers.take_outcome(wf, pid) if hasattr(handlers, "take_outcome") else None
                if popen.returncode is not None:
                    outcome = "finished" if popen.returncode == 0 else "failed"
                else:  # taken up from an earlier agent: no exit code, only what the job said on its way out
                    outcome = "finished" if said == "finished" else "failed"
                oom = outcome == "failed" and self.agent is not None and ran_out_of_memory(
                    log_path_for(self.agent.settings, wf))
                log.log(logging.WARNING if oom else logging.INFO, "managed job %s (pid %d) ended: %s%s", wf, pid,
                        outcome if popen.returncode is None else f"exit code {popen.returncode}",
                        ": out of memory (its lane-mates run on)" if oom else "")
                self.pending.append((wf, pid, outcome, oom))
            pending, self.pending = self.pending, []
        agent = self.agent
        if agent is None or not pending:
            return
        flush_steps = getattr(agent, "flush_sdk", None)
        if callable(flush_steps):
            flush_steps()  # a job's last steps reach the store before the job is marked ended
        left = []
        for wf, pid, outcome, oom in pending:
            try:
                end_placements(agent.store, wf, pid, outcome, out_of_memory=oom)
            except DatabaseUnavailable:
                left.append((wf, pid, outcome, oom))
        with self.lock:
            self.pending.extend(left)


REAPER = _Reaper()

def ran_out_of_memory(log_path: Path, tail_bytes: int = 64 * 1024) -> str | None:
    """Whether the end of a job's log, since its last start, shows it died out of GPU memory (with or without the
    job SDK: the markers are what PyTorch and CUDA print), and why (collector.oom): "share" (its cap), "device" (the
    GPU was full while it was within its cap), None (not out of memory)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    return oom_cause(tail.rsplit(START_MARK, 1)[-1])  # an earlier run's failure is not this one's


def probe_storage(agent: Any) -> dict[str, str | None]:
    """Say in the store which checkpoint locations this host can read and write ({url: None, or why not}): the
    planner moves a job to this host only when its checkpoint location, or the fleet's root above it, is among
    them. One listing and one small write per location (store.checkpoints.locations_to_probe says which)."""
    with agent.store.session() as session:
        urls = locations_to_probe(session, agent.settings.checkpoint_url)
    results = {url: probe(url, write_as=agent.host_id) for url in urls}
    if results:
        with agent.store.session() as session:
            record_probes(session, agent.host_id, results.items())
    return results


def _probe_loop(agent: Any, stop: threading.Event) -> None:
    """Probe every `storage_probe_s` until the agent stops (then no probe runs: the store may be gone by then)."""
    while not stop.is_set():
        try:
            probe_storage(agent)
        except DatabaseUnavailable:
            pass  # the agent's flusher reports the outage; the next round says it again
        except Exception:
            log.exception("probing checkpoint locations failed")
        stop.wait(agent.settings.storage_probe_s)


def install(agent: Any, stop: threading.Event) -> list[threading.Thread]:
    """Called by the agent once it serves the SDK socket: the lane gate goes behind the socket, the reaper starts,
    and the storage prober runs until `stop` is set. Returns the threads the agent joins when it stops."""
    handlers = getattr(agent, "sdk_handler", None)
    if handlers is not None and hasattr(handlers, "gate") and handlers.gate is None:
        handlers.gate = LaneGate(agent.settings.policy, total_steps=_total_steps_lookup(handlers))
    try:
        REAPER.adopt(agent.store, agent.host_id)
    except Exception:  # taking up old jobs is no reason for an agent not to start
        log.exception("taking up the jobs already running on %s failed", agent.host_id)
    REAPER.start(agent, stop)
    prober = threading.Thread(target=_probe_loop, args=(agent, stop), name="fleetlens-storage-probe", daemon=True)
    prober.start()
    return [prober]


def uninstall(timeout_s: float) -> None:
    """Called by an agent once its own threads have stopped: the reaper's thread ends with the last agent of the
    process, and is waited for then (never while another agent of the process runs: many virtual hosts share one
    process in benchmarks/agents_load.py)."""
    REAPER.join_if_idle(timeout_s)


def _total_steps_lookup(handlers: Any) -> Any:
    def lookup(workflow: str) -> int | None:
        for job in handlers.jobs():
            if job.get("workflow") == workflow and job.get("total_steps"):
                return int(job["total_steps"])
        return None

    return lookup


# ---- starting a job -----------------------------------------------------------------------------------------

def _workflow(ctx: CommandContext, workflow_id: str, *, verify_spec: bool = True) -> dict[str, Any]:
    """The workflow's registered relaunch spec; raises UnsafeToRun when it does not match its signature."""
    with ctx.store.session() as session:
        wf = session.get(Workflow, workflow_id)
        if wf is None:
            raise NotFound(f"workflow {workflow_id!r} is not in the store")
        if not wf.managed or not wf.command:
            raise InvalidInput(f"workflow {workflow_id!r} is not a managed job with a registered command line")
        if verify_spec:
            refusal = spec_refusal(wf, ctx.settings.secret_bytes())
            if refusal is not None:
                raise UnsafeToRun(f"refused on host {ctx.host_id}: {refusal}; nothing was started")
        return {"id": wf.id, "command": list(wf.command), "cwd": wf.cwd or "/", "checkpoint_dir": wf.checkpoint_dir,
                "checkpoint_url": wf.checkpoint_url}


def _inside(url: str, location: str) -> bool:
    if is_local(url) and is_local(location):
        return local_path(url).resolve().is_relative_to(local_path(location).resolve())
    return url.startswith(location.rstrip("/") + "/")


def _verified_checkpoint(ctx: CommandContext, wf: dict[str, Any], checkpoint_id: int) -> tuple[str, int | None]:
    """(local path to resume from, its step) of a recorded checkpoint whose bytes this host read and found to match
    the sha256 the writing agent recorded; raises UnsafeToRun otherwise (nothing is started)."""
    with ctx.store.session() as session:
        fact = get_checkpoint(session, checkpoint_id)
    if fact is None or fact.workflow_id != wf["id"]:
        raise UnsafeToRun(f"checkpoint {checkpoint_id} is not a recorded checkpoint of {wf['id']}; nothing started")
    location = wf["checkpoint_url"] or wf["checkpoint_dir"] or ""
    if not location or not _inside(fact.url, location):
        raise UnsafeToRun(f"refusing to resume {wf['id']} from {fact.url}: not inside its checkpoint location "
                          f"{location}; nothing started")
    try:
        sha, size = digest(fact.url)
    except (OSError, ImportError, ValueError) as exc:
        raise UnsafeToRun(f"host {ctx.host_id} cannot read the checkpoint {fact.url} of {wf['id']} ({exc}); "
                          "nothing started") from None
    if (sha, size) != (fact.sha256, fact.size_bytes):
        raise UnsafeToRun(f"the checkpoint {fact.url} of {wf['id']} does not match what was recorded when it was "
                          f"written (sha256 {sha[:12]}… of {size} bytes, recorded {fact.sha256[:12]}… of "
                          f"{fact.size_bytes} bytes); nothing started")
    if is_local(fact.url):
        return str(local_path(fact.url)), fact.step
    local = Path(wf["checkpoint_dir"]) / Path(fact.url.rstrip("/")).name
    local.parent.mkdir(parents=True, exist_ok=True)
    fsspec.open(fact.url).fs.get_file(fact.url, str(local))
    if digest(str(local))[0] != fact.sha256:
        raise UnsafeToRun(f"the copy of {fact.url} fetched to {local} does not match its recorded sha256; "
                          "nothing started")
    return str(local), fact.step


def _start(ctx: CommandContext, workflow_id: str, device_ids: list[int], lane_id: int | None, *,
           checkpoint_id: int | None, resume_folder: str | None, timeout_s: float,
           share_bytes: int | None = None) -> dict[str, Any]:
    running = [p for p in find_job_processes(workflow_id, ctx.host_id) if _alive(p)]
    if running:  # a re-sent command, or the previous agent started it before it died
        return {"pid": running[0].pid, "already_running": True, "connected": True}
    wf = _workflow(ctx, workflow_id)
    resume_from: str | None = None
    resume_step: int | None = None
    if checkpoint_id is not None:
        resume_from, resume_step = _verified_checkpoint(ctx, wf, int(checkpoint_id))
    elif resume_folder is not None:  # no recorded checkpoint: the newest the job left in its own folder, if any
        folder = Path(wf["checkpoint_dir"] or "")
        if wf["checkpoint_dir"] and Path(resume_folder).resolve() == folder.resolve() and folder.is_dir() and any(
                not p.name.startswith(".") for p in folder.iterdir()):
            resume_from = str(folder)
    with ctx.store.session() as session:
        env, cores = job_env(session, workflow_id, device_ids, lane_id, host_id=ctx.host_id,
                             resume_from=resume_from, resume_step=resume_step, share_bytes=share_bytes,
                             mps_dirs=ctx.settings.mps_dirs)
    log_path = log_path_for(ctx.settings, workflow_id)
    with open(log_path.parent.mkdir(parents=True, exist_ok=True) or log_path, "ab") as f:
        f.write(f"{START_MARK} at {time.ctime()} on devices {device_ids} lane {lane_id}"
                f"{' resuming from ' + resume_from if resume_from else ''}\n".encode())
    popen = spawn_job(wf["command"], wf["cwd"], env, cores=cores, log_path=log_path, detach=True)
    REAPER.add(popen, workflow_id)
    result = _confirm(ctx, popen, workflow_id, log_path, timeout_s)
    return {**result, "resume_from": resume_from, "resume_step": resume_step}


def _confirm(ctx: CommandContext, popen: Any, workflow_id: str, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Wait until the job says hello on the SDK socket or has run `timeout_s`: an exit before that is a failure.

    A job that said hello and then ended (its goodbye heard, however soon after: between two polls here) has
    started; how it ended is the reaper's to record, as for any job that ends later."""
    handlers = getattr(ctx.agent, "sdk_handler", None)
    jobs = getattr(handlers, "jobs", None)
    said_goodbye = getattr(handlers, "said_goodbye", None)
    # a job without the SDK never says hello: surviving `timeout_s` (a few seconds) is all we can check then
    deadline = time.monotonic() + timeout_s
    connected = False
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            if callable(said_goodbye) and said_goodbye(workflow_id, popen.pid):
                connected = True
                break
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
                    checkpoint_id=None, resume_folder=None,
                    timeout_s=float(payload.get("timeout_s", DEFAULT_START_TIMEOUT_S)))
    mark_started(ctx.store, workflow_id, [int(p) for p in payload.get("placement_ids", [])], result["pid"])
    return result


def handle_relaunch(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Start the workflow's signed relaunch spec on a device / lane, resuming from its recorded checkpoint (whose
    sha256 this host checks first) or, with none recorded, from the newest one in its own folder."""
    checkpoint_id = payload.get("checkpoint_id")
    return _start(ctx, str(payload["workflow_id"]), [int(payload["device_id"])], payload.get("lane_id"),
                  checkpoint_id=None if checkpoint_id is None else int(checkpoint_id),
                  resume_folder=payload.get("resume_folder"),
                  timeout_s=float(payload.get("timeout_s", DEFAULT_START_TIMEOUT_S)),
                  share_bytes=_int_or_none(payload.get("share_bytes")))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


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
            if out["status"] == "done" and out["path"]:
                out.update(_record(ctx, workflow_id, str(out["path"]), out["step"]))
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


def _record(ctx: CommandContext, workflow_id: str, path: str, step: int | None) -> dict[str, Any]:
    """The checkpoint the job just wrote becomes a fact in the store: published to the job's checkpoint location
    (an object store gets a copy), read back through fsspec for its size and sha256, and recorded."""
    wf = _workflow(ctx, workflow_id, verify_spec=False)
    try:
        url = str(Path(path).resolve())
        if wf["checkpoint_url"] and not is_local(wf["checkpoint_url"]):
            url = f"{wf['checkpoint_url'].rstrip('/')}/{Path(path).name}"
            fsspec.open(url).fs.put_file(path, url)
        sha, size = digest(url)
    except (OSError, ImportError, ValueError) as exc:
        return {"status": "failed", "error": f"the checkpoint {path} could not be published and read back ({exc})"}
    with ctx.store.session() as session:
        fact = record_checkpoint(session, workflow_id, host_id=ctx.host_id, url=url, step=step, sha256=sha,
                                 size_bytes=size, action_id=ctx.action_id)
    return {"checkpoint_id": fact.id, "url": url, "sha256": sha, "size_bytes": size}


def handle_stop(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """SIGTERM the job (and its children), SIGKILL what is left after the grace period; not when the checkpoint the
    stop follows is older than `max_age_s` (the job trained on since), which the enforcer then takes again."""
    workflow_id = str(payload["workflow_id"])
    grace = float(payload.get("grace_s", DEFAULT_STOP_GRACE_S))
    procs = [p for p in find_job_processes(workflow_id, ctx.host_id) if _alive(p)]
    if not procs:
        return {"already_stopped": True, "stopped": [], "killed": []}
    taken, max_age = payload.get("checkpoint_taken_at"), payload.get("max_age_s")
    if taken is not None and max_age is not None and time.time() - float(taken) > float(max_age):
        # the job trained on since its checkpoint: stopping it now would throw that work away
        return {"stale_checkpoint": True, "age_s": round(time.time() - float(taken), 1), "stopped": [], "killed": []}
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
