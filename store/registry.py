"""Shared queries for what is registered: hosts, devices, workflows and processes, whether an agent sees them or an
importer or a recording brings them (their bulk writes are here too: nothing else writes these rows)."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from store.models import Action, ActionEvent, Device, Host, HostEvent, Lane, Placement, Process, Workflow
from store.rows import insert_missing
from store.slurm_nodes import closed_reason, unresponsive_reason
from store.workflows import upsert_workflow

_INDEX_OUT_OF_WAY = 1_000_000_000  # a row changing index waits below every index a device gets


@dataclass(frozen=True)
class DeviceSpec:
    """What a source knows of a device when it registers it."""

    index: int
    uuid: str
    name: str
    memory_total: int | None
    cpu_cores: tuple[int, ...] | None = None


def register_host(
    session: Session,
    host_id: str,
    *,
    hostname: str,
    source: str,
    agent_version: str | None = None,
    agent_pid: int | None = None,
    labels: dict[str, Any] | None = None,
    now: float | None = None,
) -> Host:
    """Create the host unless it exists (two agents starting at once under one host id, a restart overlapping its
    predecessor: neither fails on the key, store.rows) and refresh it."""
    now = time.time() if now is None else now
    insert_missing(session, Host, {"id": host_id, "started_at": now, "hostname": hostname, "source": source,
                                   "last_seen": now, "labels": {}})
    host = session.get(Host, host_id, populate_existing=True)
    host.hostname, host.source, host.last_seen = hostname, source, now
    host.agent_version, host.agent_pid = agent_version, agent_pid
    if labels is not None:
        host.labels = labels
    session.flush()
    return host


def touch_host(session: Session, host_id: str, now: float | None = None) -> None:
    """Keep the host row alive: last_seen is when its agent last wrote."""
    session.execute(update(Host).where(Host.id == host_id).values(last_seen=time.time() if now is None else now))


def hosts_heard_from(session: Session, host_ids: Iterable[str]) -> dict[str, float]:
    """{host: when it was last heard from}: the later of its heartbeat (`Host.last_seen`, which its agent touches at
    every flush) and its usable devices' newest record (`Device.last_seen`, which an importer refreshes at every
    import of a node no agent of ours runs on: a Slurm node is heard from when the Slurm import last listed it).
    When, only: what Slurm says of the node's state (silent_hosts) is not a time."""
    ids = sorted(set(host_ids))
    if not ids:
        return {}
    rows = session.execute(
        select(Host.id, Host.last_seen, func.max(Device.last_seen))
        .outerjoin(Device, (Device.host_id == Host.id) & (Device.state == "ok"))
        .where(Host.id.in_(ids)).group_by(Host.id, Host.last_seen)).tuples()
    return {host: max(float(seen), float(device_seen if device_seen is not None else seen))
            for host, seen, device_seen in rows}


def _slurm_labels(session: Session, host_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{host: what the Slurm import's latest listing said of the node (`labels.slurm`)} for the hosts it listed."""
    ids = sorted(set(host_ids))
    if not ids:
        return {}
    return {host: dict((labels or {}).get("slurm") or {})
            for host, labels in session.execute(select(Host.id, Host.labels).where(Host.id.in_(ids))).tuples()
            if (labels or {}).get("slurm")}


def silent_hosts(session: Session, host_ids: Iterable[str], limit_s: float, now: float) -> dict[str, str]:
    """{host: why it is not heard from} of the hosts not heard from for more than `limit_s` (hosts_heard_from), and
    of the Slurm nodes whose latest listing shows them not answering Slurm (down, not responding, failed, powered
    off: store.slurm_nodes; the listing itself is no sign of life then, and an agent's heartbeat does not outweigh
    Slurm's word until a listing says the node answers again). The one rule the planner, consolidation, the Slurm
    cycle and the move checks leave hosts alone by: nothing is moved onto or off them."""
    heard = hosts_heard_from(session, host_ids)
    slurm = _slurm_labels(session, heard)
    out: dict[str, str] = {}
    for host, when in sorted(heard.items()):
        if now - when > limit_s:
            out[host] = (f"has not been heard from for {now - when:.0f} s (more than {limit_s:.0f} s, "
                         "FLEETLENS_HOST_SILENT_AFTER_S)")
        elif (why := unresponsive_reason(slurm.get(host))) is not None:
            out[host] = f"is not heard from: {why}"
    return out


def closed_hosts(session: Session, host_ids: Iterable[str]) -> dict[str, str]:
    """{host: why it takes no new job} of the Slurm nodes whose latest listing shows them drained, draining, in
    maintenance or reserved (store.slurm_nodes): alive, so a job may be moved off one, never onto one."""
    return {host: f"takes no new job: {why}" for host, label in sorted(_slurm_labels(session, host_ids).items())
            if (why := closed_reason(label)) is not None}


def hosts_left_alone(session: Session, host_ids: Iterable[str], limit_s: float,
                     now: float) -> tuple[dict[str, str], dict[str, str]]:
    """({host: why it is not heard from}, {host: why it takes no new job}) of `host_ids`: silent_hosts, and
    closed_hosts of the others (a node Slurm reports both down and drained is not heard from, and named there
    only). What the enforcer plans around (enforcer.fleet_state), and what `fleetlens status` and the dashboard
    show, from the one rule."""
    ids = sorted(set(host_ids))
    silent = silent_hosts(session, ids, limit_s, now)
    closed = {host: why for host, why in closed_hosts(session, ids).items() if host not in silent}
    return silent, closed


def register_devices(
    session: Session, host_id: str, specs: Iterable[DeviceSpec], *, source: str, now: float | None = None,
    moved_here: bool = False,
) -> dict[int, int]:
    """Create or refresh the host's devices; returns {device index on the host: device id in the store}.

    A device is its UUID (jobs name their GPUs by UUID): a GPU the host numbers otherwise after a reboot keeps its
    row, lanes and history under its new index. A UUID the host has not registered takes the row at its index whose
    UUID the host no longer reports (a GPU swapped in at the same place), else a new row. A row pushed off its index
    by a renumbered GPU, its own GPU no longer reported, is marked lost at a negative index (-its id), where nothing
    is placed and no other device's index falls. With `moved_here` (the host's agent, which reads its GPUs' UUIDs
    from the hardware), a GPU moved here from another host leaves that host's row lost, its UUID suffixed
    `@moved:<id>` (UUIDs are unique in the store), with that host's history; otherwise a UUID another host holds
    is refused (IntegrityError), as a recording loaded beside its origin must be."""
    now = time.time() if now is None else now
    specs = list(specs)
    rows = list(session.scalars(select(Device).where(Device.host_id == host_id)))
    by_uuid = {d.uuid: d for d in rows}
    by_index = {d.index: d for d in rows}
    reported = {spec.uuid for spec in specs}
    if moved_here:
        for moved in session.scalars(select(Device).where(Device.uuid.in_(sorted(reported - by_uuid.keys())))):
            moved.uuid, moved.state = f"{moved.uuid[:100]}@moved:{moved.id}", "lost"
    planned: list[tuple[DeviceSpec, Device | None]] = []
    taken: set[int] = set()
    for spec in specs:
        device = by_uuid.get(spec.uuid)
        if device is None:
            slot = by_index.get(spec.index)
            if slot is not None and slot.uuid not in reported and slot.id not in taken:
                device = slot
        if device is not None:
            taken.add(device.id)
        planned.append((spec, device))
    wanted = {spec.index for spec in specs}
    new_index = {device.id: spec.index for spec, device in planned if device is not None}
    moving = [d for d in rows if new_index.get(d.id, d.index) != d.index or (d.id not in taken and d.index in wanted)]
    # (host, index) is unique at every statement: rows that change index go out of the way first (a swap is a cycle)
    for device in moving:
        device.index = -_INDEX_OUT_OF_WAY - device.id
    session.flush()
    for device in moving:
        if device.id not in taken:
            device.index, device.state = -device.id, "lost"
    ids: dict[int, int] = {}
    for spec, device in planned:
        if device is None:
            device = Device(host_id=host_id, registered_at=now)
            session.add(device)
        device.index, device.uuid, device.name, device.source = spec.index, spec.uuid, spec.name, source
        device.memory_total = spec.memory_total
        device.cpu_cores = list(spec.cpu_cores) if spec.cpu_cores is not None else None
        device.state, device.last_seen = "ok", now
        session.flush()
        ids[spec.index] = device.id
    return ids


def retire_unlisted_devices(session: Session, host_id: str, source: str, listed: Collection[int], *,
                            now: float | None = None) -> list[int]:
    """Mark `gone` the devices of `host_id` that `source` registered and no longer lists (`listed`: the indexes it
    lists now), and return their indexes. A GPU whose MIG mode was turned on is listed as its MIG devices from then
    on, and one turned back to a whole GPU as itself: the row the source no longer lists stands for memory that is
    now another device's (the parent GPU's is its slices'), so nothing may be placed on it. Registering the device
    again (register_devices) makes it ok again."""
    now = time.time() if now is None else now
    rows = list(session.scalars(select(Device).where(Device.host_id == host_id, Device.source == source,
                                                     Device.state == "ok")))
    gone = [d for d in rows if d.index not in set(listed)]
    for d in gone:
        d.state, d.last_seen = "gone", now
    session.flush()
    return [d.index for d in gone]


def add_hosts(session: Session, host_ids: Iterable[str], *, source: str, labels: dict[str, Any],
              now: float) -> None:
    """Register hosts the store does not have yet (the caller has checked), in one statement: an importer's
    hosts, which have no agent."""
    rows = [{"id": h, "hostname": h, "source": source, "labels": labels, "started_at": now, "last_seen": now}
            for h in host_ids]
    if rows:
        session.execute(insert(Host), rows)


def register_devices_of_hosts(session: Session, specs: Mapping[str, Iterable[DeviceSpec]], *, source: str,
                              now: float) -> dict[tuple[str, int], int]:
    """register_devices for many hosts at once, in three statements whatever their number (read, update the
    known, insert the new); returns {(host, device index): device id}. A device here is its place on its host (an
    importer's series name the host and the GPU's index): a UUID found at another place of the same host (GPUs
    renumbered after a reboot) moves there, and the row it leaves, unless it takes another UUID now, is marked lost
    with its UUID suffixed `@moved:<id>` (one more statement, only then). A UUID another host holds is refused."""
    wanted = {(h, spec.index): spec for h, host_specs in specs.items() for spec in host_specs}
    if not wanted:
        return {}
    held = session.execute(select(Device.host_id, Device.index, Device.id, Device.uuid)
                           .where(Device.host_id.in_(list(specs)))).tuples().all()
    known = {(h, i): d for h, i, d, _ in held if (h, i) in wanted}
    # UUIDs are unique at every statement: one leaving its row for another row of the host is freed first
    will_hold = {known[key]: spec.uuid for key, spec in wanted.items() if key in known}
    taken = {spec.uuid for spec in wanted.values()}
    freed = [{"id": d, "uuid": f"{u[:100]}@moved:{d}", "state": "lost"} for _, _, d, u in held
             if u in taken and will_hold.get(d) != u]
    if freed:
        session.execute(update(Device), freed)

    def fields(spec: DeviceSpec) -> dict[str, Any]:
        return {"uuid": spec.uuid, "name": spec.name, "source": source, "memory_total": spec.memory_total,
                "cpu_cores": list(spec.cpu_cores) if spec.cpu_cores is not None else None, "state": "ok",
                "last_seen": now}

    if known:
        session.execute(update(Device), [{"id": d, **fields(wanted[key])} for key, d in known.items()])
    new = [{"host_id": h, "index": i, "registered_at": now, **fields(spec)}
           for (h, i), spec in wanted.items() if (h, i) not in known]
    if new:
        known.update({(h, i): d for h, i, d in session.execute(
            insert(Device).returning(Device.host_id, Device.index, Device.id), new).tuples()})
    return known


def device_ids(session: Session, host_id: str) -> dict[int, int]:
    """{device index on the host: device id in the store} for every device the host ever registered."""
    return {d.index: d.id for d in session.scalars(select(Device).where(Device.host_id == host_id))}


def device_ids_by_uuid(session: Session, host_id: str, uuids: Iterable[str]) -> dict[str, int]:
    """{UUID: device id} for the host's devices registered with these UUIDs, whatever their index now."""
    return {u: d for u, d in session.execute(select(Device.uuid, Device.id).where(
        Device.host_id == host_id, Device.uuid.in_(sorted(set(uuids))))).tuples()}


DEVICE_LOST = "device_lost"  # actions.kind of the record a lost device leaves for each job it held


def mark_device_lost(session: Session, device_id: int, now: float | None = None) -> int:
    """The device fell off the bus: mark it lost (no job is placed on it until it answers again) and, the first
    time, leave one failed `device_lost` action per job placed there, so the action log and the dashboard say
    which jobs and lanes it took with it. Nothing else changes: placements, lanes, checkpoints and the jobs' other
    devices and lane-mates elsewhere are left as they are. Returns how many jobs it held."""
    now = time.time() if now is None else now
    device = session.get(Device, device_id)
    if device is None:
        return 0
    first = device.state != "lost"
    device.state, device.last_seen = "lost", now
    if not first:
        return 0
    held = list(session.scalars(select(Placement).where(
        Placement.device_id == device_id, Placement.state.in_(("active", "pending"))).order_by(Placement.id)))
    for p in held:
        where = f"lane {p.lane_id}" if p.lane_id is not None else "the whole device"
        message = (f"device {device.index} ({device.name}, {device.uuid}) of host {device.host_id} fell off the bus "
                   f"under {p.workflow_id} ({where}); fleetlens stopped nothing and kept its placement and "
                   "checkpoints: restart or move the job once the device is back or replaced")
        action = Action(kind=DEVICE_LOST, workflow_id=p.workflow_id, from_device_id=device_id, to_lane_id=None,
                        state="failed", error=message, attempts=0, created_at=now, updated_at=now)
        session.add(action)
        session.flush()
        session.add(ActionEvent(action_id=action.id, ts=now, from_state=None, to_state="failed", message=message,
                                detail={"device_id": device_id, "lane_id": p.lane_id, "pid": p.pid}))
    return len(held)


@dataclass(frozen=True)
class SeenProcess:
    pid: int
    start_time: float
    workflow_id: str
    cmdline: str | None = None
    username: str | None = None


def record_processes(session: Session, host_id: str, seen: Iterable[SeenProcess], now: float | None = None) -> None:
    """Upsert the processes seen in this round and mark the host's others as ended."""
    now = time.time() if now is None else now
    live = {(p.pid, p.start_time): p for p in seen}
    open_rows = session.scalars(select(Process).where(Process.host_id == host_id, Process.ended_at.is_(None)))
    known = set()
    for row in open_rows:
        key = (row.pid, row.start_time)
        if key in live:
            row.last_seen = now
            known.add(key)
        else:
            row.ended_at = now
    new = [key for key in live if key not in known]
    if new:
        # A process marked ended (missed for one round, e.g. unreadable /proc) may come back: reopen its row.
        pids = {pid for pid, _ in new}
        ended = session.scalars(
            select(Process).where(Process.host_id == host_id, Process.pid.in_(pids), Process.ended_at.is_not(None))
        )
        for row in ended:
            key = (row.pid, row.start_time)
            if key in live and key not in known:
                row.ended_at, row.last_seen = None, now
                known.add(key)
    for key, p in live.items():
        if key not in known:
            session.add(
                Process(
                    host_id=host_id, pid=p.pid, start_time=p.start_time, workflow_id=p.workflow_id,
                    cmdline=p.cmdline, username=p.username, first_seen=now, last_seen=now,
                )
            )
    session.flush()


def touch_open_processes(session: Session, host_id: str, now: float | None = None) -> None:
    """The host's processes still running are the same as last time: mark them seen in one UPDATE."""
    session.execute(
        update(Process).where(Process.host_id == host_id, Process.ended_at.is_(None))
        .values(last_seen=time.time() if now is None else now)
    )


def touch_workflows(session: Session, new: Mapping[str, str], seen: Iterable[str], now: float) -> None:
    """Create the workflows in `new` ({id: how it was found}) that are not in the store yet, and mark every workflow
    in `seen` seen at `now` (one UPDATE). Two agents may create the same workflow at once (one job on two hosts):
    the first insert wins and neither fails (upsert_workflow)."""
    for workflow_id, id_source in new.items():
        if session.get(Workflow, workflow_id) is None:
            upsert_workflow(session, workflow_id, id_source=id_source, now=now)
    session.execute(update(Workflow).where(Workflow.id.in_(list(seen)), Workflow.last_seen < now).values(last_seen=now))


def record_host_event(session: Session, host_id: str, kind: str, level: str, message: str,
                      detail: dict[str, Any] | None = None, *, now: float | None = None) -> None:
    """Note something the host's agent did or met outside any one job (shown with the host on the dashboard)."""
    session.add(HostEvent(host_id=host_id, ts=time.time() if now is None else now, kind=kind, level=level,
                          message=message, detail=dict(detail or {})))


def _busy_gpu_lane_rows(session: Session, host_id: str, column: Any) -> Any:
    """(lane id, `column`) for the open lanes on this host's GPUs (nvml devices) that hold a live job."""
    return session.execute(
        select(Lane.id, column).join(Device, Device.id == Lane.device_id)
        .where(Device.host_id == host_id, Device.source == "nvml", Lane.state == "open",
               select(Placement.id).where(Placement.lane_id == Lane.id,
                                          Placement.state.in_(("active", "pending"))).exists())
    )


def busy_gpu_lane_devices(session: Session, host_id: str) -> dict[int, str]:
    """{lane id: its GPU's UUID} for the lanes busy_gpu_lanes lists."""
    return {int(lane_id): str(uuid) for lane_id, uuid in _busy_gpu_lane_rows(session, host_id, Device.uuid)}


def busy_gpu_lanes(session: Session, host_id: str) -> dict[int, float]:
    """{lane id: compute share} for the open lanes on this host's GPUs (nvml devices) that hold a live job."""
    return {int(lane_id): float(share)
            for lane_id, share in _busy_gpu_lane_rows(session, host_id, Lane.compute_share)}


# ---- bulk registration for importers and recordings (many rows, few statements) -----------------------------------

def known_processes(session: Session, host_ids: Collection[str]) -> set[tuple[str, int, float]]:
    """(host, pid, start time) of every process registered on these hosts."""
    return set(session.execute(select(Process.host_id, Process.pid, Process.start_time)
                               .where(Process.host_id.in_(list(host_ids)))).tuples())


def forget_processes(session: Session, host_ids: Collection[str]) -> None:
    """Drop every process registered on these hosts (a recording loaded again replaces its own)."""
    session.execute(delete(Process).where(Process.host_id.in_(list(host_ids))))


def add_processes(session: Session, rows: list[dict[str, Any]]) -> None:
    """Register processes an importer or a recording found (rows of `processes` columns), in one statement."""
    if rows:
        session.execute(insert(Process), rows)


def refresh_processes(session: Session, rows: list[dict[str, Any]]) -> None:
    """Move on processes seen again (rows with `id` and the columns that change), in one statement."""
    if rows:
        session.execute(update(Process), rows)


def add_workflows(session: Session, rows: list[dict[str, Any]]) -> None:
    """Register workflows an importer found (rows of `workflows` columns), in one statement."""
    if rows:
        session.execute(insert(Workflow), rows)


def refresh_workflows(session: Session, rows: list[dict[str, Any]]) -> None:
    """Update workflows by id; rows of one shape per statement, since an executemany needs the same columns."""
    for keys in {tuple(r) for r in rows}:
        session.execute(update(Workflow), [r for r in rows if tuple(r) == keys])


def refresh_devices(session: Session, rows: list[dict[str, Any]]) -> None:
    """Update devices by id (an importer's last sighting and state), in one statement."""
    if rows:
        session.execute(update(Device), rows)
