"""Zombie memory: a device keeps memory in use after every process of the workflow that used it has ended.

The memory is attributed to the last workflow seen on the device before it became unattributed, and
only when the store records all of that workflow's processes on the device's host as ended
(processes.ended_at) by the time the memory was still held. Memory nobody can be blamed for is not a
finding (a source without per-process data never produces one).
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy import func, select

from analyzer.telemetry.common import gib, num
from analyzer.telemetry.frame import fmt_window
from analyzer.telemetry.summary import WindowSummary, before_workflows
from analyzer.telemetry.thresholds import Thresholds
from store.finding_contract import TelemetryRule
from store.findings import FindingSpec
from store.models import Process, ProcessSample

RULE = TelemetryRule.ZOMBIE_MEMORY.value


def _last_workflows(window: WindowSummary, device_id: int, before: float) -> list[tuple[str, float]]:
    """The workflows last seen on the device before `before` (an earlier piece of the window, else the stored
    process samples of as long again before the window), with when they were last seen."""
    seen = window.seen[(window.seen["device_id"] == device_id) & (window.seen["piece_end"] <= before)]
    if not seen.empty:
        last = seen["seen_last_ts"].max()
        return [(str(w), float(last)) for w in seen.loc[seen["seen_last_ts"] == last, "workflow_id"].unique()]
    if window.store is None:
        return []
    lookback = window.start - (window.end - window.start)
    ps = ProcessSample
    with window.store.session() as session:
        last = session.scalar(
            select(func.max(ps.ts)).where(ps.device_id == device_id, ps.ts < window.start, ps.ts >= lookback)
        )
        if last is None:
            return []
        rows = session.execute(select(ps.workflow_id).where(ps.device_id == device_id, ps.ts == last).distinct())
        return [(str(r[0]), float(last)) for r in rows]


def _ended_at(window: WindowSummary, workflow_id: str, host_id: str) -> float | None:
    """When the workflow's last process on the host ended; None if any is still running or none is known."""
    if window.store is None:
        return None
    with window.store.session() as session:
        row = session.execute(
            select(func.count(), func.count(Process.ended_at), func.max(Process.ended_at))
            .where(Process.workflow_id == workflow_id, Process.host_id == host_id)
        ).one()
    n, n_ended, last_end = row
    if n == 0 or n_ended < n:
        return None
    return float(last_end)


def find(window: WindowSummary, th: Thresholds) -> list[FindingSpec]:
    t = th.zombie_memory
    found = window.orphan_runs  # runs of memory in use with no workflow's process, at least t.min_duration_s long
    hits: dict[tuple[str, int], list[dict]] = {}
    for _, run in found.iterrows():
        dev = int(run["device_id"])
        if dev not in window.devices.index:
            continue
        host = str(window.devices.loc[dev, "host_id"])
        # the workflows last seen on the device before the run: in the run's own piece, else earlier
        for wf, last_seen in before_workflows(run) or _last_workflows(window, dev, float(run["start"])):
            ended = _ended_at(window, wf, host)
            if ended is None or ended > float(run["end"]):
                continue
            held_from = max(float(run["start"]), ended)
            duration = float(run["end"]) - held_from
            if duration >= t.min_duration_s:
                hits.setdefault((wf, dev), []).append(
                    {"start": held_from, "end": float(run["end"]), "duration_s": duration,
                     "mem_max": float(run["mem_max"]), "ended_at": ended, "last_seen": last_seen}
                )
    specs = []
    for (wf, dev), items in hits.items():
        frame = pd.DataFrame(items)
        zombie_s = float(frame["duration_s"].sum())
        per_day = window.per_day(zombie_s)
        last = frame.loc[frame["end"].idxmax()]
        host = window.devices.loc[dev, "host_id"]
        words = window.device_words(dev)
        specs.append(FindingSpec(
            rule=RULE, workflow_id=wf, source="telemetry", severity=th.severity(per_day),
            title=(f"{gib(frame['mem_max'].max())} GiB still held on {window.device_short(dev)} "
                   f"{zombie_s / 3600:.1f} h after the workflow's processes ended"),
            evidence={
                "zombie_hours": num(zombie_s / 3600), "mem_held_gib": gib(frame["mem_max"].max()),
                "processes_ended_at": num(float(frame["ended_at"].max()), 1),
                "workflow_last_seen": num(float(frame["last_seen"].max()), 1), "runs": int(len(frame)),
                "min_duration_s": t.min_duration_s, "window_hours": num(window.span_s / 3600),
            },
            location=f"{window.device_label(dev)}, {fmt_window(last['start'], last['end'])}",
            gpu_hours_per_day=round(per_day, 3),
            fix=(f"free the device: on host {host} find the leftover process holding it ({words.leftover_process}), "
                 f"kill it, or {words.reset}; make the job's launcher kill its whole process group on exit"),
            device_id=dev, subject=f"device:{dev}",
        ))
    return specs
