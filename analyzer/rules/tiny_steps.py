"""Rule: steps too small to be worth their fixed cost: per-step overhead (Python, dispatch, launches, the
optimizer's bookkeeping) takes most of each step and the arithmetic only a sliver.

Its cost is that overhead, at least [tiny_steps] overhead_share_min of the step, and never less than [common]
material_cost_fraction."""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.tiny_steps"
# a micro-benchmark: its one "step" is no training step ("GPU active span" in summaries stored before it was named
# for any device)
NOT_STEPS = ("whole trace", "device active span", "GPU active span")


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    ar, t = s.get("arithmetic"), th["tiny_steps"]
    if not ar or ar["share"] is None or not s["steps"] or s["steps"][0]["name"] in NOT_STEPS:
        return None
    step_s = s["step_us_mean"] / 1e6
    # waiting for the next batch is the input pipeline's finding, not per-step overhead (on a device: the device's idle
    # time during the fetch, as that rule counts it)
    dl = s["dataloader"]
    idle = dl.get("device_idle_us_per_step")
    loader = (idle / s["step_us_mean"] if ar["basis"] == "device" and idle is not None and s["step_us_mean"]
              else dl["share"] or 0.0)
    overhead = max(0.0, 1 - ar["share"] - loader)
    if (step_s * 1e3 > t["step_ms_max"] or ar["share"] > t["arithmetic_share_max"]
            or overhead < t["overhead_share_min"]):
        return None
    overhead_s = step_s * overhead
    if not is_material(overhead_s, step_s, th):  # with overhead_share_min below the material share
        return None
    where = "device busy time" if ar["basis"] == "device" else "time in matrix/convolution operators"
    ops = "kernels" if ar["basis"] == "device" else "matrix ops"
    evidence = {
        "step_ms": round(step_s * 1e3, 3),
        "arithmetic_share": round(ar["share"], 4),
        "arithmetic_ms_per_step": round(ar["us_per_step"] / 1e3, 4),
        "math_ops_per_step": round(ar["ops_per_step"], 1),
        "overhead_ms_per_step": round(overhead_s * 1e3, 3),
        "overhead_share": round(overhead, 4),
        "dataloader_share": round(loader, 4),
        "measured_as": where,
        "steps": s["n_steps"],
        "step_ms_max": t["step_ms_max"],
        "arithmetic_share_max": t["arithmetic_share_max"],
        "overhead_share_min": t["overhead_share_min"],
    }
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=overhead_s, evidence=evidence,
        title=f"Steps too small: {step_s * 1e3:.2f} ms per step, of which {ar['share']:.0%} is arithmetic "
              f"({ar['us_per_step']:.0f} us in {ar['ops_per_step']:.0f} {ops}); per-step overhead takes "
              f"{overhead:.0%}",
        location=steps_location(s, f"{where} against each step's wall time"),
        fix=advice(device_api(s)),
    )


def advice(api: DeviceApi) -> str:
    graph = f" (mode='reduce-overhead' replays the step as {api.graph})" if api.graph else ""
    return ("Do more work per step: raise the batch size (scale the learning rate with it) or accumulate several "
            f"micro-batches per optimizer step; fuse the small ops with torch.compile(model){graph} and use a fused "
            "optimizer (foreach=True).")
