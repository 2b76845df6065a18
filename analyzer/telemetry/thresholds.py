"""The telemetry detectors' thresholds: thresholds.toml read into typed dataclasses, with clear errors."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from store.errors import ConfigError, InvalidInput

DEFAULT_PATH = Path(__file__).with_name("thresholds.toml")
GIB = 1 << 30


@dataclass(frozen=True)
class Common:
    window_s: float
    bucket_s: float
    held_min_gib: float
    max_gap_factor: float
    severity_high_gpu_hours: float
    severity_medium_gpu_hours: float

    @property
    def held_min_bytes(self) -> int:
        return int(self.held_min_gib * GIB)


@dataclass(frozen=True)
class IdleHolder:
    util_max: float
    min_duration_s: float


@dataclass(frozen=True)
class LowUtilization:
    util_p95_max: float
    min_held_s: float


@dataclass(frozen=True)
class MisleadingUtilization:
    util_min: float
    sm_active_max: float
    min_held_s: float


@dataclass(frozen=True)
class MemoryOverprovisioned:
    peak_fraction_max: float
    min_held_s: float


@dataclass(frozen=True)
class ZombieMemory:
    mem_min_gib: float
    min_duration_s: float

    @property
    def mem_min_bytes(self) -> int:
        return int(self.mem_min_gib * GIB)


@dataclass(frozen=True)
class Thresholds:
    common: Common
    idle_holder: IdleHolder
    low_utilization: LowUtilization
    misleading_utilization: MisleadingUtilization
    memory_overprovisioned: MemoryOverprovisioned
    zombie_memory: ZombieMemory

    def severity(self, gpu_hours_per_day: float) -> str:
        if gpu_hours_per_day >= self.common.severity_high_gpu_hours:
            return "high"
        if gpu_hours_per_day >= self.common.severity_medium_gpu_hours:
            return "medium"
        return "low"


def _section(cls: type, data: dict[str, Any], name: str, path: Path) -> Any:
    table = data.get(name)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: the table [{name}] is missing")
    values = {}
    for f in fields(cls):
        if f.name not in table:
            raise ConfigError(f"{path}: [{name}] has no {f.name!r}")
        value = table[f.name]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{path}: [{name}] {f.name} = {value!r} must be a number >= 0")
        values[f.name] = float(value)
    return cls(**values)


def scaled(th: Thresholds, time_factor: float) -> Thresholds:
    """The same thresholds with every duration (`*_s`) multiplied by `time_factor`: judging on compressed time."""
    if not time_factor > 0:
        raise InvalidInput(f"a time factor must be positive, not {time_factor}")
    sections = {}
    for f in fields(th):
        section = getattr(th, f.name)
        changes = {g.name: getattr(section, g.name) * time_factor for g in fields(section) if g.name.endswith("_s")}
        sections[f.name] = replace(section, **changes)
    return Thresholds(**sections)


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    """Read thresholds.toml (or another file of the same shape); a bad file raises ConfigError naming it."""
    path = Path(path) if path is not None else DEFAULT_PATH
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the thresholds file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the thresholds file {path} is not valid TOML: {exc}") from None
    return Thresholds(**{name: _section(cls, data, name, path) for name, cls in _TYPES.items()})


_TYPES: dict[str, type] = {
    "common": Common,
    "idle_holder": IdleHolder,
    "low_utilization": LowUtilization,
    "misleading_utilization": MisleadingUtilization,
    "memory_overprovisioned": MemoryOverprovisioned,
    "zombie_memory": ZombieMemory,
}
