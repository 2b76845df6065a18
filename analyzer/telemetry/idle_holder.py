"""Idle holder: a workflow holds memory on a device while its utilisation stays near zero for 30 minutes or more."""

from __future__ import annotations

import pandas as pd

from analyzer.telemetry.common import KEYS, gib, lane_gib, num
from analyzer.telemetry.frame import fmt_window
from analyzer.telemetry.summary import WindowSummary
from analyzer.telemetry.thresholds import Thresholds
from store.finding_contract import IdleHolderEvidence, TelemetryRule
from store.findings import FindingSpec

RULE = TelemetryRule.IDLE_HOLDER.value


def find(window: WindowSummary, th: Thresholds) -> list[FindingSpec]:
    found = window.idle_runs  # runs of held samples at or below th.idle_holder.util_max, long enough
    if found.empty:
        return []
    # per pair: its idle time, runs, longest run, and (from its statistics) the time it held the device and the
    # device's share it held while idle: the GPU-time an idle run costs
    longest = found.sort_values("duration_s", ascending=False, kind="stable").drop_duplicates(KEYS).set_index(KEYS)
    per_pair = (found.groupby(KEYS, sort=False)
                .agg(idle_s=("duration_s", "sum"), runs=("duration_s", "size"), util=("util_mean", "mean"),
                     mem=("mem_max", "max"))
                .join(longest[["duration_s", "start", "end"]].add_prefix("longest_"))
                .join(window.stats[["held_s", "idle_share"]]))
    specs = []
    for (wf, dev), r in per_pair.to_dict("index").items():
        idle_s = float(r["idle_s"])
        gpu_s = idle_s * (1.0 if pd.isna(r["idle_share"]) else float(r["idle_share"]))
        per_day = window.per_day(gpu_s)
        mem = None if pd.isna(r["mem"]) else float(r["mem"])
        lane = lane_gib(mem) if mem else None
        noun = window.device_words(int(dev)).device
        held_s = idle_s if pd.isna(r["held_s"]) else float(r["held_s"])
        specs.append(FindingSpec(
            rule=RULE, workflow_id=str(wf), source="telemetry", severity=th.severity(per_day),
            # without memory readings (no DCGM_FI_DEV_FB_USED imported) it is judged on utilisation alone, and
            # says so rather than print a size it does not know
            title=(f"holds {f'{gib(mem)} GiB on ' if mem is not None else ''}{window.device_short(int(dev))} while "
                   f"idle {idle_s / 3600:.1f} h ({idle_s / max(held_s, 1.0):.0%} of the time it held it)"
                   + ("" if mem is not None else "; how much memory it holds is not known (no memory readings)")),
            evidence=IdleHolderEvidence(
                idle_hours=num(idle_s / 3600), idle_runs=int(r["runs"]),
                longest_idle_hours=num(float(r["longest_duration_s"]) / 3600),
                longest_idle_start=num(float(r["longest_start"]), 1),
                longest_idle_end=num(float(r["longest_end"]), 1),
                util_mean_while_idle=num(float(r["util"]), 4),
                util_threshold=th.idle_holder.util_max, min_duration_s=th.idle_holder.min_duration_s,
                mem_held_gib=gib(mem), held_hours=num(held_s / 3600),
                window_hours=num(window.span_s / 3600),
            ).as_json(),
            location=(f"{window.device_label(int(dev))}, longest idle run "
                      f"{fmt_window(r['longest_start'], r['longest_end'])}"),
            gpu_hours_per_day=round(per_day, 3),
            fix=(f"release the {noun} while idle: stop or checkpoint the job when it has no work"
                 + (f", or let `fleetlens enforce` move it to a shared lane of {lane} GiB so the whole {noun} comes "
                    "free" if lane else "")),
            device_id=int(dev), subject=f"device:{int(dev)}",
        ))
    return specs
