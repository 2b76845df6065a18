"""Rule: the step waits for the next batch from the DataLoader (input pipeline bound)."""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, steps_location

RULE = "trace.input_pipeline"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    dl = s["dataloader"]
    if dl["share"] < th["input_pipeline"]["dataloader_share_min"]:
        return None
    step_s = s["step_us_mean"] / 1e6
    cost = dl["us_per_step"] / 1e6
    worst = max(dl["per_step"], key=lambda r: r["dataloader_us"])
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=cost,
        evidence={"dataloader_share": round(dl["share"], 4), "dataloader_ms_per_step": round(cost * 1e3, 3),
                  "step_ms": round(step_s * 1e3, 3), "calls": sum(r["calls"] for r in dl["per_step"]),
                  "threshold": th["input_pipeline"]["dataloader_share_min"]},
        title=f"DataLoader takes {dl['share']:.0%} of each step ({cost * 1e3:.1f} ms)",
        location=steps_location(s, f"enumerate(DataLoader)#...__next__ spans; longest in step {worst['step']} "
                                   f"({worst['dataloader_us'] / 1e3:.1f} ms)"),
        fix="Prepare batches ahead of the GPU: DataLoader(num_workers=<cores per GPU>, persistent_workers=True, "
            "prefetch_factor=4, pin_memory=True); move decoding/augmentation to the GPU (e.g. DALI) or "
            "pre-process the dataset offline.",
    )
