"""A second of idle device time is claimed by one finding: the rules that cost idle time share the step's idle.

The input pipeline, a readback into pageable memory, a sync that drains the queue, launch overhead and tiny steps
(on a device) each cost device time standing idle, and host_bound costs all of it. Summed as they were, one idle
second counted once per finding that names a cause for it, and twice with host_bound. Here the specific findings
keep their cost, scaled down together if they add up to more than the idle time, and host_bound keeps the idle time
none of them explains. A specific finding whose share, once scaled down, is no longer a material share of step time
([common] material_cost_fraction) is left out. When the idle time left to host_bound is not material, host_bound
is not reported: the findings that name the causes say what to change (tiny steps on a device, whose per-step
overhead is all of the idle time the input pipeline does not explain, always left it 0 ms).
"""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, is_material

HOST_BOUND = "trace.host_bound"
IDLE_RULES = ("trace.input_pipeline", "trace.pageable_dtoh", "trace.sync_heavy", "trace.launch_bound",
              "trace.tiny_steps")


def share_idle(summary: dict[str, Any], found: list[TraceFinding], th: dict[str, dict[str, float]]
               ) -> list[TraceFinding]:
    """The findings of one rank with idle-time costs that add up to at most its idle time (costs changed in place);
    host_bound left out when the idle time no other finding explains is not material."""
    idle = (summary.get("fractions") or {}).get("idle")
    if not summary.get("has_gpu") or idle is None:
        return found  # CPU only: no device idle time; the findings cost host time, each its own
    idle_s = idle * summary["step_us_mean"] / 1e6
    specific = [f for f in found if f.rule in IDLE_RULES]
    claimed = sum(f.cost_s_per_step for f in specific)
    if claimed > idle_s:
        scale = idle_s / claimed if claimed > 0 else 0.0
        for f in specific:
            f.evidence["cost_ms_per_step_before_sharing_idle"] = round(f.cost_s_per_step * 1e3, 3)
            f.cost_s_per_step *= scale
        # a finding whose share of the idle time is no longer material is left out; the others explain the idle
        dropped = [id(f) for f in specific if not is_material(f.cost_s_per_step, f.step_s, th)]
        found = [f for f in found if id(f) not in dropped]
        specific = [f for f in specific if id(f) not in dropped]
    host = next((f for f in found if f.rule == HOST_BOUND), None)
    if host is None:
        return found
    explained = min(sum(f.cost_s_per_step for f in specific), idle_s)  # an idle share left out is host_bound's
    host.cost_s_per_step = max(0.0, idle_s - explained)
    if not is_material(host.cost_s_per_step, host.step_s, th):
        return [f for f in found if f is not host]
    host.evidence["idle_ms_per_step_explained_by"] = {f.rule: round(f.cost_s_per_step * 1e3, 3) for f in specific}
    host.evidence["unexplained_idle_ms_per_step"] = round(host.cost_s_per_step * 1e3, 3)
    if specific and explained > 0:
        host.title += (f"; {explained * 1e3:.1f} ms of it is costed by the findings that name its cause "
                       f"({', '.join(f.rule.removeprefix('trace.') for f in specific)})")
    return found
