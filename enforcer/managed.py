"""Managed jobs: register a job's command line and place it on a device or in a lane under the policy.

`register_managed` writes the workflow row (command line, cwd, checkpoint folder, declared steps), picks a device
or lane with the active policy from the host's registered devices and current placements, and records the
placement as pending. Starting the job is not done here: `fleetlens run` (ui.serve.run) starts it in the
foreground or asks the host's agent to, with collector.launch.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from enforcer.fleet_state import read_fleet_state
from enforcer.lane_fleet import Fleet
from enforcer.lanes import Job, lane_request
from enforcer.policies import get_policy
from store.checkpoints import check_location, is_local, local_path, location_for
from store.db import Store
from store.device_memory import known_context, known_memory
from store.errors import ConfigError, InvalidInput, NotFound
from store.models import Device, Host, Lane, Placement, Workflow
from store.paths import checkpoint_dir_for
from store.settings import Settings
from store.workflows import sign_workflow_spec, upsert_workflow


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


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this pid runs (a zombie does not)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def load_host_fleet(session: Session, host_id: str, settings: Settings) -> tuple[Fleet, dict[int, Device]]:
    """The host's usable devices with their open lanes and active placements, as a `Fleet` the policies place on.

    A device's capacity is its free capacity by the fleet state's one rule (enforcer.fleet_state), so admission
    never hands out memory that processes outside its placements use, to a lane or to a job asking for a whole
    device; nor a lane opened for a move still under way (`FleetState.arriving`), which the job on its way holds
    (its share of the lane, as the planner's store side reserves it). Each lane job's context (C) is charged beside
    its lane: measured, else the device's default from `settings` (FleetState.context_charge)."""
    state = read_fleet_state(session, host_id=host_id, settings=settings)
    devices = {d.id: d for d in session.scalars(select(Device).where(Device.id.in_(list(state.devices)))
                                                .order_by(Device.index))}
    fleet = Fleet()
    for d in sorted(state.devices.values(), key=lambda d: d.index):
        fleet.add_device(d.device_id, state.free_capacity(d.device_id), kind=d.kind, host=host_id,
                         context_default=d.context_default)
    fleet.use_lane_ids(max(state.lanes, default=0) + 1)
    for p in state.placements:
        job = Job(p.workflow_id, persistent=0, ephemeral=p.ephemeral or 0, util=p.compute_share or 1.0,
                  context=state.context_charge(p))
        device = fleet.device(p.device_id)
        try:
            if p.lane_id is not None and p.lane_id in state.lanes:
                lane = state.lanes[p.lane_id]
                size = lane.size if lane.lane_id in device.lanes else min(lane.size, device.free - job.context)
                fleet.place_loaded(job, p.device_id, lane.lane_id, size, lane.compute_share, p_prime=p.p_prime or 0)
            else:  # a whole device
                whole = device.add_lane(device.free, exclusive=not device.lanes)
                # its context is inside what it holds
                fleet.place_loaded(replace(job, context=0), p.device_id, whole.lane_id, whole.size, p_prime=whole.size)
        except ValueError:
            # the store disagrees with itself (a lane over-full): take the device as fully held
            fleet.set_alive(p.device_id, False)
    # a lane opened for a move under way is held for the job on its way, though no placement is in it yet
    arrived = {(p.workflow_id, p.lane_id) for p in state.placements}
    for a in state.arriving:
        if (a.workflow_id, a.lane.lane_id) in arrived:
            continue
        lane = fleet.device(a.device_id).lanes.get(a.lane.lane_id)
        share = a.share if lane is None else min(a.share, lane.room)
        try:
            fleet.place_loaded(Job(f"arriving:{a.workflow_id}", persistent=0, ephemeral=a.ephemeral,
                                   util=a.lane.compute_share),
                               a.device_id, a.lane.lane_id, a.lane.size, a.lane.compute_share, p_prime=share)
        except ValueError:
            fleet.set_alive(a.device_id, False)
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
    settings: Settings,
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
    checkpoint_url: str | None = None,
    env: Mapping[str, str] | None = None,
    now: float | None = None,
) -> ManagedJob:
    """Register a managed job, place it under the policy on `host_id`'s devices, and record the placement.

    The relaunch spec (command line, working folder, `env`, checkpoint location) is fixed here: its digest is
    signed under the fleet secret, and agents run only a spec that matches it. `checkpoint_url` (else
    FLEETLENS_CHECKPOINT_URL) is where the job's checkpoints go, as an fsspec URL; a job without one checkpoints
    into its host's FLEETLENS_HOME and can move between that host's devices only.

    `devices` (device ids) restricts the policy's choice to those devices, e.g. to keep a job beside its data.

    Exactly one of `gpus` (whole devices) and `lane` ("auto": a Salus lane) applies; neither means one whole
    device. `util` is the job's expected device utilisation alone (0..1; PACK packs light jobs together, and a
    lane's compute share follows it). A lane job whose memory is neither declared (`mem_bytes`) nor seen for
    `memory_seen_steps` steps gets a whole device to itself (`extra["alone"]` says so) until it has been
    (store.device_memory.known_memory).
    Raises (with nothing written) on an unknown policy, an empty command, an unwritable checkpoint folder, a host
    with no registered devices, a job bigger than any device, or no room.
    """
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
    location = checkpoint_url or settings.checkpoint_url
    location = location_for(location, workflow_id) if location else None
    if location is not None:
        check_location(location)
    # a local or mounted folder is written by the job itself; an object store gets what the job wrote locally
    ckpt = local_path(location) if location is not None and is_local(location) else checkpoint_dir_for(
        settings, workflow_id)
    _check_writable(ckpt)
    spec_env = {str(k): str(v) for k, v in (env or {}).items()}
    secret = settings.secret_bytes()
    now = time.time() if now is None else now
    whole = lane is None or chosen.exclusive
    only = None if devices is None else {int(d) for d in devices}
    with store.session() as session:
        lock_host_placements(session, host_id)
        existing = session.get(Workflow, workflow_id)
        if existing is not None:
            live = [p for p in session.scalars(select(Placement).where(
                Placement.workflow_id == workflow_id, Placement.state == "active")) if pid_alive(p.pid)]
            if live:
                raise InvalidInput(f"workflow {workflow_id!r} is already running (pid {live[0].pid}); "
                                   "give the new job another --name")
        memory = (int(mem_bytes), 0) if mem_bytes is not None else (
            known_memory(session, existing, settings.memory_seen_steps) if existing is not None else None)
        alone = memory is None and not whole  # unknown memory: a whole device until its memory has been seen
        whole = whole or alone
        fleet, devices = load_host_fleet(session, host_id, settings)
        if not devices:
            raise NotFound(f"host {host_id!r} has no registered devices; start `fleetlens agent` on it first")
        if only is not None:
            foreign = sorted(set(only) - set(devices))
            if foreign:
                raise NotFound(f"device(s) {foreign} are not on host {host_id!r}; `fleetlens lanes` lists its devices")
            for device_id in devices:
                if device_id not in only:
                    fleet.set_alive(device_id, False)
        persistent, ephemeral = memory if memory is not None else (0, 0)
        # C: measured for a job seen before, else each device's default (declared memory is the allocator's)
        context = known_context(existing) if mem_bytes is None else None
        if memory is not None:  # a lane, or whole devices for a job of known memory
            _check_fits_a_device(workflow_id, persistent, ephemeral, context, fleet, devices, host_id, whole=whole)
        job = Job(workflow_id, persistent=persistent, ephemeral=ephemeral, gpus=gpus or 1, exclusive=whole,
                  util=util, arrival=now, context=context)
        admissions = chosen.place(job, fleet)
        if admissions is None:
            held = sum(1 for d in fleet.devices if d.n_jobs)
            wanted = (f"a lane for {persistent / 2**30:.2f} GiB" if not whole else
                      "a whole device: its memory is not known yet" if alone else f"whole devices: {gpus or 1}")
            instead = "--mem-mb to declare its memory" if alone else "--lane auto" if whole else "fewer resources"
            raise PlacementError(
                f"no device on host {host_id!r} has room for {workflow_id!r} now ({wanted}; {held} of "
                f"{len(devices)} devices hold jobs or memory used outside fleetlens); wait, or use {instead}"
            )
        fleet.bind(admissions, job)
        wf = upsert_workflow(
            session, workflow_id, now=now, id_source="managed", name=name or workflow_id, managed=True,
            movable=movable, team=team, command=command, cwd=cwd, checkpoint_dir=str(ckpt), declared_steps=steps,
            gpus=len(admissions), state="running", checkpoint_url=location, spec_env=spec_env,
        )
        sign_workflow_spec(wf, secret)
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
            # P stays unknown for a job whose memory is: nobody may plan with a guess. The store keeps P as measured;
            # the lane charged it P' = adm.p_prime (store.headroom), which readers compute again from P
            placement = Placement(workflow_id=workflow_id, device_id=adm.device_id, lane_id=lane_id if not
                                  adm.exclusive else None, host_id=host_id, pid=None,
                                  mem_persistent=persistent if memory is not None else None,
                                  mem_ephemeral=adm.ephemeral if memory is not None else None, compute_share=share,
                                  state="pending", started_at=now)
            session.add(placement)
            session.flush()
            placement_ids.append(placement.id)
        return ManagedJob(workflow_id, host_id, command, cwd, str(ckpt), [a.device_id for a in admissions],
                          lane_id if not whole else None, placement_ids, chosen.name,
                          extra={"alone": "its memory is not known yet"} if alone else {})


def _check_fits_a_device(workflow_id: str, persistent: int, ephemeral: int, context: int | None, fleet: Fleet,
                         devices: dict[int, Device], host_id: str, *, whole: bool = False) -> None:
    """A job no lane on any device could ever hold, even empty (its context beside the lane included), is refused
    with what it needs, not left to wait for room; so is one asking for whole devices that no device holds (its
    context inside it: the same sum)."""
    p_prime, _ = lane_request(persistent, ephemeral, 0)
    job = Job(workflow_id, context=context)
    room = [(int(devices[d.device_id].memory_total or 0) - d.context_of(job), d) for d in fleet.devices
            if d.device_id in devices]
    best = max(room, default=None, key=lambda x: x[0])
    if best is not None and best[0] < p_prime + ephemeral:
        device = best[1]
        c = device.context_of(job)
        raise InvalidInput(
            f"{workflow_id!r} needs {p_prime + ephemeral + c} bytes on a device ({p_prime} persistent with headroom, "
            f"{ephemeral} ephemeral, {c} of CUDA context and workspaces {'on it' if whole else 'outside its lane'}), "
            f"more than any device on host {host_id!r} has ({best[0] + c} on device {device.device_id}); "
            f"{'no device' if whole else 'no lane'} can hold it: check --mem-mb, or run it on a bigger device")

