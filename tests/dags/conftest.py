"""The DAG tests' fixtures: Airflow's metadata in a temporary AIRFLOW_HOME, migrated once per session, and a
fleetlens SQLite store seeded per test that FLEETLENS_DB_URL names (the DAG tasks open it from the settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from store.db import Store
from store.migrations import upgrade
from tests.conftest import PROJECT_ROOT
from tests.dags.seed import Seeded, seed

DAGS = PROJECT_ROOT / "dags"
AIRFLOW = Path(sys.executable).with_name("airflow")


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """AIRFLOW_HOME with a migrated SQLite metadata DB and dags_folder at the project's dags/.

    Airflow reads its configuration once, when it is first imported, so the environment is set for the whole
    session before any test imports it (the test modules import Airflow inside their tests only).
    """
    if "airflow" in sys.modules:
        pytest.fail("airflow was imported before the DAG tests set AIRFLOW_HOME; import it inside tests only")
    home = tmp_path_factory.mktemp("airflow_home")
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        proc = subprocess.run([str(AIRFLOW), "db", "migrate"], env=os.environ.copy(), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        (home / "variables.json").write_text("{}")
        yield home


@pytest.fixture
def dag_run(airflow_home: Path) -> Iterator[Callable[..., dict]]:
    """`dag_run(dag_id, conf=None, variables=None)`: dag.test() one DAG with these Airflow Variables.

    Every run reads the Variables from the same file: Airflow loads its secrets backends once per process, so a
    second file given to a later dag.test() would never be read; the file itself is read on every lookup.
    """
    from tests.dags.run_dag import run_dag

    path = airflow_home / "variables.json"

    def run(dag_id: str, conf: dict | None = None, variables: dict | None = None) -> dict:
        path.write_text(json.dumps(variables or {}))
        return run_dag(dag_id, conf, path)

    yield run
    path.write_text("{}")


@dataclass
class FleetStore:
    store: Store
    url: str
    home: Path
    seeded: Seeded | None


@pytest.fixture
def dag_store(airflow_home: Path, fleet_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetStore]:
    """A seeded fleetlens SQLite store in FLEETLENS_HOME, named by FLEETLENS_DB_URL."""
    fleet_home.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{fleet_home / 'fleetlens.db'}"
    monkeypatch.setenv("FLEETLENS_DB_URL", url)
    store = Store(url)
    upgrade(store)
    yield FleetStore(store, url, fleet_home, seed(store, checkpoint_root=str(fleet_home / "checkpoints")))
    store.dispose()
