"""Writing a Prometheus import's planned windows: each in one transaction, committed in window order, its hosts,
devices, workflows and processes registered with its samples."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from collector.dcgm_names import POD
from collector.importers.dcgm_frames import Parsed, device_batch, process_batch
from collector.importers.dcgm_labels import SOURCE, synthetic_pid
from store import late_hours
from store.db import Store
from store.ingest import sample_errors, write_sample_batches_on
from store.models import Device, Host, Process, Workflow
from store.registry import (
    DeviceSpec,
    add_hosts,
    add_processes,
    add_workflows,
    refresh_devices,
    refresh_processes,
    refresh_workflows,
    register_devices_of_hosts,
)


@dataclass
class Window:
    """One window's new samples, ready to write."""

    parsed: Parsed
    wide: dict[str, np.ndarray]
    keep: np.ndarray
    procs: dict[tuple[int, int], np.ndarray]


class Turn:
    """A window's place in the write order: its own futures (its new devices registered, its transaction
    committed), which the window after it waits for, and those of the window before it (None for the first)."""

    def __init__(self, before: Turn | None) -> None:
        self.before_registered = None if before is None else before.registered
        self.before_committed = None if before is None else before.committed
        self.registered: Future = Future()
        self.committed: Future = Future()

    def settle(self, exc: BaseException | None) -> None:
        for done in (self.registered, self.committed):
            if not done.done():
                if exc is None:
                    done.set_result(None)
                else:
                    done.set_exception(exc)


class _EarlierWindowFailed(Exception):
    """The window before this one was not written; this one is rolled back (the caller reports the first)."""


@dataclass
class Registered:
    """Hosts and devices windows of this import inserted, committed or not: what a later window must not insert
    again while the one that did has not committed yet. Only the window whose turn it is to register touches it."""

    hosts: set[str] = field(default_factory=set)
    devices: dict[tuple[str, int], int] = field(default_factory=dict)


def _wait(before: Future | None) -> None:
    if before is None:
        return
    try:
        before.result()
    except Exception:
        raise _EarlierWindowFailed() from None


def write_window(store: Store, url: str, w: Window, until: float, step: float, seen: dict[str, Any],
                  hi: float, registry: Registered, turn: Turn) -> tuple[int, int, float]:
    """One window in one transaction: its new hosts and devices (after the window before has inserted its own),
    its samples (while the window before may still be writing), then, once the window before has committed, the
    rest of its registration (devices seen again, workflows, processes) and its commit; (device samples, process
    samples, the window's end)."""
    error: BaseException | None = None
    try:
        with sample_errors(store), store.session() as s:
            mem_total = _memory_totals(w.wide, w.keep)
            _wait(turn.before_registered)
            device_ids = _add_new_devices(s, url, w.parsed, mem_total, until, registry)
            turn.registered.set_result(None)
            dev_ids = np.array([device_ids.get((d.host, d.index), -1) for d in w.parsed.devices], dtype=np.int64)
            late: set[float] = set()
            n_dev, n_proc = write_sample_batches_on(s.connection(), store.is_postgres,
                                                    device_batch(w.wide, w.keep, dev_ids),
                                                    process_batch(w.procs, w.wide, dev_ids, w.parsed), late=late)
            _wait(turn.before_committed)
            # marked only now, in window order: a window that marked an hour before the one ahead of it had would
            # hold that hour's row while it waits for that window's commit, and that window would wait for the row
            late_hours.mark(s.connection(), store.is_postgres, late)
            _register(s, url, w.parsed, mem_total, w.wide, w.procs, until, step, seen)
        return n_dev, n_proc, hi
    except BaseException as exc:
        error = exc
        raise
    finally:
        turn.settle(error)


def _memory_totals(wide: dict[str, np.ndarray], keep: np.ndarray) -> dict[int, int | None]:
    """{dev: the largest total memory its new samples report} of every device with new samples."""
    devs = wide["dev"][keep]
    totals = wide["mem_total"][keep]
    mem_total = {}
    for d in sorted(set(devs.tolist())):
        t = totals[devs == d]
        t = t[np.isfinite(t)]
        mem_total[d] = int(round(float(t.max()))) if len(t) else None
    return mem_total


def _add_new_devices(s: Session, url: str, parsed: Parsed, mem_total: dict[int, int | None], until: float,
                     registry: Registered) -> dict[tuple[str, int], int]:
    """Insert the hosts and devices with new samples that neither the store nor an earlier window of this
    import has, in the caller's transaction; {(host, index): device id} of every device with new samples.

    Only inserts: rows the store has are left to _register, which runs after the window before has committed and
    so never waits on its locks. `mem_total`: _memory_totals of the window."""
    wanted = {(parsed.devices[d].host, parsed.devices[d].index): d for d in mem_total}
    ids = {key: registry.devices[key] for key in wanted if key in registry.devices}
    hosts = sorted({h for h, _ in wanted if h not in registry.hosts})
    if hosts:
        # a host an agent registered keeps its own record
        known_hosts = set(s.scalars(select(Host.id).where(Host.id.in_(hosts))))
        add_hosts(s, [h for h in hosts if h not in known_hosts], source=SOURCE, labels={"imported_from": url},
                  now=until)
        registry.hosts.update(hosts)
    missing = [key for key in wanted if key not in ids]
    if missing:
        ids.update({(h, i): d for h, i, d in s.execute(
            select(Device.host_id, Device.index, Device.id)
            .where(Device.host_id.in_(sorted({h for h, _ in missing})))).tuples() if (h, i) in wanted})
        by_host: dict[str, list[DeviceSpec]] = {}
        for key in missing:
            if key not in ids:
                dk = parsed.devices[wanted[key]]
                by_host.setdefault(dk.host, []).append(DeviceSpec(index=dk.index, uuid=dk.uuid, name=dk.name,
                                                                  memory_total=mem_total[wanted[key]]))
        ids.update(register_devices_of_hosts(s, by_host, source=SOURCE, now=until))
        registry.devices.update({key: ids[key] for key in missing})
    return ids


def _register(s: Session, url: str, parsed: Parsed, mem_total: dict[int, int | None], wide: dict[str, np.ndarray],
              procs: dict[tuple[int, int], np.ndarray], until: float, step: float, seen: dict[str, Any]) -> None:
    """Devices seen again (their last sighting, or a new UUID at the same place), workflows and their synthetic
    processes, in the caller's transaction, after _add_new_devices (`mem_total`: _memory_totals of the window)."""
    used = sorted(mem_total)
    ts = wide["ts"]
    span = {key: (float(ts[rows[0]]), float(ts[rows[-1]])) for key, rows in procs.items()}
    # a workflow whose series stopped before the imported range ends is over (two steps of slack for scrapes)
    ended_before = until - 2 * step
    hosts = sorted({parsed.devices[d].host for d in used})
    known_devices = {(h, i): (d, u) for h, i, d, u in s.execute(
        select(Device.host_id, Device.index, Device.id, Device.uuid).where(Device.host_id.in_(hosts))).tuples()}
    by_host: dict[str, list[DeviceSpec]] = {}
    refresh = []
    for d in used:
        key = parsed.devices[d]
        known = known_devices.get((key.host, key.index))
        if known is not None and known[1] == key.uuid:  # imported before: only its last sighting moves on
            refresh.append({"id": known[0], "last_seen": until, "state": "ok"})
            continue
        by_host.setdefault(key.host, []).append(DeviceSpec(index=key.index, uuid=key.uuid, name=key.name,
                                                           memory_total=mem_total[d]))
    refresh_devices(s, refresh)
    register_devices_of_hosts(s, by_host, source=SOURCE, now=until)
    seen_wf: dict[int, tuple[float, float]] = {}
    devices_of: dict[int, set[int]] = {}  # a job on two MIG slices holds two devices, not one
    for (d, w), (first, last) in span.items():
        lo, hi = seen_wf.get(w, (first, last))
        seen_wf[w] = (min(lo, first), max(hi, last))
        devices_of.setdefault(w, set()).add(d)
    ids = [parsed.workflows[w].id for w in seen_wf]
    existing = {row.id: row for row in s.execute(
        select(Workflow.id, Workflow.team, Workflow.labels, Workflow.created_at, Workflow.last_seen, Workflow.gpus)
        .where(Workflow.id.in_(ids)))}
    new_wf, changed_wf = [], []  # written in two statements (executemany), not one per workflow
    for w, (first, last) in seen_wf.items():
        wk = parsed.workflows[w]
        row = existing.get(wk.id)
        state = "finished" if last < ended_before else "running"
        if row is None:
            new_wf.append({"id": wk.id, "id_source": wk.id_source, "name": dict(wk.labels).get(POD) or wk.id,
                           "team": wk.team, "labels": {**dict(wk.labels), "imported_from": url},
                           "created_at": first, "last_seen": last, "state": state, "gpus": len(devices_of[w])})
            continue
        # a workflow an agent registered keeps how it was found and its team
        change = {"id": wk.id, "labels": {**(row.labels or {}), **dict(wk.labels), "imported_from": url},
                  "team": wk.team if row.team is None else row.team, "created_at": min(row.created_at, first),
                  "gpus": max(row.gpus or 0, len(devices_of[w]))}
        if last >= row.last_seen:
            change.update(last_seen=last, state=state)
        changed_wf.append(change)
    add_workflows(s, new_wf)
    refresh_workflows(s, changed_wf)
    pids = {(d, w): synthetic_pid(parsed.workflows[w].id, parsed.devices[d].uuid) for d, w in span}
    known_procs = {(h, p, wf): i for i, h, p, wf in s.execute(
        select(Process.id, Process.host_id, Process.pid, Process.workflow_id)
        .where(Process.host_id.in_(hosts), Process.pid.in_(sorted(set(pids.values()))))).tuples()}
    new_rows, seen_again = [], []
    for (d, w), (first, last) in span.items():
        dk, wk = parsed.devices[d], parsed.workflows[w]
        ended = last + step if last < ended_before else None
        existing_id = known_procs.get((dk.host, pids[(d, w)], wk.id))
        if existing_id is None:
            new_rows.append({"host_id": dk.host, "pid": pids[(d, w)], "start_time": first, "workflow_id": wk.id,
                             "cmdline": f"{wk.id} on {dk.uuid} (dcgm-exporter)", "username": None,
                             "first_seen": first, "last_seen": last, "ended_at": ended})
        else:
            seen_again.append({"id": existing_id, "last_seen": last, "ended_at": ended})
    add_processes(s, new_rows)
    refresh_processes(s, seen_again)
    seen["hosts"].update(hosts)
    seen["devices"].update((parsed.devices[d].host, parsed.devices[d].index) for d in used)
    seen["workflows"].update(parsed.workflows[w].id for w in seen_wf)
