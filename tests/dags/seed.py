"""A small fleet for the DAG tests, written through the store's own functions: one host, four 16 GiB devices,
three running jobs (two idle movable managed ones, one busy) and a finished one, with a sample a minute."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from store.db import Store
from store.findings import FindingSpec, upsert_finding
from store.ingest import write_samples
from store.models import Placement
from store.registry import DeviceSpec, register_devices, register_host, touch_host
from store.settings import get_settings
from store.workflows import sign_workflow_spec, upsert_workflow

GIB = 2**30
HOST = "dag-host"
# workflow -> (device index, utilisation, memory GiB, minutes of samples before now, managed+movable, state)
JOBS = {
    "idle-a": (0, 0.0, 2.0, 180, True, "running"),
    "idle-b": (1, 0.1, 2.0, 150, True, "running"),
    "busy-c": (2, 0.9, 4.0, 180, False, "running"),
    "done-d": (3, 0.8, 8.0, 240, False, "finished"),
}


@dataclass
class Seeded:
    now: float
    device_ids: dict[str, int] = field(default_factory=dict)  # workflow -> its device
    device_rows: int = 0


def seed(store: Store, now: float | None = None, checkpoint_root: str = "/nonexistent/checkpoints",
         secret: bytes | None = None) -> Seeded:
    now = time.time() if now is None else now
    out = Seeded(now=now)
    start = now - 240 * 60
    with store.session() as s:
        register_host(s, HOST, hostname=HOST, source="replay", now=start)
        ids = register_devices(s, HOST, [DeviceSpec(i, f"GPU-dag-{i}", "T4", 16 * GIB) for i in range(4)],
                               source="replay", now=start)
        for wf, (index, _, mem, _, managed, state) in JOBS.items():
            row = upsert_workflow(s, wf, now=start, managed=managed, movable=managed, state=state, team="research",
                                  command=["python", "train.py"] if managed else None,
                                  checkpoint_dir=f"{checkpoint_root}/{wf}" if managed else None,
                                  mem_persistent=int(mem / 1.1 * GIB), mem_ephemeral=0,
                                  id_source="managed" if managed else "env")
            if managed:  # as `fleetlens run` does: agents relaunch only a spec signed with the fleet's secret
                sign_workflow_spec(row, secret if secret is not None else get_settings().secret_bytes())
            out.device_ids[wf] = ids[index]
            if state == "running":
                s.add(Placement(workflow_id=wf, device_id=ids[index], host_id=HOST, pid=1000 + index,
                                mem_persistent=int(mem * GIB), mem_ephemeral=0, started_at=start))
    devices, processes = [], []
    for wf, (index, util, mem, minutes, _, state) in JOBS.items():
        end = now if state == "running" else now - 60 * 60
        for m in range(minutes):
            ts = end - (minutes - m) * 60.0
            devices.append({"device_id": ids[index], "ts": ts, "gpu_util": util, "mem_used": int(mem * GIB),
                            "mem_total": 16 * GIB})
            processes.append({"device_id": ids[index], "workflow_id": wf, "host_id": HOST, "pid": 1000 + index,
                              "ts": ts, "mem_used": int(mem * GIB)})
    write_samples(store, devices, processes)
    with store.session() as s:
        touch_host(s, HOST, now)  # its agent's last flush, with the newest samples: a host heard from now
    out.device_rows = len(devices)
    return out


def flag_idle(store: Store, seeded: Seeded) -> None:
    """The findings the telemetry detectors give this fleet, recorded directly (for the enforcement test)."""
    with store.session() as s:
        for wf, rule, evidence in (("idle-a", "idle_holder", {"util_mean_while_idle": 0.0, "mem_held_gib": 2.0}),
                                   ("idle-b", "low_utilization", {"util_p95": 0.1, "util_mean": 0.1})):
            upsert_finding(s, FindingSpec(rule=rule, workflow_id=wf, source="telemetry", severity="high",
                                          title=f"{wf} wastes its device", fix="share it",
                                          evidence=evidence, device_id=seeded.device_ids[wf],
                                          gpu_hours_per_day=20.0), now=seeded.now)
