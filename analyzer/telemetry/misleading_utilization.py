"""Misleading utilisation: utilisation looks high while few SMs are active (where SM activity is recorded).

NVML's utilisation says a kernel ran during the interval, not how much of the GPU it used; the GPM
metric sm_active says what fraction of SMs had a warp resident. High utilisation with low SM activity
means tiny kernels keep the GPU "busy" while most of it sits idle.
"""

from __future__ import annotations

from analyzer.telemetry.common import num
from analyzer.telemetry.frame import fmt_window
from analyzer.telemetry.summary import WindowSummary
from analyzer.telemetry.thresholds import Thresholds
from store.finding_contract import TelemetryRule
from store.findings import FindingSpec

RULE = TelemetryRule.MISLEADING_UTILIZATION.value


def find(window: WindowSummary, th: Thresholds) -> list[FindingSpec]:
    t = th.misleading_utilization
    stats = window.stats
    if stats.empty:
        return []
    hits = stats[
        (stats["held_s"] >= t.min_held_s) & (stats["sm_samples"] > 0)
        & (stats["util_mean"] >= t.util_min) & (stats["sm_active_mean"] <= t.sm_active_max)
    ]
    specs = []
    for (wf, dev), st in hits.to_dict("index").items():
        # the time utilisation overstates: the GPU counted busy while its SMs were not
        overstated = max(0.0, float(st["util_mean"]) - float(st["sm_active_mean"]))
        per_day = window.per_day(float(st["gpu_s"]) * overstated)
        words = window.device_words(int(dev))
        specs.append(FindingSpec(
            rule=RULE, workflow_id=str(wf), source="telemetry", severity=th.severity(per_day),
            title=(f"utilisation {st['util_mean']:.0%} but only {st['sm_active_mean']:.0%} of SMs active on "
                   f"{window.device_short(int(dev))}"),
            evidence={
                "util_mean": num(st["util_mean"], 4), "sm_active_mean": num(st["sm_active_mean"], 4),
                "util_min": t.util_min, "sm_active_max": t.sm_active_max, "sm_samples": int(st["sm_samples"]),
                "held_hours": num(st["held_s"] / 3600), "window_hours": num(window.span_s / 3600),
            },
            location=f"{window.device_label(int(dev))}, {fmt_window(st['first_ts'], st['last_ts'])}",
            gpu_hours_per_day=round(per_day, 3),
            fix=(f"{words.small_work}; capture a trace and run `fleetlens analyze` on it to see which {words.work}"),
            device_id=int(dev), subject=f"device:{int(dev)}",
        ))
    return specs
