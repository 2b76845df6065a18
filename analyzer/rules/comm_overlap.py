"""Rule: communication kernels are not hidden under computation (poor overlap).

Its cost is the exposed communication: at least [comm_overlap] exposed_fraction_min of the step and never less than
[common] material_cost_fraction."""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.comm_overlap"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    ov, t = s["overlap"], th["comm_overlap"]
    if ov["overlap_ratio"] is None:
        return None
    step_s = s["step_us_mean"] / 1e6
    steps = max(s["n_steps"], 1)
    exposed_s = ov["exposed_communication_us"] / steps / 1e6
    exposed_fraction = exposed_s / step_s if step_s else 0.0
    if (ov["overlap_ratio"] > t["overlap_ratio_max"] or exposed_fraction < t["exposed_fraction_min"]
            or not is_material(exposed_s, step_s, th)):
        return None
    names = [k["name"].split("(")[0] for k in ov["top_comm_kernels"][:3]]
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=exposed_s,
        evidence={"overlap_ratio": round(ov["overlap_ratio"], 4),
                  "communication_ms_per_step": round(ov["communication_us"] / steps / 1e3, 3),
                  "exposed_communication_ms_per_step": round(exposed_s * 1e3, 3),
                  "exposed_fraction": round(exposed_fraction, 4), "top_comm_kernels": ov["top_comm_kernels"][:3]},
        title=f"Only {ov['overlap_ratio']:.0%} of communication overlaps computation; "
              f"{exposed_s * 1e3:.1f} ms per step of exposed communication",
        location=steps_location(s, "kernels " + ", ".join(names)),
        fix=advice(device_api(s)),
    )


def advice(api: DeviceApi) -> str:
    return ("Overlap collectives with compute: with DDP tune bucket_cap_mb and keep gradient_as_bucket_view=True, "
            "use no_sync() during gradient accumulation; with FSDP enable forward/backward prefetch; avoid "
            f"syncs between backward and the optimizer step; {api.collectives_debug} if collectives are slow.")
