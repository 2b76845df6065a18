"""`fleetlens run`: the enforcer places the job under the policy, then it starts, in the foreground from this
process (`start_local`) or by the host's agent (`launch_detached`: a signed `launch` command; the agent owns the
process, so it can stop and relaunch it later).

Only the command line registered in the store is ever (re)launched: commands carry a workflow id, never a command
line.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from collector.launch import job_env, spawn_job
from enforcer.managed import ManagedJob, pid_alive, register_managed
from store.commands import enqueue_command
from store.db import Store
from store.errors import ConfigError, InvalidInput
from store.models import Command, Host
from store.placements import end_placements, mark_started, withdraw_placement
from store.settings import Settings, get_settings

AGENT_ALIVE_S = 60.0  # an agent whose host row was touched this recently is taken to be running


def start_local(store: Store, job: ManagedJob, *, settings: Settings | None = None) -> subprocess.Popen:
    """Foreground: start the job from this process (same session, so Ctrl-C reaches it) and mark it placed."""
    with store.session() as session:
        env, cores = job_env(session, job.workflow_id, job.device_ids, job.lane_id, host_id=job.host_id,
                             mps_dirs=(settings or get_settings()).mps_dirs)
    proc = spawn_job(job.command, job.cwd, env, cores=cores, detach=False)
    job.pid = proc.pid
    mark_started(store, job.workflow_id, job.placement_ids, proc.pid)
    return proc


def agent_alive(session: Session, host_id: str, now: float | None = None) -> bool:
    host = session.get(Host, host_id)
    now = time.time() if now is None else now
    return host is not None and now - host.last_seen <= AGENT_ALIVE_S and _agent_pid_ok(host)


def _agent_pid_ok(host: Host) -> bool:
    # on this machine we can also check that the agent process itself is there
    if host.hostname != socket.gethostname() or not host.agent_pid:
        return True
    return pid_alive(host.agent_pid)


def launch_detached(store: Store, job: ManagedJob, *, settings: Settings | None = None,
                    timeout_s: float = 60.0, poll_s: float = 0.1) -> ManagedJob:
    """Ask the host's agent to start the job (a signed `launch` command) and wait until it has; the agent owns
    the process from then on. Raises if no agent runs on the host or it could not start the job."""
    settings = settings or get_settings()
    with store.session() as session:
        alive = agent_alive(session, job.host_id)
        if not alive:
            _withdraw(session, job)
    if not alive:
        raise ConfigError(f"no fleetlens agent is running on host {job.host_id!r}; start `fleetlens agent` "
                          "there, or run the job in the foreground (without --detach)")
    with store.session() as session:
        command = enqueue_command(session, job.host_id, "launch", {
            "workflow_id": job.workflow_id, "device_ids": job.device_ids, "lane_id": job.lane_id,
            "placement_ids": job.placement_ids,
        }, ttl=timeout_s, secret=settings.secret_bytes())
        command_id = command.id
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with store.session() as session:
            row = session.get(Command, command_id)
            status, result = row.status, dict(row.result or {})
        if status == "done":
            job.pid, job.log_path = int(result["pid"]), result.get("log")
            job.extra["command_id"] = command_id
            return job
        if status in ("failed", "refused"):
            with store.session() as session:
                _withdraw(session, job)
            raise InvalidInput(f"the agent on {job.host_id!r} could not start {job.workflow_id!r}: "
                               f"{result.get('error') or result.get('reason') or result}")
        time.sleep(poll_s)
    with store.session() as session:  # withdraw the command too, so that no agent starts the job later
        withdrawn = session.execute(update(Command).where(Command.id == command_id, Command.status == "pending")
                                    .values(status="failed", done_at=time.time(),
                                            result={"error": "withdrawn: no agent took it in time"})).rowcount
        if withdrawn:
            _withdraw(session, job)
    raise ConfigError(f"the agent on {job.host_id!r} did not start {job.workflow_id!r} within {timeout_s:.0f} s"
                      + ("; the job was withdrawn — is `fleetlens agent` running there?" if withdrawn else
                         f"; it may still start: see command {command_id}"))


def _withdraw(session: Session, job: ManagedJob) -> None:
    """Undo a placement whose job never started."""
    withdraw_placement(session, job.workflow_id, job.placement_ids, job.lane_id)


def run_managed(store: Store, command: Sequence[str], *, detach: bool = False, settings: Settings | None = None,
                **options: Any) -> tuple[ManagedJob, int | None]:
    """`fleetlens run`: register and place, then start. Detached: (job, None) once the agent started it.
    Foreground: waits and returns (job, the job's exit code); the placement ends with the job."""
    settings = settings or get_settings()
    job = register_managed(store, command, settings=settings, **options)
    if detach:
        return launch_detached(store, job, settings=settings), None
    try:
        proc = start_local(store, job, settings=settings)
    except Exception:
        with store.session() as session:
            _withdraw(session, job)
        raise
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.wait()
        code = 130
    try:
        end_placements(store, job.workflow_id, proc.pid, "finished" if code == 0 else "failed")
    except Exception:  # the database went away: the agent's view catches up later
        pass
    return job, code
