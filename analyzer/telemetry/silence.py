"""What the store says of devices that stopped reporting: when each last reported, and whether a workflow judged on one
now runs elsewhere (analyzer.telemetry.resolution decides with it which of their findings a run resolves).

Every fact is a row of the store: samples and hourly rollups, placements (written by `fleetlens run`, migrations and
the Slurm import), and the processes other hosts' agents recorded. Placements need no clock. A silent host's clock
enters only through its samples' times: one running a few minutes behind moves a decision by as much (the silence
limit is days), and one running ahead only delays it, since a sample dated later than the run counts as a report now.
A move shown by processes compares the silent device's newest sample with another host's process start, two clocks,
so a process counts only on a host where none of the workflow ran at that sample: a restart where it already ran,
however the clocks stand, is no move.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from store.models import Device, DeviceSample, Placement, Process, Rollup

BATCH = 1000  # ids in one IN list
HOUR = 3600.0
LIVE_PLACEMENTS = ("active", "pending")


def batches(items: Iterable, size: int = BATCH) -> Iterable[list]:
    """`items` without repeats, sorted, in lists of at most `size` (one IN list each)."""
    ordered = sorted(set(items))
    for i in range(0, len(ordered), size):
        yield ordered[i:i + size]


def last_reports(session: Session, devices: Iterable[int]) -> dict[int, float | None]:
    """Per device (registered ones), the time of its newest report: its newest sample, whatever its time (one probe
    of the (device_id, ts) index each), else the end of its newest hourly rollup (its samples went with the
    retention), else None (it never reported)."""
    out: dict[int, float | None] = {}
    for batch in batches(int(d) for d in devices):
        newest = select(func.max(DeviceSample.ts)).where(DeviceSample.device_id == Device.id).scalar_subquery()
        out.update((int(d), None if ts is None else float(ts)) for d, ts in session.execute(
            select(Device.id, newest).where(Device.id.in_(batch))).tuples())
        missing = [str(d) for d in batch if d in out and out[d] is None]
        if missing:
            rolled = session.execute(select(Rollup.subject, func.max(Rollup.hour)).where(
                Rollup.scope == "device", Rollup.subject.in_(missing)).group_by(Rollup.subject)).tuples()
            out.update((int(s), float(h) + HOUR) for s, h in rolled if h is not None)
    return out


@dataclass(frozen=True)
class Left:
    """A (workflow, device) pair the store shows the workflow no longer on: where it runs now, and how that is known."""

    how: str  # placement | process
    where: str  # e.g. "device 7" or "host b"
    since: float | None  # when it started there (a process's start), if known


def placed_elsewhere(session: Session, pairs: Collection[tuple[str, int]]) -> dict[tuple[str, int], Left]:
    """Those (workflow, device) pairs where the workflow's placement on the device ended (a move, a Slurm requeue)
    and it now holds active placements on other devices only. A workflow never placed on the device (not a managed or
    Slurm job, or a device the placements do not know by that id) is not judged here."""
    pairs = set(pairs)
    out: dict[tuple[str, int], Left] = {}
    for batch in batches(w for w, _ in pairs):
        # a workflow has a placement per device it ran on (moves and requeues add one each): few rows
        rows = session.execute(select(Placement.workflow_id, Placement.device_id, Placement.state).where(
            Placement.workflow_id.in_(batch))).tuples()
        live: dict[str, set[int]] = {}
        active: dict[str, set[int]] = {}
        ended: set[tuple[str, int]] = set()
        for wf, dev, state in rows:
            if state in LIVE_PLACEMENTS:
                live.setdefault(wf, set()).add(int(dev))
                if state == "active":
                    active.setdefault(wf, set()).add(int(dev))
            else:
                ended.add((wf, int(dev)))
        in_batch = set(batch)
        for wf, dev in pairs:
            if wf in in_batch and (wf, dev) in ended and dev not in live.get(wf, ()) and active.get(wf):
                out[(wf, dev)] = Left("placement", ", ".join(f"device {d}" for d in sorted(active[wf])), None)
    return out


def started_elsewhere(session: Session, items: Collection[tuple[str, str, float]]
                      ) -> dict[tuple[str, str, float], Left]:
    """Those (workflow, host, since) items where the workflow has a process still running on another host that
    started after `since` (the time its device on `host` last reported), on a host where no process of it was
    running at `since`: it moved there (a restart where it already ran, or one more host of a job that runs on
    several, is no move). Keyed by the item."""
    by_wf: dict[str, list[tuple[str, float]]] = {}
    for wf, host, since in items:
        by_wf.setdefault(wf, []).append((host, float(since)))
    out: dict[tuple[str, str, float], Left] = {}
    for batch in batches(by_wf):
        oldest = min(s for wf in batch for _, s in by_wf[wf])
        procs = session.execute(select(Process.workflow_id, Process.host_id, Process.start_time, Process.ended_at)
                                .where(Process.workflow_id.in_(batch),
                                       or_(Process.ended_at.is_(None), Process.ended_at > oldest))).tuples()
        of_wf: dict[str, list[tuple[str, float, float | None]]] = {}
        for wf, host, started, ended in procs:
            of_wf.setdefault(wf, []).append((str(host), float(started), None if ended is None else float(ended)))
        for wf in batch:
            for host, since in by_wf[wf]:
                left = _moved(of_wf.get(wf, []), host, since)
                if left is not None:
                    out[(wf, host, since)] = left
    return out


def _moved(procs: list[tuple[str, float, float | None]], host: str, since: float) -> Left | None:
    """The first host other than `host` where one of `procs` (host, start, end) runs that started after `since`
    while none there ran at `since`."""
    there_then = {h for h, started, ended in procs if started <= since and (ended is None or ended > since)}
    new = sorted((started, h) for h, started, ended in procs
                 if h != host and ended is None and started > since and h not in there_then)
    return Left("process", f"host {new[0][1]}", new[0][0]) if new else None
