"""Rule: one rank of a multi-rank job is slower than the rest, and every collective waits for it.

In synchronous training every rank's step time ends up the same (the collectives wait for the slowest),
so the verdict compares how long each rank takes per step to reach its collectives: its step time less its
exposed communication (the time its device waits in a collective for the others). That is computation and memory
copies, and the idle time too: a rank slowed by its host (a slow input pipeline, CPU contention) is no busier on
its device, it launches late while the others wait in their collectives. CPU-only ranks are compared on step time;
summaries written before this measure existed, on busy device time. A straggler is reported when the others' wait for
it is a material share of its step time ([common] material_cost_fraction): [straggler] excess_min compares the ranks'
time outside exposed communication, which can be a small part of the step.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from analyzer.rules.base import TraceFinding, is_material
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.straggler"


def straggler_verdict(summaries: list[dict[str, Any]], threshold: float = 0.10) -> dict[str, Any] | None:
    """Compare the ranks of one job (trace summaries); None when fewer than two distinct ranks."""
    by_rank = {s["rank"]: s for s in summaries}
    if len(by_rank) < 2:
        return None
    metric = "step_us_mean"
    if all(s["has_gpu"] for s in by_rank.values()):
        metric = ("not_waiting_us_per_step" if all(s.get("not_waiting_us_per_step") is not None
                                                   for s in by_rank.values()) else "busy_us_per_step")
    values = {r: float(s[metric] or 0.0) for r, s in by_rank.items()}
    step_us = {r: float(s["step_us_mean"] or 0.0) for r, s in by_rank.items()}
    slowest = max(values, key=values.get)
    others = [v for r, v in values.items() if r != slowest]
    median_others = statistics.median(others)
    excess = (values[slowest] / median_others - 1.0) if median_others > 0 else 0.0
    return {
        "metric": metric,
        "ranks": sorted(by_rank),
        "per_rank_us": {str(r): values[r] for r in sorted(values)},
        "step_us_mean": {str(r): step_us[r] for r in sorted(step_us)},
        "slowest_rank": slowest,
        "median_others_us": median_others,
        "excess": excess,
        "threshold": threshold,
        "is_straggler": excess >= threshold,
        "cost_us_per_step": max(0.0, values[slowest] - median_others),
        "paths": {str(r): by_rank[r].get("path") for r in sorted(by_rank)},
    }


def check_set(summaries: list[dict[str, Any]], th: dict) -> TraceFinding | None:
    v = straggler_verdict(summaries, th["straggler"]["excess_min"])
    if v is None or not v["is_straggler"]:
        return None
    slow = str(v["slowest_rank"])
    step_s = v["step_us_mean"][slow] / 1e6
    if not is_material(v["cost_us_per_step"] / 1e6, step_s, th):
        return None
    return TraceFinding(
        rule=RULE, subject="ranks", step_s=step_s, cost_s_per_step=v["cost_us_per_step"] / 1e6,
        evidence={k: v[k] for k in ("metric", "per_rank_us", "step_us_mean", "slowest_rank", "median_others_us",
                                    "excess", "threshold")},
        title=f"Rank {slow} is a straggler: it takes {v['excess']:.0%} longer per step to reach its collectives than "
              f"the median of the other {len(v['ranks']) - 1} ranks, which wait "
              f"{v['cost_us_per_step'] / 1e3:.1f} ms per step for it",
        location=f"rank {slow} ({Path(v['paths'][slow] or '').name}); compare its time per step outside exposed "
                 f"communication with ranks {', '.join(str(r) for r in v['ranks'] if str(r) != slow)}",
        fix=advice(device_api(summaries[0])),
    )


def advice(api: DeviceApi) -> str:
    return ("Balance the work: check that rank's input shard sizes and sequence lengths, its host (CPU contention, "
            f"thermal throttling, a slower {api.device} or link), and uneven model partitioning; move it off a noisy "
            "host.")
