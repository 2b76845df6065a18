"""A second of idle device time is claimed by one finding: the rules that cost idle time share the step's idle.

The input pipeline, a readback into pageable memory, a sync that drains the queue, launch overhead and tiny steps
(on a device) each cost device time standing idle, and host_bound costs all of it. Summed as they were, one idle
second counted once per finding that names a cause for it, and twice with host_bound. Here the specific findings
keep their cost, scaled down together if they add up to more than the idle time, and host_bound keeps the idle time
none of them explains. When that is not a material share of step time ([common] material_cost_fraction), host_bound
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
    host = next((f for f in found if f.rule == HOST_BOUND), None)
    if host is None:
        return found
    explained = min(claimed, idle_s)
    host.cost_s_per_step = max(0.0, idle_s - explained)
    if not is_material(host.cost_s_per_step, host.step_s, th):
        return [f for f in found if f is not host]
    host.evidence["idle_ms_per_step_explained_by"] = {f.rule: round(f.cost_s_per_step * 1e3, 3) for f in specific}
    host.evidence["unexplained_idle_ms_per_step"] = round(host.cost_s_per_step * 1e3, 3)
    if specific and explained > 0:
        host.title += (f"; {explained * 1e3:.1f} ms of it is costed by the findings that name its cause "
                       f"({', '.join(f.rule.removeprefix('trace.') for f in specific)})")
    return found
