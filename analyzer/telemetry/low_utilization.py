"""Low utilisation: the p95 of a workflow's utilisation on a device stays below a threshold over the window."""

from __future__ import annotations

from analyzer.telemetry.common import gib, lane_gib, num
from analyzer.telemetry.frame import fmt_window
from analyzer.telemetry.summary import WindowSummary
from analyzer.telemetry.thresholds import Thresholds
from store.finding_contract import LowUtilizationEvidence, TelemetryRule
from store.findings import FindingSpec

RULE = TelemetryRule.LOW_UTILIZATION.value


def find(window: WindowSummary, th: Thresholds) -> list[FindingSpec]:
    t = th.low_utilization
    stats = window.stats
    if stats.empty:
        return []
    hits = stats[(stats["held_s"] >= t.min_held_s) & stats["util_p95"].notna() & (stats["util_p95"] < t.util_p95_max)]
    specs = []
    for (wf, dev), st in hits.to_dict("index").items():
        total = st["mem_total"] if st["mem_total"] == st["mem_total"] else window.device_total(int(dev))
        mem_frac = float(st["mem_peak"]) / total if total and st["mem_peak"] == st["mem_peak"] else 0.0
        # packed with others it would need its p95 of the compute and its peak of the memory
        need = min(1.0, max(float(st["util_p95"]), mem_frac))
        per_day = window.per_day(float(st["gpu_s"]) * (1.0 - need))
        lane = lane_gib(st["mem_peak"]) if mem_frac else None
        noun = window.device_words(int(dev)).device
        # no memory readings: the share it needs is judged on utilisation alone, and the title says so
        unknown = "" if st["mem_peak"] == st["mem_peak"] else "; its memory is not known (no memory readings)"
        specs.append(FindingSpec(
            rule=RULE, workflow_id=str(wf), source="telemetry", severity=th.severity(per_day),
            title=(f"p95 utilisation {st['util_p95']:.0%} (mean {st['util_mean']:.0%}) on "
                   f"{window.device_short(int(dev))} over {st['held_s'] / 3600:.1f} h{unknown}"),
            evidence=LowUtilizationEvidence(
                util_p95=num(st["util_p95"], 4), util_mean=num(st["util_mean"], 4),
                util_p95_threshold=t.util_p95_max, held_hours=num(st["held_s"] / 3600),
                mem_peak_gib=gib(st["mem_peak"]), mem_total_gib=gib(total),
                share_needed=num(need, 4), window_hours=num(window.span_s / 3600),
            ).as_json(),
            location=f"{window.device_label(int(dev))}, {fmt_window(st['first_ts'], st['last_ts'])}",
            gpu_hours_per_day=round(per_day, 3),
            fix=(f"share the {noun}: `fleetlens enforce` can pack it into a lane of {lane} GiB next to other jobs "
                 f"(it needs {need:.0%} of the {noun}); or give it more work per step (larger batch, "
                 f"more concurrent requests) or fewer {noun}s"
                 if lane else f"give it more work per step (larger batch, more concurrent requests) or fewer {noun}s"),
            device_id=int(dev), subject=f"device:{int(dev)}",
        ))
    return specs
