"""Rule: the device (GPU, MTIA, ...) sits idle for much of each step (host bound): the CPU does not feed it fast
enough.

It fires on [host_bound] idle_fraction_min; its cost, the idle time no other finding explains, is gated on [common]
material_cost_fraction once the other findings have claimed theirs (analyzer.rules.idle_share)."""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.host_bound"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    fr = s["fractions"]
    if not s["has_gpu"] or fr["idle"] is None or fr["idle"] < th["host_bound"]["idle_fraction_min"]:
        return None
    step_s = s["step_us_mean"] / 1e6
    idle_s = fr["idle"] * step_s
    worst = max(s["breakdown"], key=lambda r: r["idle_us"] / r["step_us"] if r["step_us"] else 0)
    evidence = {
        "idle_fraction": round(fr["idle"], 4),
        "host_wait_fraction": round(fr["host_wait"], 4),
        "kernel_wait_fraction": round(fr["kernel_wait"], 4),
        "other_idle_fraction": round(fr["other_idle"], 4),
        "step_ms": round(s["step_us_mean"] / 1e3, 3),
        "idle_ms_per_step": round(idle_s * 1e3, 3),
        "steps": s["n_steps"],
        "threshold": th["host_bound"]["idle_fraction_min"],
    }
    cause = max(("host_wait", "kernel_wait", "other_idle"), key=lambda k: fr[k] or 0)
    api = device_api(s)
    device = api.device[:1].upper() + api.device[1:]  # "GPU", "MTIA device", "Device"
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=idle_s, evidence=evidence,
        title=f"{device} idle {fr['idle']:.0%} of each step ({idle_s * 1e3:.1f} ms of {step_s * 1e3:.1f} ms), "
              f"mostly {cause.replace('_', ' ')}",
        location=steps_location(s, f"most idle: step {worst['step']} ({worst['idle_us'] / 1e3:.1f} ms idle)"),
        fix=advice(api),
    )


def advice(api: DeviceApi) -> str:
    capture = (f"capture the step as {api.graph} or compile it with torch.compile" if api.graph
               else "compile the step with torch.compile")
    return ("Find what the CPU does between launches in the idle stretches (python overhead, data preparation, "
            "logging, synchronisation); move it off the training loop (DataLoader workers, async logging), "
            f"batch more work per launch, or {capture}; if the {api.device} cannot be kept busy, share it (a lane) "
            "with another job.")
