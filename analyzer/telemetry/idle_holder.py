"""Idle holder: a workflow holds memory on a device while its utilisation stays near zero for 30 minutes or more."""

from __future__ import annotations

from analyzer.telemetry.common import KEYS, gib, held_stats, lane_gib, num, runs
from analyzer.telemetry.frame import TelemetryWindow, fmt_window
from analyzer.telemetry.thresholds import Thresholds
from store.finding_contract import IdleHolderEvidence, TelemetryRule
from store.findings import FindingSpec

RULE = TelemetryRule.IDLE_HOLDER.value


def find(window: TelemetryWindow, th: Thresholds) -> list[FindingSpec]:
    t = th.idle_holder
    usage = window.usage
    if usage.empty:
        return []
    idle = usage["held"] & usage["gpu_util"].notna() & (usage["gpu_util"] <= t.util_max)
    found = runs(usage, idle, KEYS)  # usage is sorted by (workflow, device, ts)
    found = found[found["duration_s"] >= t.min_duration_s]
    if found.empty:
        return []
    # the GPU-time an idle run costs is the device's share the workflow held during it
    share = usage.loc[idle].groupby(KEYS, sort=False)["share"].mean()
    stats = held_stats(window)
    specs = []
    for (wf, dev), group in found.groupby(KEYS, sort=False):
        idle_s = float(group["duration_s"].sum())
        longest = group.loc[group["duration_s"].idxmax()]
        gpu_s = idle_s * float(share.get((wf, dev), 1.0))
        per_day = window.per_day(gpu_s)
        st = stats.loc[(wf, dev)] if (wf, dev) in stats.index else None
        mem = float(group["mem_max"].max()) if "mem_max" in group and group["mem_max"].notna().any() else None
        lane = lane_gib(mem, th.memory_overprovisioned.lane_headroom) if mem else None
        held_s = float(st["held_s"]) if st is not None else idle_s
        specs.append(FindingSpec(
            rule=RULE, workflow_id=str(wf), source="telemetry", severity=th.severity(per_day),
            title=(f"holds {gib(mem) or '?'} GiB on {window.device_short(int(dev))} while idle "
                   f"{idle_s / 3600:.1f} h ({idle_s / max(held_s, 1.0):.0%} of the time it held it)"),
            evidence=IdleHolderEvidence(
                idle_hours=num(idle_s / 3600), idle_runs=int(len(group)),
                longest_idle_hours=num(float(longest["duration_s"]) / 3600),
                longest_idle_start=num(float(longest["start"]), 1),
                longest_idle_end=num(float(longest["end"]), 1),
                util_mean_while_idle=num(float(group["util_mean"].mean()), 4),
                util_threshold=t.util_max, min_duration_s=t.min_duration_s,
                mem_held_gib=gib(mem), held_hours=num(held_s / 3600),
                window_hours=num(window.span_s / 3600),
            ).as_json(),
            location=(f"{window.device_label(int(dev))}, longest idle run "
                      f"{fmt_window(longest['start'], longest['end'])}"),
            gpu_hours_per_day=round(per_day, 3),
            fix=(f"release the GPU while idle: stop or checkpoint the job when it has no work, or let "
                 f"`fleetlens enforce` move it to a shared lane of {lane} GiB so the whole GPU comes free"
                 if lane else "release the GPU while idle: stop or checkpoint the job when it has no work"),
            device_id=int(dev), subject=f"device:{int(dev)}",
        ))
    return specs
