"""Shared fixtures: a fresh FLEETLENS_HOME, real SQLite stores, and real PostgreSQL on a fresh schema per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from sqlalchemy import create_engine, text

from store.db import Store
from store.migrations import upgrade
from store.settings import get_settings
from tests.gpu.probe import gpu_unavailable_reason
from tests.procs import processes_under

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data"
TRACES = SHARED_DATA / "traces"
FLEET = SHARED_DATA / "fleet"


@pytest.fixture
def fleet_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """FLEETLENS_HOME in a temporary folder, with the default SQLite database inside it."""
    home = tmp_path / "home"
    for var in list(os.environ):
        if var.startswith("FLEETLENS_") and var != "FLEETLENS_TEST_PG_URL":
            monkeypatch.delenv(var)
    monkeypatch.setenv("FLEETLENS_HOME", str(home))
    monkeypatch.setenv("FLEETLENS_SECRET", "test-secret")
    get_settings(fresh=True)
    yield home
    get_settings(fresh=True)


@pytest.fixture
def cli_store(fleet_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A migrated SQLite store that `fleetlens` commands and the dashboard's pages open (FLEETLENS_DB_URL)."""
    fleet_home.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{fleet_home / 'fleetlens.db'}"
    monkeypatch.setenv("FLEETLENS_DB_URL", url)
    get_settings(fresh=True)
    store = Store(url)
    upgrade(store)
    yield store
    store.dispose()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    store = Store(f"sqlite:///{tmp_path / 'fleetlens.db'}")
    upgrade(store)
    yield store
    store.dispose()


def pg_base_url() -> str:
    url = os.environ.get("FLEETLENS_TEST_PG_URL")
    if not url:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("FLEETLENS_TEST_PG_URL is not set, and PostgreSQL tests must run when CI=true")
        pytest.skip("FLEETLENS_TEST_PG_URL is not set (PostgreSQL tests run when it names a database)")
    return url


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a schema created for this test and dropped after it."""
    base = pg_base_url()
    schema = f"fl_{uuid.uuid4().hex[:12]}"
    admin = create_engine(Store(base).url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in base else "?"
    yield f"{base}{sep}options=-csearch_path%3D{schema}"
    with admin.connect() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[Store]:
    store = Store(pg_url)
    upgrade(store)
    yield store
    store.dispose()


@pytest.fixture(params=["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def any_store(request: pytest.FixtureRequest) -> Store:
    """The same test on SQLite and on PostgreSQL."""
    return request.getfixturevalue("sqlite_store" if request.param == "sqlite" else "pg_store")


@pytest.fixture(autouse=True)
def _kill_leftover_processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """After each test, every process whose FLEETLENS_HOME lies in the test's temporary folder is killed, and the
    output says which: a test that fails half-way must not leave an agent or a training job running."""
    yield
    left = processes_under(tmp_path)
    if not left:
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else _nothing():
        for proc in left:
            try:
                print(f"\n{request.node.nodeid}: killing a process it left running (found by FLEETLENS_HOME in "
                      f"{tmp_path}): pid {proc.pid} {' '.join(proc.cmdline())[:160]}")
                proc.kill()
            except psutil.Error:
                continue
    psutil.wait_procs(left, timeout=10)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# Under pytest-xdist (`make test` runs two workers) the tests that start a whole deployment run one at a time: each
# group below runs on one worker, while the other worker takes other work. A module whose tests share a costly module
# fixture is a group too, so that the fixture is built once rather than on each worker that gets one of its tests: the
# Alibaba day backfilled into Prometheus and imported (most of a minute), the Ray cluster of the live Ray Tune tests
# (two clusters at once on a two-core machine would each time out starting). xdist hands out the groups before the
# single tests whatever this order says (it sorts the units by their number of tests, --loadscope-reorder, its
# default); the order below holds in a run without xdist and among equal counts.
SERIAL_GROUPS = {"tests/e2e/test_demo.py": "demo", "tests/e2e/test_demo_signals.py": "demo",
                 "tests/dags/test_celery_executor.py": "celery",
                 "tests/analyzer/test_telemetry_prometheus.py": "alibaba-prometheus",
                 "tests/sweeps/test_tune_live.py": "ray"}
GROUP_ORDER = ("demo", "celery", "slurm", "ray", "alibaba-prometheus")
SERIAL_FOLDERS = {"tests/slurm/": "slurm"}  # one real Slurm cluster per worker: all its tests on one worker


def _group_of(nodeid: str) -> str | None:
    path = nodeid.split("::", 1)[0]
    return SERIAL_GROUPS.get(path) or next((g for f, g in SERIAL_FOLDERS.items() if path.startswith(f)), None)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each serial group is one unit of work; every other test is a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling  # only where pytest-xdist runs the suite

    class SerialGroupsScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid) or nodeid

    return SerialGroupsScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The serial groups go first (see SERIAL_GROUPS; the sort is stable). `gpu` tests run on a GPU host and skip
    with the reason everywhere else, CI included (it has no GPU)."""
    items.sort(key=lambda item: GROUP_ORDER.index(g) if (g := _group_of(item.nodeid)) else len(GROUP_ORDER))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=f"needs a GPU host: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """No process a test started outlives the run: any left (a test that failed before its clean-up) is named and
    killed, so one broken test cannot slow the machine for the next run. Under pytest-xdist each worker does this
    for the tests it ran; the controlling process's children are the workers themselves, left to xdist."""
    if session.config.pluginmanager.getplugin("dsession") is not None:
        return
    left = psutil.Process().children(recursive=True)
    for proc in left:
        try:
            print(f"\nkilling a process a test left running: {proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=10)
