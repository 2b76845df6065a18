"""Rule: many tiny kernels whose launch cost leaves the GPU waiting (launch bound)."""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, steps_location

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
    # what launching the tiny kernels costs, bounded by the idle time the GPU spends waiting for launches
    launch_cost = la["tiny_kernels_per_step"] * (la["launch_cpu_mean_us"] or 0) / 1e6
    cost = min(launch_cost, launch_idle * step_s)
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=cost,
        evidence={"kernels_per_step": round(la["kernels_per_step"], 1),
                  "tiny_kernels_per_step": round(la["tiny_kernels_per_step"], 1),
                  "tiny_share": round(la["tiny_share"], 4), "tiny_kernel_us": la["tiny_kernel_us"],
                  "kernel_median_us": la["kernel_median_us"], "launch_cpu_mean_us": la["launch_cpu_mean_us"],
                  "launch_wait_fraction": round(launch_idle, 4), "launch_apis": la["launch_names"],
                  "step_ms": round(step_s * 1e3, 3)},
        title=f"Launch bound: {la['tiny_kernels_per_step']:.0f} kernels per step run under "
              f"{la['tiny_kernel_us']:.0f} us ({la['tiny_share']:.0%} of kernels), GPU waits for launches "
              f"{launch_idle:.0%} of the step",
        location=steps_location(s, f"kernels under {la['tiny_kernel_us']:.0f} us launched by "
                                   + "/".join(la["launch_names"])),
        fix="Fuse the small ops: torch.compile(model) (or mode='reduce-overhead' to replay the step as a CUDA "
            "graph), use fused optimizers (foreach=True / fused=True) and fused layers, and grow the batch "
            "so each kernel does more work.",
    )
