"""Trace antipattern rules: one module per rule, thresholds in thresholds.toml, findings as FindingSpecs.

Each rule module has RULE (its name) and `check(summary, th) -> TraceFinding | None` over one rank's
summary (analyzer.traces.summary); set rules (straggler) have `check_set(summaries, th)`. What the rules
share lives in analyzer.rules.base, so the rule modules never import this package back.
"""

from __future__ import annotations

from typing import Any

from analyzer.rules import (
    comm_overlap,
    host_bound,
    input_pipeline,
    launch_bound,
    pageable_memcpy,
    straggler,
    sync_heavy,
    tensor_cores,
)
from analyzer.rules.base import (
    DEFAULT_THRESHOLDS,
    SECTIONS,
    TraceFinding,
    load_thresholds,
    severity_for,
    steps_location,
)

__all__ = ["DEFAULT_THRESHOLDS", "SECTIONS", "TraceFinding", "load_thresholds", "per_rank_rules", "run_rules",
           "run_set_rules", "severity_for", "steps_location"]


def per_rank_rules() -> list:
    """The per-rank rule modules, in the order their findings are reported."""
    return [host_bound, input_pipeline, launch_bound, pageable_memcpy, sync_heavy, tensor_cores, comm_overlap]


def run_rules(summary: dict[str, Any], th: dict[str, dict[str, float]] | None = None) -> list[TraceFinding]:
    """Every per-rank rule over one rank's summary; findings carry their severity."""
    th = th or load_thresholds()
    found = []
    for rule in per_rank_rules():
        f = rule.check(summary, th)
        if f is not None:
            f.severity = severity_for(f.cost_fraction, th)
            found.append(f)
    return found


def run_set_rules(summaries: list[dict[str, Any]], th: dict[str, dict[str, float]] | None = None) -> list[TraceFinding]:
    """Rules over the ranks of one job (straggler)."""
    th = th or load_thresholds()
    f = straggler.check_set(summaries, th)
    if f is None:
        return []
    f.severity = severity_for(f.cost_fraction, th)
    return [f]
