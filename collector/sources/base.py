"""The one interface every device source implements, and the readings it returns.

A reading's metric is None when the device could not report it: missing, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from store.errors import ConfigError


class SourceUnavailable(ConfigError):
    """The configured device source cannot run on this machine (no NVIDIA driver, no recording...)."""


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    memory_total: int | None
    cpu_cores: tuple[int, ...] | None = None  # cpu source only


@dataclass
class ProcessReading:
    pid: int
    mem_used: int | None = None
    sm_util: float | None = None
    cpu_util: float | None = None
    # Set by sources that know the workflow without looking at /proc (replay); otherwise the agent
    # attributes the pid with collector.attribution.
    workflow_id: str | None = None
    id_source: str | None = None
    start_time: float | None = None  # process start (epoch s), when the source knows it


@dataclass
class DeviceReading:
    index: int
    ts: float
    gpu_util: float | None = None
    mem_util: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: int | None = None
    xid_errors: int | None = None
    ecc_errors: int | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    lost: bool = False  # the device fell off the bus; the agent marks it and carries on
    processes: list[ProcessReading] = field(default_factory=list)


class DeviceSource(Protocol):
    """What the agent samples. `sample()` never raises for one bad metric or one vanished process."""

    name: str  # "nvml" | "cpu" | "replay"

    def devices(self) -> list[DeviceInfo]: ...

    def sample(self) -> list[DeviceReading]: ...

    def close(self) -> None: ...
