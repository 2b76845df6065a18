"""Rule: one rank of a multi-rank job is slower than the rest, and every collective waits for it.

In synchronous training every rank's step time ends up the same (the collectives wait for the slowest),
so the verdict compares each rank's busy GPU time per step (computation + memory, i.e. not waiting in
communication); CPU-only ranks are compared on step time.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from analyzer.rules.base import TraceFinding

RULE = "trace.straggler"


def straggler_verdict(summaries: list[dict[str, Any]], threshold: float = 0.10) -> dict[str, Any] | None:
    """Compare the ranks of one job (trace summaries); None when fewer than two distinct ranks."""
    by_rank = {s["rank"]: s for s in summaries}
    if len(by_rank) < 2:
        return None
    metric = "busy_us_per_step" if all(s["has_gpu"] for s in by_rank.values()) else "step_us_mean"
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
    return TraceFinding(
        rule=RULE, subject="ranks", step_s=step_s, cost_s_per_step=v["cost_us_per_step"] / 1e6,
        evidence={k: v[k] for k in ("metric", "per_rank_us", "step_us_mean", "slowest_rank", "median_others_us",
                                    "excess", "threshold")},
        title=f"Rank {slow} is a straggler: {v['excess']:.0%} more work per step than the median of the "
              f"other {len(v['ranks']) - 1} ranks",
        location=f"rank {slow} ({Path(v['paths'][slow] or '').name}); compare its busy time per step "
                 f"with ranks {', '.join(str(r) for r in v['ranks'] if str(r) != slow)}",
        fix="Balance the work: check that rank's input shard sizes and sequence lengths, its host (CPU "
            "contention, thermal throttling, a slower GPU or link), and uneven model partitioning; move it off "
            "a noisy host.",
    )
