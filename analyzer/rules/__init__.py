"""Trace antipattern rules: one module per rule, thresholds in thresholds.toml, findings as FindingSpecs.

Each rule module has RULE (its name), `check(summary, th) -> TraceFinding | None` over one rank's
summary (analyzer.traces.summary) and `advice(api)`, its fix in the words of a device's API
(analyzer.rules.devices); set rules (straggler) have `check_set(summaries, th)`. A finding is returned only when
its cost is a material share of step time (`is_material`, [common] material_cost_fraction). What the rules
share lives in analyzer.rules.base, so the rule modules never import this package back. A rule that cannot
judge a trace (no kernel timeline, CPU only, ...) is not run on it; `rules_not_judged` says why.
"""

from __future__ import annotations

from typing import Any

from analyzer.rules import (
    comm_overlap,
    host_bound,
    input_pipeline,
    launch_bound,
    pageable_dtoh,
    pageable_memcpy,
    straggler,
    sync_heavy,
    tensor_cores,
    tiny_steps,
)
from analyzer.rules.base import (
    DEFAULT_THRESHOLDS,
    SECTIONS,
    TraceFinding,
    load_thresholds,
    severity_for,
    steps_location,
)
from analyzer.rules.devices import not_judged
from analyzer.rules.idle_share import share_idle

__all__ = ["DEFAULT_THRESHOLDS", "SECTIONS", "TraceFinding", "load_thresholds", "per_rank_rules", "rules_not_judged",
           "run_rules", "run_set_rules", "severity_for", "steps_location"]


def per_rank_rules() -> list:
    """The per-rank rule modules, in the order their findings are reported."""
    return [host_bound, input_pipeline, launch_bound, pageable_memcpy, pageable_dtoh, sync_heavy, tensor_cores,
            comm_overlap, tiny_steps]


def run_rules(summary: dict[str, Any], th: dict[str, dict[str, float]] | None = None) -> list[TraceFinding]:
    """Every per-rank rule that can judge this rank's trace; findings carry their severity and advice in the words of
    the trace's device (analyzer.rules.devices.device_api).

    The rules that cannot judge it are in `rules_not_judged(summary)`, with the reason.
    """
    th = th or load_thresholds()
    skip = rules_not_judged(summary)
    found = []
    for rule in per_rank_rules():
        if rule.RULE in skip:
            continue
        f = rule.check(summary, th)
        if f is not None:
            found.append(f)
    found = share_idle(summary, found, th)  # an idle second is costed once, by the finding that names its cause
    for f in found:
        f.severity = severity_for(f.cost_fraction, th)
    return found


def rules_not_judged(summary: dict[str, Any]) -> dict[str, str]:
    """Per-rank rules that cannot judge this trace, each with why (no kernel timeline, CPU only, ...)."""
    return not_judged(summary, [r.RULE for r in per_rank_rules()])


def run_set_rules(summaries: list[dict[str, Any]], th: dict[str, dict[str, float]] | None = None) -> list[TraceFinding]:
    """Rules over the ranks of one job (straggler)."""
    th = th or load_thresholds()
    f = straggler.check_set(summaries, th)
    if f is None:
        return []
    f.severity = severity_for(f.cost_fraction, th)
    return [f]
