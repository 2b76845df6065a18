"""Rule: device-to-host copies into pageable memory: each one makes the CPU wait for the device (a hidden sync).

Reported when the device idle time after them is a material share of step time ([common] material_cost_fraction).
"""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, copy_calls, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.pageable_dtoh"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    rows = [r for r in s["memcpy"] if r["direction"] == "DtoH" and r["host_memory"] == "pageable"]
    count = sum(r["count"] for r in rows)
    if count < th["pageable_dtoh"]["min_copies"]:
        return None
    steps = max(s["n_steps"], 1)
    step_s = s["step_us_mean"] / 1e6
    copy_us = sum(r["total_us"] for r in rows)
    # the copy call returns only when the device has drained the stream up to it (the CPU blocks that long);
    # the device then idles until the CPU launches again: that idle time is what the hidden sync costs
    blocked_us = sum(r.get("cpu_call_us") or 0.0 for r in rows)
    idle_us = sum(r.get("idle_after_us") or 0.0 for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    cost = min(idle_us / steps / 1e6, step_s)
    if not is_material(cost, step_s, th):
        return None
    evidence = {
        "pageable_dtoh_copies": count,
        "pageable_dtoh_bytes": nbytes,
        "pageable_dtoh_copy_ms": round(copy_us / 1e3, 3),
        "cpu_blocked_ms": round(blocked_us / 1e3, 3),
        "cpu_blocked_ms_per_step": round(blocked_us / steps / 1e3, 3),
        "device_idle_after_ms": round(idle_us / 1e3, 3),
        "device_idle_after_ms_per_step": round(idle_us / steps / 1e3, 3),
        "copies_per_step": round(count / steps, 2),
        "steps": s["n_steps"],
    }
    first = min(r["first_ts_us"] for r in rows)
    api = device_api(s)
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=cost, evidence=evidence,
        title=f"{count} device-to-host copies into pageable memory ({nbytes / 2**10:.1f} KiB); each one blocks the "
              f"CPU until the device catches up ({blocked_us / steps / 1e3:.1f} ms per step), then the device waits "
              f"{idle_us / steps / 1e3:.1f} ms per step for new work",
        location=steps_location(s, f"'Memcpy DtoH (Device -> Pageable)' on the {api.device} "
                                   f"({copy_calls(s, rows)} on the CPU), first at {first / 1e3:.1f} ms"),
        fix=advice(api),
    )


def advice(api: DeviceApi) -> str:
    return ("Stop reading device results every step: keep losses/metrics on the device and read them every N steps "
            "(.item()/.cpu()/.tolist() each force this copy); when a result is needed, copy it into a pinned buffer "
            "(torch.empty(..., pin_memory=True); buf.copy_(t, non_blocking=True)) and read it after an event "
            f"({api.event} recorded after the copy, then its synchronize()) a step later.")
