"""What every trace rule shares: the thresholds file, the finding a rule returns, severity and location."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.errors import ConfigError
from store.findings import FindingSpec

DEFAULT_THRESHOLDS = Path(__file__).with_name("thresholds.toml")
SECTIONS = {
    "common": ["high_cost_fraction", "medium_cost_fraction", "consecutive_kernel_delay_us", "tiny_kernel_us",
               "material_cost_fraction"],
    "host_bound": ["idle_fraction_min"],
    "input_pipeline": ["dataloader_share_min"],
    "launch_bound": ["tiny_share_min", "tiny_kernels_per_step_min", "launch_idle_fraction_min"],
    "pageable_memcpy": ["min_copies", "pinned_speedup"],
    "pageable_dtoh": ["min_copies"],
    "sync_heavy": ["calls_per_step_min", "blocked_fraction_min"],
    "tensor_cores": ["matmul_share_min", "non_tc_fraction_min", "amp_speedup"],
    "comm_overlap": ["exposed_fraction_min", "overlap_ratio_max"],
    "straggler": ["excess_min"],
    "tiny_steps": ["step_ms_max", "arithmetic_share_max", "overhead_share_min"],
}


def load_thresholds(path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """Read and check the thresholds file (the packaged one by default)."""
    p = Path(path) if path else DEFAULT_THRESHOLDS
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"trace rule thresholds {p} cannot be read: {exc}") from None
    for section, keys in SECTIONS.items():
        for key in keys:
            value = data.get(section, {}).get(key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"trace rule thresholds {p}: [{section}] {key} must be a number")
    return data


@dataclass
class TraceFinding:
    """What one rule found in one rank (or one set of ranks), before it is tied to a workflow."""

    rule: str
    title: str
    fix: str
    evidence: dict[str, Any]
    location: str
    cost_s_per_step: float
    step_s: float
    subject: str
    severity: str = "low"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cost_fraction(self) -> float:
        return min(1.0, self.cost_s_per_step / self.step_s) if self.step_s > 0 else 0.0

    def gpu_hours_per_day(self, gpus: int = 1) -> float:
        """Projected: GPU time this costs if the job runs all day at its GPU count.

        Totals never use this figure: analyzer.waste costs a finding by the GPU-hours its workflow really held.
        """
        return self.cost_fraction * max(gpus, 1) * 24.0

    def as_dict(self, gpus: int = 1) -> dict[str, Any]:
        return {"rule": self.rule, "severity": self.severity, "title": self.title, "subject": self.subject,
                "evidence": self.evidence, "location": self.location, "cost_s_per_step": self.cost_s_per_step,
                "cost_fraction": self.cost_fraction, "gpu_hours_per_day": self.gpu_hours_per_day(gpus),
                "fix": self.fix}

    def to_spec(self, workflow_id: str, gpus: int = 1, trace_id: int | None = None) -> FindingSpec:
        # cost_fraction and gpus are what analyzer.waste needs to cost this on the held GPU-hours
        evidence = dict(self.evidence, cost_fraction=round(self.cost_fraction, 4), gpus=gpus, subject=self.subject)
        return FindingSpec(rule=self.rule, workflow_id=workflow_id, source="trace", severity=self.severity,
                           title=self.title, fix=self.fix, evidence=evidence, location=self.location,
                           cost_s_per_step=self.cost_s_per_step, gpu_hours_per_day=self.gpu_hours_per_day(gpus),
                           trace_id=trace_id, subject=self.subject)


def is_material(cost_s_per_step: float, step_s: float, th: dict[str, dict[str, float]]) -> bool:
    """Whether a cost is worth a finding: at least [common] material_cost_fraction of step time."""
    return step_s > 0 and cost_s_per_step / step_s >= th["common"]["material_cost_fraction"]


def severity_for(cost_fraction: float, th: dict[str, dict[str, float]]) -> str:
    if cost_fraction >= th["common"]["high_cost_fraction"]:
        return "high"
    if cost_fraction >= th["common"]["medium_cost_fraction"]:
        return "medium"
    return "low"


def steps_location(summary: dict[str, Any], extra: str = "") -> str:
    """Where to look: rank, step range and its time range from the trace start."""
    steps = summary["steps"]
    first, last = steps[0], steps[-1]
    names = first["name"] if len(steps) == 1 else f"{first['name']}..{last['name']}"
    loc = (f"rank {summary['rank']} ({Path(summary['path']).name}), {names}, "
           f"ts {first['start_ms']:.1f}-{last['end_ms']:.1f} ms from trace start")
    return f"{loc}; {extra}" if extra else loc


def copy_calls(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The copy calls on the CPU that issued the copies of `rows` (summary["memcpy"] rows), as a location names them:
    joined to the copies by correlation id; a trace whose copies carry no ids (or a summary from before the join)
    names every copy call it has, and "the copy call" when it has none (or none read matches the copies' ids)."""
    named = [r.get("calls") for r in rows]
    if any(calls is not None for calls in named):
        issued = sorted({c for calls in named for c in calls or []})
    else:
        issued = summary.get("memcpy_calls") or []
    return " / ".join(issued) or "the copy call"
