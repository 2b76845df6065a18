"""fleetlens_import_prometheus imports from FLEETLENS_PROMETHEUS_URL through Airflow's dag.test(), and resumes."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from store.models import Device, DeviceSample
from tests.collector.test_prometheus_import import GAP, N, _openmetrics
from tests.dags.conftest import FleetStore
from tests.prometheus_server import recorded_prometheus


@pytest.mark.slow
def test_import_dag_imports_then_resumes(dag_store: FleetStore, dag_run, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    t0 = math.floor((time.time() - 3 * 3600) / 60) * 60  # an hour of series, ending two hours ago
    with recorded_prometheus(tmp_path, _openmetrics(t0)) as prom:
        monkeypatch.setenv("FLEETLENS_PROMETHEUS_URL", prom.url)
        monkeypatch.setenv("FLEETLENS_PROMETHEUS_LOOKBACK_S", str(4 * 3600))
        first = dag_run("fleetlens_import_prometheus")
        again = dag_run("fleetlens_import_prometheus")
    assert first["state"] == "success", first
    result = first["tasks"]["import_prometheus"]["result"]
    assert result["device_samples"] == 2 * N + (N - len(GAP)) and result["devices"] == 3
    assert result["skipped"] == {"without a gpu or UUID label": 1}
    assert again["state"] == "success" and again["tasks"]["import_prometheus"]["result"]["device_samples"] == 0
    with dag_store.store.session() as s:
        imported = s.scalar(select(func.count()).select_from(DeviceSample)
                            .join(Device, Device.id == DeviceSample.device_id).where(Device.source == "prometheus"))
    assert imported == result["device_samples"]


@pytest.mark.slow
def test_import_dag_without_a_url_does_nothing(dag_store: FleetStore, dag_run) -> None:
    outcome = dag_run("fleetlens_import_prometheus")
    assert outcome["state"] == "success", outcome
    assert outcome["tasks"]["import_prometheus"]["result"] == {"skipped": "FLEETLENS_PROMETHEUS_URL is not set"}
