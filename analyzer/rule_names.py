"""Every rule name the analyzer gives its findings: the telemetry detectors, the Slurm holder check, the trace rules
and the serving rules. `fleetlens findings --rule` checks a name against it, so a misspelt rule is told apart from a
rule with no findings."""

from __future__ import annotations

from analyzer import slurm_holders
from analyzer.rules import per_rank_rules, straggler
from analyzer.serving.rules import RULES as SERVING_RULES
from analyzer.telemetry import RULES as TELEMETRY_RULES


def rule_names() -> tuple[str, ...]:
    """The names, telemetry first, as `fleetlens findings` lists them."""
    return (*TELEMETRY_RULES, slurm_holders.RULE, *(rule.RULE for rule in per_rank_rules()), straggler.RULE,
            *SERVING_RULES)
