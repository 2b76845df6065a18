"""Managed jobs: register a job's command line, place it on a device or in a lane under the policy, and start it.

`fleetlens run -- CMD` calls `register_managed` (workflow row with the command line, cwd, checkpoint folder and
declared steps; a device or lane chosen by the active policy from the host's registered devices and current
placements; the placement recorded) and then either starts the job itself and waits (`start_local`, foreground)
or asks the host's agent to start it (`launch_detached`: a signed `launch` command; the agent owns the process,
so it can stop and relaunch it later). Whoever starts it uses `spawn_job` with the environment `job_env` computes
from the store: FLEETLENS_WORKFLOW, CUDA_VISIBLE_DEVICES (CPU affinity on `cpu` devices), and for a lane
FLEETLENS_LANE, FLEETLENS_MEMORY_FRACTION and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.

Only the command line stored here is ever (re)launched: commands carry a workflow id, never a command line.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from enforcer.lanes import Fleet, Job
from enforcer.policies import get_policy
from store.commands import enqueue_command
from store.db import Store
from store.errors import ConfigError, InvalidInput, NotFound
from store.models import Command, Device, Host, Lane, Placement, Workflow
from store.settings import Settings, get_settings
from store.workflows import upsert_workflow

DEFAULT_PERSISTENT = 1 << 30  # P assumed for a job whose memory nobody has measured yet (1 GiB)
MANAGED_ENV = "FLEETLENS_MANAGED"  # set to the host id in every managed job's environment: how agents find it
AGENT_ALIVE_S = 60.0  # an agent whose host row was touched this recently is taken to be running


class PlacementError(InvalidInput):
    """No device or lane on the host can take the job now."""


@dataclass
class ManagedJob:
    """A registered managed job and where it was placed."""

    workflow_id: str
    host_id: str
    command: list[str]
    cwd: str
    checkpoint_dir: str
    device_ids: list[int]
    lane_id: int | None
    placement_ids: list[int]
    policy: str
    pid: int | None = None
    log_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:48] or "job"


def checkpoint_dir_for(settings: Settings, workflow_id: str) -> Path:
    """The job's checkpoint folder: FLEETLENS_HOME/checkpoints/<workflow> (what collector.examples.train uses)."""
    from collector.protocol import path_component

    return settings.checkpoint_dir / path_component(workflow_id)


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"the checkpoint folder {folder} cannot be written ({exc.strerror or exc}); set FLEETLENS_HOME to a "
            "folder you can write, or pass --checkpoint-dir"
        ) from None


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def load_host_fleet(session: Session, host_id: str) -> tuple[Fleet, dict[int, Device]]:
    """The host's usable devices with their open lanes and active placements, as a `Fleet` the policies place on."""
    devices = {d.id: d for d in session.scalars(
        select(Device).where(Device.host_id == host_id, Device.state == "ok").order_by(Device.index))}
    fleet = Fleet()
    for d in devices.values():
        fleet.add_device(d.id, int(d.memory_total or 0), kind=d.name, host=host_id)
    lanes = {lane.id: lane for lane in session.scalars(
        select(Lane).where(Lane.device_id.in_(list(devices)), Lane.state == "open"))}
    fleet.use_lane_ids(max(lanes, default=0) + 1)
    placements = session.scalars(select(Placement).where(
        Placement.device_id.in_(list(devices)), Placement.state.in_(("active", "pending"))).order_by(Placement.id))
    for p in placements:
        job = Job(p.workflow_id, persistent=0, ephemeral=int(p.mem_ephemeral or 0), util=p.compute_share or 1.0)
        device = fleet.device(p.device_id)
        try:
            if p.lane_id is not None and p.lane_id in lanes:
                lane = lanes[p.lane_id]
                size = lane.size_bytes if lane.id in device.lanes else min(lane.size_bytes, device.free)
                fleet.place_loaded(job, p.device_id, lane.id, size, lane.compute_share,
                                   p_prime=int(p.mem_persistent or 0))
            else:  # a whole device
                lane = device.add_lane(device.free, exclusive=not device.lanes)
                fleet.place_loaded(job, p.device_id, lane.lane_id, lane.size, p_prime=lane.size)
        except ValueError:
            # the store disagrees with itself (a lane over-full): take the device as fully held
            fleet.set_alive(p.device_id, False)
    return fleet, devices


def lock_host_placements(session: Session, host_id: str) -> None:
    """Serialise placing jobs on one host until `session`'s transaction ends, so that two `fleetlens run` started at
    once never both take the same room: a no-op write to the host's row takes PostgreSQL's row lock, and SQLite's
    database write lock (the other waits out its busy timeout)."""
    session.execute(update(Host).where(Host.id == host_id).values(last_seen=Host.last_seen))


def register_managed(
    store: Store,
    command: Sequence[str],
    *,
    settings: Settings | None = None,
    gpus: int | None = None,
    lane: str | None = None,
    movable: bool = False,
    team: str | None = None,
    steps: int | None = None,
    name: str | None = None,
    workflow_id: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    mem_bytes: int | None = None,
    util: float = 1.0,
    policy: str | None = None,
    host_id: str | None = None,
    devices: Sequence[int] | None = None,
    now: float | None = None,
) -> ManagedJob:
    """Register a managed job, place it under the policy on `host_id`'s devices, and record the placement.

    `devices` (device ids) restricts the policy's choice to those devices, e.g. to keep a job beside its data.

    Exactly one of `gpus` (whole devices) and `lane` ("auto": a Salus lane) applies; neither means one whole
    device. `util` is the job's expected device utilisation alone (0..1; PACK packs light jobs together, and a
    lane's compute share follows it). Raises (with nothing written) on an unknown policy, an empty command, an
    unwritable checkpoint folder, a host with no registered devices, or no room.
    """
    settings = settings or get_settings()
    chosen = get_policy(policy or settings.policy)  # an unknown policy fails before anything is written
    command = [str(c) for c in command]
    if not command:
        raise InvalidInput("no command to run; put it after `--`, e.g. `fleetlens run -- python train.py`")
    if gpus is not None and lane is not None:
        raise InvalidInput("give --gpus N or --lane auto, not both")
    if lane is not None and lane != "auto":
        raise InvalidInput(f"--lane takes 'auto' (the policy picks the lane), not {lane!r}")
    if gpus is not None and gpus < 1:
        raise InvalidInput(f"--gpus must be at least 1, not {gpus}")
    if steps is not None and steps < 0:
        raise InvalidInput(f"--steps must be >= 0, not {steps}")
    if not 0 < util <= 1:
        raise InvalidInput(f"--util is the job's expected utilisation, 0 < util <= 1, not {util}")
    host_id = host_id or settings.host_id
    cwd = str(Path(cwd or os.getcwd()).resolve())
    if not Path(cwd).is_dir():
        raise InvalidInput(f"the job's working folder {cwd} does not exist")
    workflow_id = workflow_id or (f"{_slug(name)}-{uuid.uuid4().hex[:6]}" if name else
                                  f"{_slug(Path(command[-1] if command[0].startswith('python') else command[0]).stem)}"
                                  f"-{uuid.uuid4().hex[:6]}")
    ckpt = checkpoint_dir_for(settings, workflow_id)
    _check_writable(ckpt)
    now = time.time() if now is None else now
    whole = lane is None or chosen.exclusive
    only = None if devices is None else {int(d) for d in devices}
    with store.session() as session:
        lock_host_placements(session, host_id)
        existing = session.get(Workflow, workflow_id)
        if existing is not None:
            live = [p for p in session.scalars(select(Placement).where(
                Placement.workflow_id == workflow_id, Placement.state == "active")) if _pid_alive(p.pid)]
            if live:
                raise InvalidInput(f"workflow {workflow_id!r} is already running (pid {live[0].pid}); "
                                   "give the new job another --name")
        fleet, devices = load_host_fleet(session, host_id)
        if not devices:
            raise NotFound(f"host {host_id!r} has no registered devices; start `fleetlens agent` on it first")
        if only is not None:
            foreign = sorted(set(only) - set(devices))
            if foreign:
                raise NotFound(f"device(s) {foreign} are not on host {host_id!r}; `fleetlens lanes` lists its devices")
            for device_id in devices:
                if device_id not in only:
                    fleet.set_alive(device_id, False)
        persistent = mem_bytes if mem_bytes is not None else (
            existing.mem_persistent if existing is not None and existing.mem_persistent else DEFAULT_PERSISTENT)
        ephemeral = int(existing.mem_ephemeral or 0) if existing is not None and mem_bytes is None else 0
        job = Job(workflow_id, persistent=int(persistent), ephemeral=ephemeral, gpus=gpus or 1, exclusive=whole,
                  util=util, arrival=now)
        admissions = chosen.place(job, fleet)
        if admissions is None:
            held = sum(1 for d in fleet.devices if d.n_jobs)
            raise PlacementError(
                f"no device on host {host_id!r} has room for {workflow_id!r} now "
                f"({'whole devices: ' + str(gpus or 1) if whole else f'a lane for {persistent / 2**30:.2f} GiB'}; "
                f"{held} of {len(devices)} devices hold jobs); wait, or use "
                f"{'--lane auto' if whole else 'fewer resources'}"
            )
        fleet.bind(admissions, job)
        wf = upsert_workflow(
            session, workflow_id, now=now, id_source="managed", name=name or workflow_id, managed=True,
            movable=movable, team=team, command=command, cwd=cwd, checkpoint_dir=str(ckpt), declared_steps=steps,
            gpus=len(admissions), state="running",
        )
        if mem_bytes is not None:
            wf.mem_persistent, wf.mem_ephemeral = int(mem_bytes), 0
        lane_id: int | None = None
        placement_ids = []
        for adm in admissions:
            share = 1.0
            if not adm.exclusive:
                device_lanes = fleet.device(adm.device_id)
                fleet_lane = device_lanes.lane_of(workflow_id)
                assert fleet_lane is not None
                share = round(device_lanes.compute_shares()[fleet_lane.lane_id], 4)
                if adm.new_lane:
                    row = Lane(device_id=adm.device_id, size_bytes=adm.lane_size, compute_share=share, state="open",
                               created_at=now)
                    session.add(row)
                    session.flush()
                    lane_id = row.id
                else:
                    lane_id = adm.lane_id
                    share = session.get(Lane, lane_id).compute_share
            placement = Placement(workflow_id=workflow_id, device_id=adm.device_id, lane_id=lane_id if not
                                  adm.exclusive else None, host_id=host_id, pid=None, mem_persistent=adm.p_prime,
                                  mem_ephemeral=adm.ephemeral, compute_share=share, state="pending",
                                  started_at=now)
            session.add(placement)
            session.flush()
            placement_ids.append(placement.id)
        return ManagedJob(workflow_id, host_id, command, cwd, str(ckpt), [a.device_id for a in admissions],
                          lane_id, placement_ids, chosen.name)


def job_env(session: Session, workflow_id: str, device_ids: Sequence[int], lane_id: int | None, *,
            host_id: str, resume_from: str | None = None, resume_step: int | None = None) -> tuple[dict[str, str],
                                                                                              list[int] | None]:
    """(environment overrides, cpu cores to pin to or None) for running the workflow on these devices / lane."""
    devices = [session.get(Device, d) for d in device_ids]
    if any(d is None for d in devices):
        raise NotFound(f"device {device_ids} is no longer in the store")
    env = {"FLEETLENS_WORKFLOW": workflow_id, MANAGED_ENV: host_id}
    cores: list[int] | None = None
    if all(d.source == "cpu" for d in devices):
        cores = sorted({int(c) for d in devices for c in (d.cpu_cores or [])}) or None
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU device: the job must not wander onto a GPU it was not given
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.index) for d in devices)
    if lane_id is not None:
        lane = session.get(Lane, lane_id)
        if lane is None:
            raise NotFound(f"lane {lane_id} is no longer in the store")
        total = devices[0].memory_total or 0
        fraction = min(1.0, lane.size_bytes / total) if total else 1.0
        env.update(FLEETLENS_LANE=str(lane_id), FLEETLENS_MEMORY_FRACTION=f"{max(fraction, 1e-6):.6f}",
                   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(max(1, min(100, round(lane.compute_share * 100)))))
    if resume_from:
        env["FLEETLENS_RESUME_FROM"] = str(resume_from)
    if resume_step is not None:
        env["FLEETLENS_RESUME_STEP"] = str(int(resume_step))
    return env, cores


def spawn_job(command: Sequence[str], cwd: str, env_overrides: dict[str, str], *, cores: list[int] | None = None,
              log_path: str | os.PathLike[str] | None = None, detach: bool = True,
              base_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the job: its own session when detached (it outlives whoever started it), output to `log_path`."""
    env = dict(os.environ if base_env is None else base_env)
    for key in ("FLEETLENS_WORKFLOW", "FLEETLENS_LANE", "FLEETLENS_MEMORY_FRACTION", "FLEETLENS_RESUME_FROM",
                "FLEETLENS_RESUME_STEP", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        env.pop(key, None)  # never inherit another job's identity or lane
    env.update(env_overrides)
    out: IO[bytes] | int | None = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 (handed to the child; closed below)
    try:
        proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                                start_new_session=detach)
    except OSError as exc:
        raise InvalidInput(f"cannot start {shlex.join(command)} in {cwd}: {exc.strerror or exc}") from None
    finally:
        if out is not None and not isinstance(out, int):
            out.close()
    if cores:
        try:  # set before the interpreter starts its worker threads, which inherit the mask
            os.sched_setaffinity(proc.pid, cores)
        except OSError:
            pass
    return proc


def log_path_for(settings: Settings, workflow_id: str) -> Path:
    from collector.protocol import path_component

    return settings.home / "logs" / f"{path_component(workflow_id)}.log"


def mark_started(store: Store, workflow_id: str, placement_ids: Sequence[int], pid: int) -> None:
    with store.session() as session:
        session.execute(update(Placement).where(Placement.id.in_(list(placement_ids)))
                        .values(pid=pid, state="active"))
        session.execute(update(Workflow).where(Workflow.id == workflow_id).values(state="running"))


def end_placements(store: Store, workflow_id: str, pid: int | None, outcome: str, *, now: float | None = None) -> int:
    """The job's process `pid` ended: its active placements end and empty lanes close; returns how many ended.

    A workflow being moved is left to the migration (it ends the old placement itself)."""
    now = time.time() if now is None else now
    with store.session() as session:
        wf = session.get(Workflow, workflow_id)
        if wf is None or wf.state == "moving":
            return 0
        rows = list(session.scalars(select(Placement).where(
            Placement.workflow_id == workflow_id, Placement.state.in_(("active", "pending")),
            *([Placement.pid == pid] if pid is not None else []))))
        for p in rows:
            p.state, p.ended_at = "ended", now
        session.flush()
        close_empty_lanes(session, {p.lane_id for p in rows if p.lane_id is not None}, now)
        if wf.state == "running":
            wf.state = "finished" if outcome == "finished" else "failed"
        return len(rows)


def close_empty_lanes(session: Session, lane_ids: set[int], now: float) -> None:
    for lane_id in lane_ids:
        busy = session.scalar(select(Placement.id).where(
            Placement.lane_id == lane_id, Placement.state.in_(("active", "pending"))).limit(1))
        if busy is None:
            session.execute(update(Lane).where(Lane.id == lane_id, Lane.state == "open")
                            .values(state="closed", closed_at=now))


def start_local(store: Store, job: ManagedJob, *, settings: Settings | None = None) -> subprocess.Popen:
    """Foreground: start the job from this process (same session, so Ctrl-C reaches it) and mark it placed."""
    with store.session() as session:
        env, cores = job_env(session, job.workflow_id, job.device_ids, job.lane_id, host_id=job.host_id)
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
    import socket as _socket

    if host.hostname != _socket.gethostname() or not host.agent_pid:
        return True
    return _pid_alive(host.agent_pid)


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
    now = time.time()
    session.execute(update(Placement).where(Placement.id.in_(job.placement_ids))
                    .values(state="ended", ended_at=now))
    session.flush()
    if job.lane_id is not None:
        close_empty_lanes(session, {job.lane_id}, now)
    session.execute(update(Workflow).where(Workflow.id == job.workflow_id).values(state="failed"))


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
