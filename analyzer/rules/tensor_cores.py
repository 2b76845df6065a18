"""Rule: matrix multiplies and convolutions run without tensor cores (TF32/AMP would apply).

Reported when what TF32/AMP would save on them is a material share of step time ([common] material_cost_fraction),
not on the share of matmul time off tensor cores alone (AlexNet's FP32 sgemm is 0.013 % of its benchmark's span)."""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.no_tensor_cores"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    tc, t = s["tensor_cores"], th["tensor_cores"]
    if not s["has_gpu"] or not tc["computation_us"] or not tc["matmul_us"]:
        return None
    non_tc = tc["matmul_without_tensor_cores_us"]
    non_tc_fraction = non_tc / tc["matmul_us"]
    if tc["matmul_share"] < t["matmul_share_min"] or non_tc_fraction < t["non_tc_fraction_min"]:
        return None
    step_s = s["step_us_mean"] / 1e6
    steps = max(s["n_steps"], 1)
    # on the wall time they take inside the steps, not their summed kernel time (side by side on several streams)
    wall = tc.get("matmul_without_tensor_cores_wall_us", non_tc)
    cost = wall / steps / 1e6 * (1 - 1 / t["amp_speedup"])
    if not is_material(cost, step_s, th):
        return None
    names = [k["name"] for k in tc["top_non_tc_matmul"][:3]]
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=cost,
        evidence={"matmul_share_of_compute": round(tc["matmul_share"], 4),
                  "matmul_without_tensor_cores_fraction": round(non_tc_fraction, 4),
                  "matmul_without_tensor_cores_ms": round(non_tc / 1e3, 3),
                  "tensor_core_share_of_compute": round(tc["tensor_core_share"] or 0.0, 4),
                  "top_kernels": tc["top_non_tc_matmul"][:3], "device": s["device"]},
        title=f"{non_tc_fraction:.0%} of matmul/conv time runs without tensor cores "
              f"(matmul/conv are {tc['matmul_share']:.0%} of compute)",
        location=steps_location(s, "kernels " + ", ".join(names)),
        fix=advice(device_api(s)),
    )


def advice(api: DeviceApi) -> str:
    if api.kind == "cuda":
        return ("Let matmuls use tensor cores: torch.backends.cuda.matmul.allow_tf32 = True and "
                "torch.backends.cudnn.allow_tf32 = True (or torch.set_float32_matmul_precision('high')), or train "
                "with torch.autocast('cuda', dtype=torch.bfloat16); keep matrix dimensions multiples of 8.")
    if api.kind == "rocm":
        return ("Let matmuls use the matrix cores (MFMA): train with torch.autocast('cuda', dtype=torch.bfloat16) "
                "(on ROCm 'cuda' is the AMD GPU), or torch.set_float32_matmul_precision('high') where the GPU has "
                "XF32 (MI300); keep matrix dimensions multiples of 16.")
    # not judged on other devices (analyzer.rules.devices): what applies wherever PyTorch runs
    return (f"Run matmuls in lower precision on the {api.device}: train with torch.autocast(<its device type>, "
            "dtype=torch.bfloat16) where it supports bfloat16.")
