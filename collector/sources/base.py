"""The one interface every device source implements, and the readings it returns.

A reading's metrics are the sample row's (store.samples); one is None when the device could not report it:
missing, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from store.errors import ConfigError
from store.samples import DeviceMetrics, ProcessMetrics


class SourceUnavailable(ConfigError):
    """The configured device source cannot run on this machine (no NVIDIA driver, no recording...)."""


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    memory_total: int | None
    cpu_cores: tuple[int, ...] | None = None  # cpu source only
    parent_uuid: str | None = None  # a MIG device: the GPU it is a slice of (nvml source)
    slice_weight: float | None = None  # a MIG device: its share of that GPU, 0..1 (what its held hours weigh)


@dataclass
class ProcessReading(ProcessMetrics):
    """One process on a device: its pid and the process metrics (mem_used, sm_util, cpu_util), all keywords."""

    pid: int
    # Set by sources that know the workflow without looking at /proc (replay); otherwise the agent
    # attributes the pid with collector.attribution.
    workflow_id: str | None = None
    id_source: str | None = None
    start_time: float | None = None  # process start (epoch s), when the source knows it


@dataclass
class DeviceReading(DeviceMetrics):
    """One device at one time: the device metrics (gpu_util, mem_used, ...: DEVICE_METRICS), all keywords."""

    index: int
    ts: float
    lost: bool = False  # the device fell off the bus; the agent marks it and carries on
    processes: list[ProcessReading] = field(default_factory=list)


class DeviceSource(Protocol):
    """What the agent samples. `sample()` never raises for one bad metric or one vanished process."""

    name: str  # "nvml" | "cpu" | "replay"

    def devices(self) -> list[DeviceInfo]: ...

    def sample(self) -> list[DeviceReading]: ...

    def close(self) -> None: ...
