"""Test helper: a small synthetic fleet written into a real store (hosts, devices, workflows, processes, samples)."""

from __future__ import annotations

from store.db import Store
from store.ingest import write_samples
from store.models import Process
from store.registry import DeviceSpec, register_devices, register_host
from store.workflows import upsert_workflow

GIB = 1 << 30
T0 = 1_700_000_000.0 - (1_700_000_000.0 % 3600)  # an hour boundary


class Fleet:
    """Builds devices and minute-by-minute samples; `flush()` writes them in one batch."""

    def __init__(self, store: Store, t0: float = T0, interval_s: float = 60.0) -> None:
        self.store, self.t0, self.interval = store, t0, interval_s
        self.device_rows: list[dict] = []
        self.process_rows: list[dict] = []
        self.hosts: dict[int, str] = {}
        self._next_index: dict[str, int] = {}

    def device(self, host: str = "h1", total_gib: float = 80.0, name: str = "NVIDIA A100-SXM4-80GB",
               source: str = "replay") -> int:
        index = self._next_index.get(host, 0)
        self._next_index[host] = index + 1
        with self.store.session() as s:
            register_host(s, host, hostname=host, source=source, now=self.t0)
            ids = register_devices(
                s, host, [DeviceSpec(index, f"GPU-{host}-{index}", name, int(total_gib * GIB))],
                source=source, now=self.t0,
            )
        self.hosts[ids[index]] = host
        return ids[index]

    def workflow(self, wf: str, team: str | None = None, gpus: int = 1) -> str:
        with self.store.session() as s:
            upsert_workflow(s, wf, now=self.t0, team=team, gpus=gpus)
        return wf

    def process(self, wf: str, host: str, pid: int, start_min: float, ended_min: float | None = None) -> None:
        with self.store.session() as s:
            s.add(Process(
                host_id=host, pid=pid, start_time=self.t0 + start_min * 60, workflow_id=wf,
                first_seen=self.t0 + start_min * 60, last_seen=self.t0 + (ended_min or start_min) * 60,
                ended_at=None if ended_min is None else self.t0 + ended_min * 60,
            ))

    def run(
        self, device_id: int, wf: str | None, start_min: int, end_min: int, *, util: float, mem_gib: float,
        sm_active: float | None = None, wf_mem_gib: float | None = None, pid: int = 100, total_gib: float = 80.0,
        device_rows: bool = True,
    ) -> None:
        """Samples each minute of [start_min, end_min): the device's, and (with wf) the workflow's process."""
        for m in range(start_min, end_min):
            ts = self.t0 + m * self.interval
            if device_rows:
                self.device_rows.append({
                    "device_id": device_id, "ts": ts, "gpu_util": util, "mem_used": int(mem_gib * GIB),
                    "mem_total": int(total_gib * GIB), "sm_active": sm_active,
                })
            if wf is not None:
                self.process_rows.append({
                    "device_id": device_id, "workflow_id": wf, "host_id": self.hosts[device_id], "pid": pid,
                    "ts": ts, "mem_used": int((mem_gib if wf_mem_gib is None else wf_mem_gib) * GIB),
                })

    def flush(self) -> None:
        write_samples(self.store, self.device_rows, self.process_rows)
        self.device_rows, self.process_rows = [], []

    def minute(self, m: float) -> float:
        return self.t0 + m * self.interval
