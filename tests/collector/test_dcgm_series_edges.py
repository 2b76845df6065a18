"""`import-prometheus` where dcgm-exporter's series meet at their edges, in a real Prometheus.

One GPU scraped under today's names and dcgm-exporter 1.x's at once (a fleet half-way through an upgrade); a pod's
series of a field another field replaces, at times the kept field lacks; and counters whose last stored point falls
in a scrape gap at the edge of an import window.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from collector.importers.prometheus import import_prometheus
from store.db import Store
from store.models import Device, DeviceSample, ProcessSample
from store.settings import Settings
from tests.prometheus_server import PrometheusServer, recorded_prometheus

T0 = 1_700_007_180.0  # on the step grid
STEP = 60.0
N = 6
END = T0 + (N - 1) * STEP
MISSING = 3  # no scrape of node-counters at T0 + 180: the edge of a 180 s import window

# today's names, with the model, and 1.x's, without it, for the same GPU
UPGRADE_NEW = 'hostname="node-upgrade",gpu="0",UUID="GPU-up0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3"'
UPGRADE_OLD = 'Hostname="node-upgrade",gpu="0",uuid="GPU-up0"'
# a pod's GPU: GPU_UTIL for the first three minutes only, GR_ENGINE_ACTIVE (which GPU_UTIL replaces) for all six
POD = 'hostname="node-prof",gpu="0",UUID="GPU-pr0",modelName="NVIDIA A100-SXM4-80GB",namespace="ml",pod="train-1"'
# another GPU of that host, no pod: its rows come after the pod's GPU's
IDLE = 'hostname="node-prof",gpu="1",UUID="GPU-pr1",modelName="NVIDIA A100-SXM4-80GB"'
COUNTERS = 'hostname="node-counters",gpu="0",UUID="GPU-ct0",modelName="NVIDIA A100-SXM4-80GB"'
ECC = [5, 0, 1, None, 1, 2]  # the driver reloaded after the first minute (a reset); one error before and after the gap
XID = [0, 48, 48, None, 48, 48]  # one XID 48, still the last code after the gap


def _openmetrics() -> str:
    lines: list[str] = []

    def family(name: str, rows: list[tuple[str, int, float | None]]) -> None:
        lines.append(f"# TYPE {name} gauge")
        for labels, i, value in rows:
            if value is not None:
                lines.append(f"{name}{{{labels}}} {float(value)!r} {T0 + i * STEP!r}")

    family("DCGM_FI_DEV_GPU_UTIL", [(UPGRADE_NEW, i, 50.0 + i) for i in range(N)]
           + [(POD, i, 10.0 * (i + 1)) for i in range(3)]
           + [(IDLE, i, 90.0) for i in range(N)]
           + [(COUNTERS, i, 0.0 if ECC[i] is None else 70.0) for i in range(N) if ECC[i] is not None])
    family("DCGM_FI_PROF_GR_ENGINE_ACTIVE", [(POD, i, 0.05) for i in range(N)])
    family("dcgm_gpu_utilization", [(UPGRADE_OLD, i, 20.0) for i in range(N)])
    family("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", [(COUNTERS, i, v) for i, v in enumerate(ECC)])
    family("DCGM_FI_DEV_XID_ERRORS", [(COUNTERS, i, v) for i, v in enumerate(XID)])
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prom(tmp_path_factory) -> Iterator[PrometheusServer]:
    with recorded_prometheus(tmp_path_factory.mktemp("prometheus"), _openmetrics()) as server:
        yield server


def _import(store: Store, url: str, **settings):
    return import_prometheus(store, url, since=T0, until=END, step=STEP, now=END + 60,
                             settings=Settings(home=Path("/nonexistent"), **settings))


def _device(store: Store, host: str, index: int = 0) -> Device:
    with store.session() as s:
        return s.scalars(select(Device).where(Device.host_id == host, Device.index == index)).one()


def test_a_gpu_under_todays_and_older_names_is_one_device_named_by_todays(prom, sqlite_store, caplog):
    _import(sqlite_store, prom.url)
    assert "read dcgm-exporter 1.x's names (dcgm_gpu_utilization)" in caplog.text  # said: the fleet is mid-upgrade
    dev = _device(sqlite_store, "node-upgrade")
    with sqlite_store.session() as s:
        rows = s.execute(select(DeviceSample.ts, DeviceSample.gpu_util).where(DeviceSample.device_id == dev.id)
                         .order_by(DeviceSample.ts)).all()
    assert dev.name == "NVIDIA H100 80GB HBM3" and dev.uuid == "GPU-up0"
    # one sample a minute, today's reading (not 1.x's 20 %)
    assert [(t, round(u, 2)) for t, u in rows] == [(T0 + i * STEP, round((50.0 + i) / 100, 2)) for i in range(N)]


def test_a_pods_samples_are_its_gpus_samples_never_another_gpus(prom, sqlite_store):
    _import(sqlite_store, prom.url)
    dev = _device(sqlite_store, "node-prof")
    with sqlite_store.session() as s:
        device_rows = s.execute(select(DeviceSample.ts, DeviceSample.gpu_util)
                                .where(DeviceSample.device_id == dev.id).order_by(DeviceSample.ts)).all()
        process_rows = s.execute(select(ProcessSample.device_id, ProcessSample.ts, ProcessSample.sm_util)
                                 .where(ProcessSample.workflow_id == "k8s-ml/train-1")
                                 .order_by(ProcessSample.ts)).all()
    # the device's readings are GPU_UTIL's (three minutes); the pod's samples are those, at the same times
    assert [(t, round(u, 2)) for t, u in device_rows] == [(T0 + i * STEP, round(0.1 * (i + 1), 2)) for i in range(3)]
    assert [(d, t, round(u, 2)) for d, t, u in process_rows] == [(dev.id, t, round(u, 2)) for t, u in device_rows]


@pytest.mark.parametrize("window_s", [21600.0, 180.0], ids=["one-window", "gap-at-a-window-edge"])
def test_counters_carry_on_over_a_scrape_gap_at_a_window_edge(prom, sqlite_store, window_s):
    summary = _import(sqlite_store, prom.url, prometheus_window_s=window_s)
    dev = _device(sqlite_store, "node-counters")
    with sqlite_store.session() as s:
        rows = s.execute(select(DeviceSample.ts, DeviceSample.ecc_errors, DeviceSample.xid_errors)
                         .where(DeviceSample.device_id == dev.id).order_by(DeviceSample.ts)).all()
    kept = [i for i in range(N) if i != MISSING]
    assert [t for t, _, _ in rows] == [T0 + i * STEP for i in kept]
    # 5 errors, a reset, then one more before the gap and one after: the count never falls, nothing counts twice
    assert [e for _, e, _ in rows] == [5, 5, 6, 6, 7]
    assert [x for _, _, x in rows] == [0, 1, 1, 1, 1]  # one XID, however the import is cut
    assert summary.counter_resets == 1
