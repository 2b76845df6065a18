"""Which open telemetry findings a detection run resolves: those the window shows are gone, and no others.

Every telemetry rule judges one workflow on one device (its subject is `device:N`), so the evidence is the device's.
A finding the run did not find again is resolved when
- its device reported in the window (it has samples there) and no longer shows the pattern;
- or its workflow no longer runs there: it finished or failed (the SDK, a managed job's end, a Slurm import), or
  every process of it on the device's host had ended by the window's end (that host's agent recorded it). Not for
  zombie memory: that is memory still held after the workflow's processes ended, which only the device's own
  samples can show freed;
- or its device is no longer in the store.
A device with no sample in the window (its host's agent down or cut off, or every agent down) is not judged on its
samples: its findings stay as they are, acknowledgement and history included, and keep counting in the waste and the
ranking; a workflow on several hosts is judged on the devices that reported. Until one of these (not for zombie
memory, but the last) says otherwise (analyzer.telemetry.silence has the facts):
- its workflow moved away: its placement on the device ended and it is placed on other devices only (a migration, a
  Slurm requeue onto another node), or a process of it runs on another host, started after the device last reported,
  where none of it ran then;
- or the device has been silent longer than the run's silence limit (FLEETLENS_SILENT_DEVICE_LIMIT_S): its host is
  taken as gone (decommissioned, its agent gone for good). Were it to come back with the pattern, the finding opens
  again as any finding found again does.
Each finding resolved carries why in its evidence, under `resolution` (REASONS), until it is found again.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from analyzer.telemetry.silence import batches, last_reports, placed_elsewhere, started_elsewhere
from store.finding_contract import TelemetryRule
from store.models import Device, DeviceSample, Finding, Process, Workflow

log = logging.getLogger(__name__)

ENDED_STATES = ("finished", "failed")
# rules whose finding outlives its workflow's processes by definition: only the device's samples clear it
DEVICE_ONLY_RULES = frozenset({TelemetryRule.ZOMBIE_MEMORY.value})
# why a finding was resolved, as its evidence's `resolution.reason` says
REASONS = ("pattern_gone", "workflow_ended", "device_gone", "moved", "silent")


def devices_with_samples(session: Session, devices: Iterable[int], start: float, end: float) -> set[int]:
    """Those of `devices` (registered ones) with a sample in [start, end): one probe of the (device_id, ts) index
    each, which stops at the first sample, however many the window holds."""
    out: set[int] = set()
    for batch in batches(int(d) for d in devices):
        any_sample = select(DeviceSample.device_id).where(
            DeviceSample.device_id == Device.id, DeviceSample.ts >= start, DeviceSample.ts < end).exists()
        out.update(int(d) for d in session.scalars(select(Device.id).where(Device.id.in_(batch), any_sample)))
    return out


def ended_on_hosts(session: Session, pairs: Iterable[tuple[str, str]], end: float) -> set[tuple[str, str]]:
    """Those (workflow, host) pairs where the workflow no longer ran at `end`: it finished or failed, or it had
    processes on the host that started before `end` and every one of them was recorded ended by then."""
    pairs = set(pairs)
    out: set[tuple[str, str]] = set()
    for batch in batches(w for w, _ in pairs):
        finished = set(session.scalars(select(Workflow.id).where(Workflow.id.in_(batch),
                                                                 Workflow.state.in_(ENDED_STATES))))
        out.update(p for p in pairs if p[0] in finished)
        ended_by_end = func.count(case((Process.ended_at <= end, 1)))
        rows = session.execute(
            select(Process.workflow_id, Process.host_id)
            .where(Process.workflow_id.in_(batch), Process.start_time < end)
            .group_by(Process.workflow_id, Process.host_id)
            .having(func.count() == ended_by_end))
        out.update(p for p in rows.tuples() if p in pairs)
    return out


def resolve_gone(session: Session, found: Collection[str], start: float, end: float, *, rules: Collection[str],
                 workflows: Collection[str] | None = None, seen_devices: Collection[int] = (),
                 silent_limit_s: float | None = None) -> tuple[int, int]:
    """Resolve, at `end`, the open telemetry findings of `rules` (of `workflows` only, when given) that this run over
    [start, end) did not find (their fingerprints are not in `found`) and the store shows gone (see the module doc).
    `seen_devices`: devices the run's summary already shows reporting (not probed again). `silent_limit_s`: a device
    that last reported longer ago than this has its findings resolved (None or 0: never for silence alone). Returns
    (resolved, kept: left as they are, their devices silent)."""
    query = select(Finding).where(Finding.source == "telemetry", Finding.rule.in_(list(rules)),
                                  Finding.status != "resolved")
    if workflows is not None:
        query = query.where(Finding.workflow_id.in_(list(workflows)))
    stale = [f for f in session.scalars(query) if f.fingerprint not in found]
    if not stale:
        return 0, 0
    devices = {int(f.device_id) for f in stale if f.device_id is not None}
    host_of: dict[int, str] = {}
    for batch in batches(devices):
        host_of.update((int(d), str(h)) for d, h in session.execute(
            select(Device.id, Device.host_id).where(Device.id.in_(batch))).tuples())
    seen = {int(d) for d in seen_devices}
    reported = (devices & seen) | devices_with_samples(session, (devices - seen) & host_of.keys(), start, end)
    silent = [f for f in stale if f.device_id in host_of and f.device_id not in reported]
    why = {f.id: _resolution("device_gone") for f in stale if f.device_id is None or f.device_id not in host_of}
    why.update((f.id, _resolution("pattern_gone", device=f.device_id)) for f in stale if f.device_id in reported)
    ended = ended_on_hosts(session, {(f.workflow_id, host_of[f.device_id]) for f in silent
                                     if f.rule not in DEVICE_ONLY_RULES}, end)
    why.update((f.id, _resolution("workflow_ended", host=host_of[f.device_id])) for f in silent
               if f.rule not in DEVICE_ONLY_RULES and (f.workflow_id, host_of[f.device_id]) in ended)
    why.update(_silent_reasons(session, [f for f in silent if f.id not in why], host_of, end, silent_limit_s))
    resolved = kept = 0
    kept_devices: set[int] = set()
    for finding in stale:
        reason = why.get(finding.id)
        if reason is not None:
            finding.status, finding.updated_at = "resolved", end
            # a new dict: the JSON column is written only when the attribute is set anew
            finding.evidence = {**(finding.evidence or {}), "resolution": {**reason, "at": end}}
            resolved += 1
        else:
            kept += 1
            kept_devices.add(int(finding.device_id))
    if kept:
        log.warning("%d open findings on %d devices without a sample in the window are left as they are (their "
                    "hosts did not report): %s", kept, len(kept_devices), sorted(kept_devices)[:5])
    return resolved, kept


def _resolution(reason: str, **detail: Any) -> dict[str, Any]:
    return {"reason": reason, **detail}


def _silent_reasons(session: Session, silent: list[Finding], host_of: dict[int, str], end: float,
                    limit_s: float | None) -> dict[int, dict[str, Any]]:
    """Why each of these findings of silent devices is resolved, for those the store shows gone: the workflow moved
    away, or the device is silent longer than `limit_s`."""
    if not silent:
        return {}
    last = last_reports(session, {int(f.device_id) for f in silent})
    movable = [f for f in silent if f.rule not in DEVICE_ONLY_RULES]
    placed = placed_elsewhere(session, {(f.workflow_id, int(f.device_id)) for f in movable})
    started = started_elsewhere(session, {(f.workflow_id, host_of[f.device_id], last[f.device_id]) for f in movable
                                          if last.get(f.device_id) is not None})
    out: dict[int, dict[str, Any]] = {}
    for f in silent:
        device, since = int(f.device_id), last.get(f.device_id)
        left = placed.get((f.workflow_id, device)) if f.rule not in DEVICE_ONLY_RULES else None
        if left is None and f.rule not in DEVICE_ONLY_RULES and since is not None:
            left = started.get((f.workflow_id, host_of[device], since))
        if left is not None:
            out[f.id] = _resolution("moved", device=device, last_report=since, now_on=left.where, known_by=left.how,
                                    started=left.since)
        elif limit_s and (since is None or since < end - limit_s):
            out[f.id] = _resolution("silent", device=device, host=host_of[device], last_report=since,
                                    limit_s=float(limit_s))
    return out
