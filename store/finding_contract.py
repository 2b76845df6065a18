"""The findings contract between the analyzer (writes findings) and the enforcer (reads them): the telemetry rules'
names and the evidence fields the planner relies on, typed.

A detector builds its evidence with the rule's model below and stores `as_json()` (the same keys, in the same
order, as the JSON column holds); the planner reads any finding's evidence back through `MoveEvidence`, whose
fields are all optional because stored rows (older ones, hand-made ones) may carry a subset. A telemetry finding the
analyzer resolved also carries `resolution` (its reason, and what showed it) until it is found again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any


class TelemetryRule(StrEnum):
    """The analyzer's telemetry rules (analyzer/telemetry/<rule>.py), as stored in findings.rule."""

    IDLE_HOLDER = "idle_holder"
    LOW_UTILIZATION = "low_utilization"
    MEMORY_OVERPROVISIONED = "memory_overprovisioned"
    MISLEADING_UTILIZATION = "misleading_utilization"
    ZOMBIE_MEMORY = "zombie_memory"


# the rules whose workflows are worth moving onto a shared device: the planner acts on these findings only
PLANNER_RULES: tuple[str, ...] = (TelemetryRule.IDLE_HOLDER.value, TelemetryRule.LOW_UTILIZATION.value,
                                  TelemetryRule.MEMORY_OVERPROVISIONED.value)


class _Evidence:
    def as_json(self) -> dict[str, Any]:
        """The evidence as the findings.evidence column stores it."""
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True, kw_only=True)
class IdleHolderEvidence(_Evidence):
    """idle_holder: a workflow holds device memory while the device is idle."""

    idle_hours: float | None
    idle_runs: int
    longest_idle_hours: float | None
    longest_idle_start: float | None
    longest_idle_end: float | None
    util_mean_while_idle: float | None
    util_threshold: float
    min_duration_s: float
    mem_held_gib: float | None
    held_hours: float | None
    window_hours: float | None


@dataclass(frozen=True, kw_only=True)
class LowUtilizationEvidence(_Evidence):
    """low_utilization: a workflow's p95 device utilisation stays under the threshold."""

    util_p95: float | None
    util_mean: float | None
    util_p95_threshold: float
    held_hours: float | None
    mem_peak_gib: float | None
    mem_total_gib: float | None
    share_needed: float | None
    window_hours: float | None


@dataclass(frozen=True, kw_only=True)
class MemoryOverprovisionedEvidence(_Evidence):
    """memory_overprovisioned: a workflow's peak memory is a small fraction of its device's."""

    mem_peak_gib: float | None
    mem_total_gib: float | None
    peak_fraction: float | None
    peak_fraction_max: float
    lane_gib: int
    jobs_per_device: int
    util_p95: float | None
    held_hours: float | None
    window_hours: float | None


@dataclass(frozen=True)
class MoveEvidence:
    """What the planner reads from a finding's evidence: the job's memory and utilisation as measured."""

    mem_peak_gib: float | None = None
    mem_held_gib: float | None = None
    util_p95: float | None = None
    util_mean_while_idle: float | None = None
    util_mean: float | None = None

    # utilisation fields from the most to the least telling: a p95 over the whole window beats a mean
    UTIL_FIELDS = ("util_p95", "util_mean_while_idle", "util_mean")

    @classmethod
    def from_json(cls, evidence: Mapping[str, Any] | None) -> MoveEvidence:
        evidence = evidence or {}
        return cls(**{f.name: evidence.get(f.name) for f in fields(cls)})

    @property
    def memory_gib(self) -> float | None:
        """The memory the job was seen to hold, GiB (its peak, else what it held while idle)."""
        return self.mem_peak_gib or self.mem_held_gib
