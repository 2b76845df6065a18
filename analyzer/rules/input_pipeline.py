"""Rule: the step waits for the next batch from the DataLoader (input pipeline bound).

On a device it is judged and costed by the time the device stands idle while the host fetches the batch (the device
may be busy with queued work meanwhile: then the loader costs nothing); on a CPU-only trace, by the fetch itself.
That cost must reach [input_pipeline] dataloader_share_min and [common] material_cost_fraction of the step."""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.input_pipeline"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    dl = s["dataloader"]
    step_s = s["step_us_mean"] / 1e6
    loader_s = dl["us_per_step"] / 1e6
    idle_us = dl.get("device_idle_us_per_step") if s["has_gpu"] else None
    cost = loader_s if idle_us is None else idle_us / 1e6
    if (step_s <= 0 or cost / step_s < th["input_pipeline"]["dataloader_share_min"]
            or not is_material(cost, step_s, th)):
        return None
    worst = max(dl["per_step"], key=lambda r: r["dataloader_us"])
    api = device_api(s)
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=cost,
        evidence={"dataloader_share": round(dl["share"], 4), "dataloader_ms_per_step": round(loader_s * 1e3, 3),
                  "device_idle_during_loader_ms_per_step": round(idle_us / 1e3, 3) if idle_us is not None else None,
                  "step_ms": round(step_s * 1e3, 3), "calls": sum(r["calls"] for r in dl["per_step"]),
                  "threshold": th["input_pipeline"]["dataloader_share_min"]},
        title=f"DataLoader takes {dl['share']:.0%} of each step ({loader_s * 1e3:.1f} ms)"
              + (f"; the {api.device} waits {cost * 1e3:.1f} ms of it" if idle_us is not None else ""),
        location=steps_location(s, f"enumerate(DataLoader)#...__next__ spans; longest in step {worst['step']} "
                                   f"({worst['dataloader_us'] / 1e3:.1f} ms)"),
        fix=advice(api),
    )


def advice(api: DeviceApi) -> str:
    if api.kind == "cpu":
        return ("Prepare batches ahead of the step: DataLoader(num_workers=<spare cores>, persistent_workers=True, "
                "prefetch_factor=4), or pre-process the dataset offline.")
    offload = f" (e.g. {api.input_offload})" if api.input_offload else ""
    return (f"Prepare batches ahead of the {api.device}: DataLoader(num_workers=<cores per {api.device}>, "
            f"persistent_workers=True, prefetch_factor=4, pin_memory=True); move decoding/augmentation to the "
            f"{api.device}{offload} or pre-process the dataset offline.")
