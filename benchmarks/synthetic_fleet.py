"""The synthetic fleet the telemetry benchmarks share: hosts of eight H100s, one workflow per device.

benchmarks/detect_fleet.py (SQLite, 1,000 devices) and benchmarks/fleet_scale.py (PostgreSQL, 10,000 devices)
register the same fleet through `register_fleet`; their sample rows name hosts and workflows with `host_id` and
`workflow_id` (fleet_scale's SQL writes the same names with lpad, see HOST_DIGITS and WORKFLOW_DIGITS).
"""

from __future__ import annotations

from sqlalchemy import insert, text

from store.db import Store
from store.models import Device, Host, Workflow

PER_HOST, DAY, GIB = 8, 86400.0, 1 << 30
HOST_DIGITS, WORKFLOW_DIGITS = 4, 5


def host_id(device_index: int) -> str:
    """The host of the device at 0-based `device_index` (devices are numbered index + 1 in the store)."""
    return f"h{device_index // PER_HOST:0{HOST_DIGITS}d}"


def workflow_id(device_index: int) -> str:
    return f"wf-{device_index:0{WORKFLOW_DIGITS}d}"


def register_fleet(store: Store, n_devices: int, now: float) -> None:
    """Hosts, devices (ids 1..n_devices) and one workflow per device, all seen for the last day."""
    with store.engine.begin() as conn:
        conn.execute(insert(Host), [
            {"id": host_id(d), "hostname": host_id(d), "source": "nvml", "started_at": now - DAY, "last_seen": now,
             "labels": {}} for d in range(0, n_devices, PER_HOST)])
        conn.execute(insert(Device), [
            {"id": d + 1, "host_id": host_id(d), "index": d % PER_HOST, "uuid": f"GPU-{d}",
             "name": "NVIDIA H100 80GB HBM3", "source": "nvml", "memory_total": 80 * GIB, "state": "ok",
             "registered_at": now - DAY, "last_seen": now} for d in range(n_devices)])
        conn.execute(insert(Workflow), [
            {"id": workflow_id(d), "team": f"team-{d % 12}", "labels": {}, "created_at": now - DAY,
             "last_seen": now, "state": "running", "gpus": 1} for d in range(n_devices)])
        if conn.dialect.name == "postgresql":  # ids given explicitly: the sequence must move past them
            conn.execute(text(f"SELECT setval(pg_get_serial_sequence('devices', 'id'), {n_devices})"))
