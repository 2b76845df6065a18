"""`alembic upgrade head` builds exactly the models' schema on SQLite and PostgreSQL; `downgrade base` empties it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from store.db import Store
from store.migrations import PROJECT_ROOT, current_revision, downgrade, head_revision, upgrade
from store.models import Base
from store.partitions import is_partition


def _diff(store: Store) -> list:
    with store.engine.connect() as conn:
        # the day partitions of the sample tables are made at run time; the models know their parents only
        ctx = MigrationContext.configure(conn, opts={
            "compare_type": True,
            "include_name": lambda name, kind, _parents: not (kind == "table" and is_partition(name)),
        })
        return compare_metadata(ctx, Base.metadata)


def _roundtrip(store: Store) -> None:
    assert current_revision(store) is None
    assert upgrade(store) == head_revision()
    assert _diff(store) == []
    assert set(Base.metadata.tables) <= store.table_names()
    downgrade(store, "base")
    assert store.table_names() <= {"alembic_version"}
    assert current_revision(store) is None


def test_upgrade_and_downgrade_on_sqlite(tmp_path):
    _roundtrip(Store(f"sqlite:///{tmp_path / 'a.db'}"))


@pytest.mark.pg
def test_upgrade_and_downgrade_on_postgresql(pg_url):
    _roundtrip(Store(pg_url))


def test_alembic_command_line_upgrades_the_configured_database(tmp_path):
    db = tmp_path / "cli.db"
    env = {"FLEETLENS_DB_URL": f"sqlite:///{db}", "PATH": "/usr/bin:/bin"}
    alembic = [sys.executable, "-m", "alembic", "-c", str(PROJECT_ROOT / "alembic.ini"), "upgrade", "head"]
    subprocess.run(alembic, check=True, cwd=PROJECT_ROOT, env=env, capture_output=True)
    assert current_revision(Store(f"sqlite:///{db}")) == head_revision()


def test_sqlite_connections_use_wal_busy_timeout_and_foreign_keys(sqlite_store):
    with sqlite_store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
