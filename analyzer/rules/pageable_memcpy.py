"""Rule: host-to-device copies from pageable memory (slow, and they serialise with the CPU).

Reported when pinning them would save a material share of step time ([common] material_cost_fraction), not for
any one copy. The other direction, device to pageable host memory, is its own rule (pageable_dtoh).
"""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, copy_calls, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.pageable_memcpy"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    rows = [r for r in s["memcpy"] if r["direction"] == "HtoD" and r["host_memory"] == "pageable"]
    count = sum(r["count"] for r in rows)
    if count < th["pageable_memcpy"]["min_copies"]:
        return None
    pinned = [r for r in s["memcpy"] if r["direction"] == "HtoD" and r["host_memory"] == "pinned"]
    total_us = sum(r["total_us"] for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    steps = max(s["n_steps"], 1)
    step_s = s["step_us_mean"] / 1e6
    # on the wall time the copies take inside the steps (side by side on several streams they count once)
    wall_us = sum(r.get("in_steps_us", r["total_us"]) for r in rows)
    cost = wall_us / steps / 1e6 * (1 - 1 / th["pageable_memcpy"]["pinned_speedup"])
    if not is_material(cost, step_s, th):
        return None
    evidence = {
        "pageable_htod_copies": count,
        "pageable_htod_bytes": nbytes,
        "pageable_htod_ms": round(total_us / 1e3, 3),
        "pageable_htod_gbps": round(nbytes / total_us / 1e3, 3) if total_us else None,
        "pinned_htod_copies": sum(r["count"] for r in pinned),
        "pinned_htod_gbps": (round(sum(r["bytes"] for r in pinned) / sum(r["total_us"] for r in pinned) / 1e3, 3)
                             if pinned and sum(r["total_us"] for r in pinned) else None),
        "steps": s["n_steps"],
    }
    first = min(r["first_ts_us"] for r in rows)
    api = device_api(s)
    # the calls that issued these copies (cudaMemcpyAsync, mtiaMemcpyAsync, ...), by correlation id
    calls = copy_calls(s, rows)
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=cost, evidence=evidence,
        title=f"{count} host-to-device copies from pageable memory ({nbytes / 2**20:.1f} MiB, "
              f"{total_us / 1e3:.1f} ms at {evidence['pageable_htod_gbps'] or 0:.1f} GB/s)",
        location=steps_location(s, f"'Memcpy HtoD (Pageable -> Device)' on the {api.device} ({calls} on the CPU), "
                                   f"first at {first / 1e3:.1f} ms"),
        fix=advice(api),
    )


def advice(api: DeviceApi) -> str:
    return ("Copy from pinned memory: DataLoader(pin_memory=True), or tensor.pin_memory() once for tensors reused "
            f"every step, then .to(device, non_blocking=True) so the copy overlaps the {api.device}'s compute.")
