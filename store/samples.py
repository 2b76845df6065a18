"""The sample row: the one definition of what a device sample and a process sample hold, in column order.

Everything that carries samples derives its fields from these two rows: the device sources' readings
(the metrics), the agent's batches and spool, bulk ingestion (column order), replay and export. The tables
in store.models have the same columns in the same order (tests/store/test_ingest.py holds them together).

The fields with a default are the metrics: None when the device could not report it, missing, never 0.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import NamedTuple, get_type_hints


class DeviceSampleRow(NamedTuple):
    """One row of device_samples; fractions 0..1, bytes, watts, degrees Celsius, MHz."""

    device_id: int
    ts: float
    gpu_util: float | None = None  # fraction of time a kernel ran
    mem_util: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: int | None = None
    xid_errors: int | None = None
    ecc_errors: int | None = None
    sm_active: float | None = None  # GPM: fraction of SMs with a warp resident
    sm_occupancy: float | None = None
    tensor_active: float | None = None


class ProcessSampleRow(NamedTuple):
    """One row of process_samples: what one process used of one device."""

    device_id: int
    workflow_id: str
    host_id: str
    pid: int
    ts: float
    mem_used: int | None = None
    sm_util: float | None = None
    cpu_util: float | None = None  # cpu source: fraction of the device's cores


DEVICE_SAMPLE_COLUMNS: tuple[str, ...] = DeviceSampleRow._fields
PROCESS_SAMPLE_COLUMNS: tuple[str, ...] = ProcessSampleRow._fields
DEVICE_METRICS: tuple[str, ...] = tuple(DeviceSampleRow._field_defaults)
PROCESS_METRICS: tuple[str, ...] = tuple(ProcessSampleRow._field_defaults)


def _integers(row: type[NamedTuple]) -> frozenset[str]:
    hints = get_type_hints(row)
    return frozenset(name for name in row._field_defaults if hints[name] == int | None)


INT_METRICS: frozenset[str] = _integers(DeviceSampleRow) | _integers(ProcessSampleRow)


def _metrics_class(name: str, row: type[NamedTuple], doc: str) -> type:
    hints = get_type_hints(row)
    cls = make_dataclass(name, [(f, hints[f], field(default=None)) for f in row._field_defaults], kw_only=True)
    cls.__module__, cls.__doc__ = __name__, doc
    return cls


# The metrics as keyword-only dataclass fields, for the sources' readings to inherit.
DeviceMetrics = _metrics_class("DeviceMetrics", DeviceSampleRow, "The metrics of one device sample.")
ProcessMetrics = _metrics_class("ProcessMetrics", ProcessSampleRow, "The metrics of one process sample.")

__all__ = [
    "DEVICE_METRICS", "DEVICE_SAMPLE_COLUMNS", "INT_METRICS", "PROCESS_METRICS", "PROCESS_SAMPLE_COLUMNS",
    "DeviceMetrics", "DeviceSampleRow", "ProcessMetrics", "ProcessSampleRow",
]
