"""A whole recording of a fleet in memory: hosts, devices, workflows, processes and their samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass
class Recording:
    """A whole recording in memory, with times as recorded (epoch seconds).

    ``device_samples`` columns: host_id, device_index, ts, and store.samples.DEVICE_METRICS.
    ``process_samples`` columns: host_id, device_index, workflow_id, pid, ts, mem_used, sm_util, cpu_util.
    """

    kind: str
    hosts: list[dict[str, Any]]  # id, hostname, labels
    devices: list[dict[str, Any]]  # host_id, index, uuid, name, memory_total, cpu_cores
    workflows: list[dict[str, Any]]  # id plus Workflow column values
    processes: list[dict[str, Any]]  # host_id, pid, workflow_id, cmdline, start_time, end_time
    device_samples: pd.DataFrame
    process_samples: pd.DataFrame
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def start(self) -> float:
        return float(self.device_samples["ts"].min()) if len(self.device_samples) else 0.0

    @property
    def end(self) -> float:
        return float(self.device_samples["ts"].max()) if len(self.device_samples) else 0.0
