"""What the `nvml` source keeps per device (a whole GPU or a MIG device), and how it sorts NVML's answers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from collector.sources.base import DeviceInfo

# errors that say the metric will never be readable on this device: stop asking
PERMANENT = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch")
# answers that say a handle no longer names a device (a MIG instance destroyed, a GPU reset): enumerate again
STALE = ("NVMLError_InvalidArgument", "NVMLError_NotFound")
MIG_INDEX_BASE = 1000
# newest first; the unversioned name is tried last: in nvidia-ml-py 12+ it is v3 behind a version check
PROCESS_CALLS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                 "nvmlDeviceGetComputeRunningProcesses")


class Lost(Exception):
    """The GPU fell off the bus while we read it."""


def as_fraction(percent: float | None) -> float | None:
    """A percentage as a fraction 0..1; None for none, and for NaN or infinity (a GPM rate over no time): NaN went
    through min and max unchanged, and a batch holding it could not be spooled."""
    if percent is None or not math.isfinite(float(percent)):
        return None
    return min(max(float(percent) / 100.0, 0.0), 1.0)


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class NvmlDevice:
    """One device the source samples: a whole GPU, or one MIG device of a GPU in MIG mode."""

    index: int
    handle: Any  # None: no handle could be had (sampled as lost)
    physical: int  # the NVML index of the GPU it is (or is a slice of)
    parent: Any = None  # the parent GPU's handle, for a MIG device
    gpu_instance: int | None = None  # MIG: the GPU instance id (GPM reads per GPU instance)
    info: DeviceInfo | None = None
    unsupported: set[str] = field(default_factory=set)
    proc_ts: int = 0  # last process-utilisation timestamp seen (µs)
    gpm: list[Any] | None = None
    xids: int | None = None
    memory_api: str | None = None  # "v2" | "v1", once known
    process_call: str | None = None  # the running-processes call this driver answers
