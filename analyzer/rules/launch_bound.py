"""Rule: many tiny kernels whose launch cost leaves the device waiting (launch bound).

Reported when launching the tiny kernels costs a material share of step time ([common] material_cost_fraction), not
on the share of idle time spent waiting for launches alone: most of that wait can have another cause (on the 2-rank
NCCL trace the launches cost 1.5 % of the step while the GPU waits 75 % of it).
"""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.launch_bound"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    la, fr, t = s["launch"], s["fractions"], th["launch_bound"]
    if not s["has_gpu"] or fr["idle"] is None:
        return None
    launch_idle = (fr["host_wait"] or 0) + (fr["kernel_wait"] or 0)
    if (la["tiny_share"] < t["tiny_share_min"] or la["tiny_kernels_per_step"] < t["tiny_kernels_per_step_min"]
            or launch_idle < t["launch_idle_fraction_min"]):
        return None
    step_s = s["step_us_mean"] / 1e6
    api = device_api(s)
    # what launching the tiny kernels costs, bounded by the idle time the device spends waiting for launches
    launch_cost = la["tiny_kernels_per_step"] * (la["launch_cpu_mean_us"] or 0) / 1e6
    cost = min(launch_cost, launch_idle * step_s)
    if not is_material(cost, step_s, th):
        return None
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=cost,
        evidence={"kernels_per_step": round(la["kernels_per_step"], 1),
                  "tiny_kernels_per_step": round(la["tiny_kernels_per_step"], 1),
                  "tiny_share": round(la["tiny_share"], 4), "tiny_kernel_us": la["tiny_kernel_us"],
                  "kernel_median_us": la["kernel_median_us"], "launch_cpu_mean_us": la["launch_cpu_mean_us"],
                  "launch_wait_fraction": round(launch_idle, 4), "launch_apis": la["launch_names"],
                  "step_ms": round(step_s * 1e3, 3)},
        title=f"Launch bound: {la['tiny_kernels_per_step']:.0f} kernels per step run under "
              f"{la['tiny_kernel_us']:.0f} us ({la['tiny_share']:.0%} of kernels), the {api.device} waits for launches "
              f"{launch_idle:.0%} of the step",
        location=steps_location(s, f"kernels under {la['tiny_kernel_us']:.0f} us launched by "
                                   + "/".join(la["launch_names"])),
        fix=advice(api),
    )


def advice(api: DeviceApi) -> str:
    graph = f" (or mode='reduce-overhead' to replay the step as {api.graph})" if api.graph else ""
    return (f"Fuse the small ops: torch.compile(model){graph}, use fused optimizers (foreach=True / fused=True) and "
            "fused layers, and grow the batch so each kernel does more work.")
