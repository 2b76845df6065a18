"""Memory over-provisioned: a workflow's peak memory stays below 25 % of its device's (a lane candidate).

This is also the trace rules' "memory far below the device's" candidate: the job would fit in a Salus
lane of peak x headroom, so several such jobs can share one GPU and the others come free.
"""

from __future__ import annotations

import math

from analyzer.telemetry.common import gib, lane_gib, num
from analyzer.telemetry.frame import fmt_window
from analyzer.telemetry.summary import WindowSummary
from analyzer.telemetry.thresholds import GIB, Thresholds
from store.finding_contract import MemoryOverprovisionedEvidence, TelemetryRule
from store.findings import FindingSpec

RULE = TelemetryRule.MEMORY_OVERPROVISIONED.value


def find(window: WindowSummary, th: Thresholds) -> list[FindingSpec]:
    t = th.memory_overprovisioned
    stats = window.stats
    if stats.empty:
        return []
    specs = []
    for (wf, dev), st in stats[stats["held_s"] >= t.min_held_s].to_dict("index").items():
        total = st["mem_total"] if st["mem_total"] == st["mem_total"] else window.device_total(int(dev))
        peak = st["mem_peak"]
        if not total or peak != peak or peak <= 0 or peak / total >= t.peak_fraction_max:
            continue
        lane = lane_gib(peak)
        lane_frac = min(1.0, lane * GIB / total)
        util = float(st["util_p95"]) if st["util_p95"] == st["util_p95"] else 0.0
        # in a lane it keeps its memory slice and its compute; the rest of the GPU goes to others
        per_day = window.per_day(float(st["gpu_s"]) * (1.0 - max(lane_frac, util)))
        fit = max(1, math.floor(total / (lane * GIB)))
        specs.append(FindingSpec(
            rule=RULE, workflow_id=str(wf), source="telemetry", severity=th.severity(per_day),
            title=(f"peak memory {gib(peak)} GiB is {peak / total:.0%} of {window.device_short(int(dev))}'s "
                   f"{gib(total)} GiB"),
            evidence=MemoryOverprovisionedEvidence(
                mem_peak_gib=gib(peak), mem_total_gib=gib(total), peak_fraction=num(peak / total, 4),
                peak_fraction_max=t.peak_fraction_max, lane_gib=lane, jobs_per_device=fit,
                util_p95=num(util, 4), held_hours=num(st["held_s"] / 3600),
                window_hours=num(window.span_s / 3600),
            ).as_json(),
            location=f"{window.device_label(int(dev))}, {fmt_window(st['first_ts'], st['last_ts'])}",
            gpu_hours_per_day=round(per_day, 3),
            fix=(f"move it to a lane of {lane} GiB with `fleetlens enforce` ({fit} such jobs fit on one "
                 f"{gib(total)} GiB device)"),
            device_id=int(dev), subject=f"device:{int(dev)}",
        ))
    return specs
