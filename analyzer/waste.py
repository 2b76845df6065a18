"""The one waste function: recoverable GPU-hours per day per device, per workflow and for the fleet.

Every total a user sees (Findings page, `fleetlens findings` / `rank`, the demo summary, the DAGs) comes
from `waste()`. What it holds to:

- Held GPU-hours per day come from the hourly rollups of the period (what a workflow or device really
  held, per day of the period). Where a workflow has no rollup yet, a telemetry finding's own detector
  window stands in (its evidence `held_hours` over `window_hours`); a trace finding of a workflow with
  no telemetry at all is *projected*: its job is assumed to run 24 h a day on its `gpus` GPUs, and the
  output says so.
- A telemetry finding claims GPU-hours of one device. Claims on one (workflow, device) overlap (an idle
  holder is also under-utilised), so their union counts: each claim is taken as a share of the time held,
  spread evenly over it, and the union is held x (1 - prod(1 - share)). It is never more than held.
  Workflows sharing a device are scaled down together if their unions add up to more than the device held.
- A trace finding claims a share of step time (`cost_fraction`); its cost is that share of the GPU-hours
  its workflow held. Findings of one rank (subject) are united the same way; ranks of one job see the same
  waste, so the largest rank's union counts. Trace waste applies to the time telemetry did not claim:
  recoverable = T + F x (held - T).
- A finding whose evidence lacks what this needs, and a workflow with no held time, are reported in
  `problems` and counted as nothing: never a made-up number.
- A MIG slice is its share of a whole GPU (analyzer.device_share, `Held.shares`): it can hold at most 24 x share
  GPU-hours a day, and a detector window's held hours on it count at that share (the rollups are weighted already).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from sqlalchemy import select

from analyzer.device_share import share_of
from analyzer.period_rows import period_rows
from store.db import Store
from store.models import Device, Workflow

DAY = 86400.0
HOUR = 3600.0
HOURS_PER_DAY = 24.0
UNION_ASSUMPTION = ("claims on one device (or one rank's step) are shares of the time held, spread evenly over it; "
                    "their union is held x (1 - prod(1 - share))")
BASES = ("rollups", "detector window", "projected", "none")
WORKFLOW_COLUMNS = ["workflow_id", "recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "telemetry_gpu_hours",
                    "trace_fraction", "basis", "findings_counted", "findings_not_counted"]
FINDING_COLUMNS = ["id", "workflow_id", "device_id", "rule", "source", "gpu_hours_per_day", "share", "basis",
                   "counted", "note"]


@dataclass(frozen=True)
class Held:
    """GPU-hours per day held per workflow and per device over one period (from the rollups)."""

    workflows: dict[str, float] = field(default_factory=dict)
    devices: dict[int, float] = field(default_factory=dict)
    period_s: float = DAY
    gpus: dict[str, int] = field(default_factory=dict)  # workflow -> its declared GPU count (for projections)
    shares: dict[int, float] = field(default_factory=dict)  # device -> its share of a GPU, where less than 1 (MIG)


@dataclass
class Waste:
    """What `waste()` found: totals, per workflow, per device and per finding, plus what it could not count."""

    recoverable_gpu_hours_per_day: float
    held_gpu_hours_per_day: float
    workflows: pd.DataFrame  # WORKFLOW_COLUMNS, largest recoverable first
    devices: pd.DataFrame  # device_id, held_gpu_hours_per_day, recoverable_gpu_hours_per_day
    findings: pd.DataFrame  # FINDING_COLUMNS: each finding's own cost (its claim, bounded by held)
    problems: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "recoverable_gpu_hours_per_day": round(self.recoverable_gpu_hours_per_day, 3),
            "held_gpu_hours_per_day": round(self.held_gpu_hours_per_day, 3),
            "workflows": _records(self.workflows),
            "problems": list(self.problems),
            "assumptions": list(self.assumptions),
        }


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for rec in frame.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()})
    return out


def _number(x: Any) -> float | None:
    """A finite, non-negative float, else None."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _union(shares: list[float]) -> float:
    keep = 1.0
    for s in shares:
        keep *= 1.0 - min(max(s, 0.0), 1.0)
    return 1.0 - keep


def _evidence(row: Any) -> dict[str, Any]:
    ev = row.get("evidence") if isinstance(row, dict) else getattr(row, "evidence", None)
    if isinstance(ev, str):  # JSON columns come back as text from some drivers
        try:
            ev = json.loads(ev)
        except ValueError:
            return {}
    return ev if isinstance(ev, dict) else {}


def _window_held(ev: dict[str, Any]) -> float | None:
    """Held GPU-hours per day by the detector's own window (no rollup yet)."""
    held, window = _number(ev.get("held_hours")), _number(ev.get("window_hours"))
    if held is None or not window:
        return None
    return min(held / window, 1.0) * HOURS_PER_DAY


def _device_of(x: Any) -> int | None:
    if x is None or (isinstance(x, float) and math.isnan(x)) or x is pd.NA:
        return None
    return int(x)


def waste(findings: pd.DataFrame, held: Held) -> Waste:
    """Recoverable GPU-hours per day from these findings (columns as analyzer.ranking.FINDING_COLUMNS)."""
    problems: list[str] = []
    rows: list[dict[str, Any]] = []
    # (workflow, device) -> [(finding index, claim)], the cap of that place and its basis
    tele: dict[tuple[str, int], list[tuple[int, float]]] = {}  # claims as shares of the time held
    place_cap: dict[tuple[str, int], tuple[float, str]] = {}
    # workflow -> subject -> [(finding index, share)]
    trace: dict[str, dict[str, list[tuple[int, float]]]] = {}
    trace_gpus: dict[str, int] = {}  # workflow -> GPU count its trace findings were taken with
    records = findings.to_dict("records") if not findings.empty else []
    for rec in records:
        wf, ev, dev = str(rec["workflow_id"]), _evidence(rec), _device_of(rec.get("device_id"))
        row = {"id": rec.get("id"), "workflow_id": wf, "device_id": dev, "rule": rec.get("rule"),
               "source": rec.get("source"), "gpu_hours_per_day": 0.0, "share": None, "basis": "none",
               "counted": False, "note": None}
        rows.append(row)
        i = len(rows) - 1
        if dev is not None:
            claim = _number(rec.get("gpu_hours_per_day"))
            if claim is None:
                row["note"] = "gpu_hours_per_day is missing or not a non-negative number"
                problems.append(f"finding {row['id']} ({row['rule']}, {wf}): {row['note']}; not counted")
                continue
            cap, basis = _cap(held, wf, dev, ev)
            if cap is None:
                row["note"] = ("no held time known for this device: no rollup for it in the period and the "
                               "evidence has no held_hours/window_hours (run `fleetlens rollup`)")
                problems.append(f"finding {row['id']} ({row['rule']}, {wf}, device {dev}): {row['note']}; not counted")
                continue
            prev = place_cap.get((wf, dev))
            place_cap[(wf, dev)] = (cap, basis) if prev is None or cap < prev[0] else prev
            # the claim is a rate over the detector's window; as a share of what was held in that same window
            window = _window_held(ev)  # unweighted, as the claim: the share is the same either way
            base = window if window else cap
            tele.setdefault((wf, dev), []).append((i, min(claim / base, 1.0) if base > 0 else 0.0))
            row.update(basis=basis, counted=True)
        else:
            share = _number(ev.get("cost_fraction"))
            if share is None or share > 1:
                row["note"] = "evidence has no cost_fraction between 0 and 1 (share of step time)"
                problems.append(f"finding {row['id']} ({row['rule']}, {wf}): {row['note']}; not counted")
                continue
            subject = str(ev.get("subject") or _subject_of(rec))
            trace.setdefault(wf, {}).setdefault(subject, []).append((i, share))
            gpus = _number(ev.get("gpus"))
            if gpus:
                trace_gpus[wf] = max(trace_gpus.get(wf, 0), int(gpus))
            row.update(share=share, counted=True)

    # telemetry: union per (workflow, device), bounded by what was held there
    place_union: dict[tuple[str, int], float] = {}
    for place, claims in tele.items():
        cap = place_cap[place][0]
        shares = [c for _, c in claims]
        place_union[place] = cap * _union(shares)
        for (i, _c), s in zip(claims, shares, strict=True):
            rows[i]["gpu_hours_per_day"] = cap * s
            rows[i]["share"] = s
    # workflows sharing a device: together never more than the device held
    by_device: dict[int, float] = {}
    for (_wf, dev), u in place_union.items():
        by_device[dev] = by_device.get(dev, 0.0) + u
    for dev, total in by_device.items():
        dev_held = held.devices.get(dev)
        if dev_held is not None and total > dev_held > 0:
            scale = dev_held / total
            for place in place_union:
                if place[1] == dev:
                    place_union[place] *= scale
                    for i, _c in tele[place]:
                        rows[i]["gpu_hours_per_day"] *= scale

    assumptions = [UNION_ASSUMPTION] if records else []
    projected_wfs: list[str] = []
    wf_rows = []
    for wf in sorted({r["workflow_id"] for r in rows} | set(held.workflows)):
        t_places = {p: u for p, u in place_union.items() if p[0] == wf}
        held_wf, basis = held.workflows.get(wf), "rollups"
        if held_wf is None and t_places:
            held_wf, basis = sum(place_cap[p][0] for p in t_places), "detector window"
        subjects = trace.get(wf, {})
        if held_wf is None and subjects:
            gpus = trace_gpus.get(wf) or _gpus_of(wf, held)
            if gpus is None:
                problems.append(f"workflow {wf}: no telemetry and no GPU count, so its trace findings cannot be "
                                "costed; register its GPUs or let the agent sample it")
                for subj in subjects.values():
                    for i, _s in subj:
                        rows[i].update(counted=False, note="no held time and no GPU count to project from")
                held_wf, basis = None, "none"
            else:
                held_wf, basis = gpus * HOURS_PER_DAY, "projected"
                projected_wfs.append(wf)
        if held_wf is None:
            if t_places or subjects:
                problems.append(f"workflow {wf}: no samples in the period, so nothing of it is counted")
            continue
        t_total = min(sum(t_places.values()), held_wf)
        f_total = max((_union([s for _, s in subj]) for subj in subjects.values()), default=0.0)
        for subj in subjects.values():
            for i, s in subj:
                rows[i].update(gpu_hours_per_day=s * held_wf, basis=basis)
        recoverable = min(held_wf, t_total + f_total * (held_wf - t_total))
        counted = sum(1 for r in rows if r["workflow_id"] == wf and r["counted"])
        wf_rows.append({"workflow_id": wf, "recoverable_gpu_hours_per_day": recoverable,
                        "held_gpu_hours_per_day": held_wf, "telemetry_gpu_hours": t_total, "trace_fraction": f_total,
                        "basis": basis, "findings_counted": counted,
                        "findings_not_counted": sum(1 for r in rows if r["workflow_id"] == wf) - counted})
    if projected_wfs:
        assumptions.append(
            f"projected ({len(projected_wfs)} workflows with trace findings and no telemetry: "
            f"{', '.join(projected_wfs[:5])}{' ...' if len(projected_wfs) > 5 else ''}): each is assumed to run "
            "24 h a day on its declared GPUs")
    wf_frame = pd.DataFrame(wf_rows, columns=WORKFLOW_COLUMNS)
    if not wf_frame.empty:
        wf_frame = wf_frame.sort_values(["recoverable_gpu_hours_per_day", "workflow_id"],
                                        ascending=[False, True]).reset_index(drop=True)
    devices = pd.DataFrame(
        [{"device_id": d, "held_gpu_hours_per_day": held.devices.get(d),
          "recoverable_gpu_hours_per_day": sum(u for p, u in place_union.items() if p[1] == d)}
         for d in sorted(set(by_device) | set(held.devices))],
        columns=["device_id", "held_gpu_hours_per_day", "recoverable_gpu_hours_per_day"])
    return Waste(
        recoverable_gpu_hours_per_day=float(wf_frame["recoverable_gpu_hours_per_day"].sum()) if len(wf_frame) else 0.0,
        held_gpu_hours_per_day=float(wf_frame["held_gpu_hours_per_day"].sum()) if len(wf_frame) else 0.0,
        workflows=wf_frame, devices=devices, findings=pd.DataFrame(rows, columns=FINDING_COLUMNS),
        problems=problems, assumptions=assumptions,
    )


def _subject_of(rec: dict[str, Any]) -> str:
    """A trace finding's rank: the stored fingerprint is rule|workflow|subject."""
    fp = rec.get("fingerprint")
    return str(fp).rsplit("|", 1)[-1] if fp else "trace"


def _cap(held: Held, wf: str, dev: int, ev: dict[str, Any]) -> tuple[float | None, str]:
    """Most GPU-hours per day one workflow can have wasted on one device, and where that bound comes from."""
    dev_held, wf_held = held.devices.get(dev), held.workflows.get(wf)
    share = held.shares.get(dev, 1.0)
    if dev_held is not None or wf_held is not None:
        known = [x for x in (dev_held, wf_held) if x is not None]
        return min(*known, HOURS_PER_DAY * share), "rollups"
    window = _window_held(ev)
    return (window * share, "detector window") if window is not None else (None, "none")


def _gpus_of(wf: str, held: Held) -> int | None:
    gpus = held.gpus.get(wf)
    return int(gpus) if gpus and gpus > 0 else None


def held_from_rollups(store: Store, now: float | None = None, period_s: float = DAY,
                      team: str | Collection[str] | None = None, rows: pd.DataFrame | None = None,
                      workflow: str | None = None) -> Held:
    """GPU-hours per day each workflow and device held over [now - period_s, now), from the hourly rollups (and, for
    the hours not rolled up yet, the rollup of their raw samples: analyzer.period_rows), MIG slices at their share.
    `team` (one, or several) and `workflow` keep only those workflows' held time: what a filtered list of findings
    is measured against.

    Per day of the closed hours in the period: the hour still running has no rollup yet, so it neither counts
    as held time nor stretches the period.
    """
    now = time.time() if now is None else float(now)
    first, closed_end = math.ceil((now - period_s) / HOUR) * HOUR, math.floor(now / HOUR) * HOUR
    hours = (closed_end - first) / HOUR
    days = hours / HOURS_PER_DAY if hours >= 1 else period_s / DAY
    teams = {team} if isinstance(team, str) else set(team or ())
    workflows: dict[str, float] = {}
    devices: dict[int, float] = {}
    # the hours not rolled up yet count as the rollup would count them (analyzer.period_rows): one basis either way
    rows = period_rows(store, now - period_s, now) if rows is None else rows  # `rows`: the caller read them already
    for scope, subject, wf_team, hours in zip(rows["scope"], rows["subject"], rows["team"], rows["gpu_hours_held"],
                                              strict=True):
        if scope == "workflow":
            if (team is None or wf_team in teams) and (workflow is None or subject == workflow):
                workflows[subject] = workflows.get(subject, 0.0) + float(hours) / days
        elif scope == "device":
            devices[int(subject)] = devices.get(int(subject), 0.0) + float(hours) / days
    with store.session() as session:
        gpus = {wid: int(n or 0) for wid, n in session.execute(select(Workflow.id, Workflow.gpus))}
        shares = {d: share for d, name, mem in session.execute(select(Device.id, Device.name, Device.memory_total))
                  if (share := share_of(name, mem)) < 1.0}
    return Held(workflows=workflows, devices=devices, period_s=period_s, gpus=gpus, shares=shares)
