"""Rule: one rank of a multi-rank job is slower than the rest, and every collective waits for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analyzer.rules import TraceFinding
from analyzer.traces.straggler import straggler_verdict

RULE = "trace.straggler"


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
