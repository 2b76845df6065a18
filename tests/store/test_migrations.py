"""`alembic upgrade head` builds exactly the models' schema on SQLite and PostgreSQL; `downgrade base` empties it;
0006 takes the sample tables' ids away and its downgrade gives them back, every row kept both ways; 0012 turns the
placements' P' into the measured P and back; 0013 gives slurm_jobs every node's GPUs, filled for the rows before it;
0016 gives serving minutes their batch-size classes, none for the rows before it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from unittest import mock

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import column, inspect, select, table, text

from store.db import Store
from store.headroom import charged
from store.ingest import write_samples
from store.migrations import PROJECT_ROOT, current_revision, downgrade, head_revision, upgrade
from store.models import Action, ActionEvent, Base, Finding, Placement, Workflow
from store.models_base import Json
from store.models_slurm import SlurmJob
from store.partitions import DAY, SAMPLE_TABLES, adopt_early_rows, day_of, is_partition, partition_name, partitions
from store.registry import DeviceSpec, register_devices, register_host
from store.samples import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS
from store.serving import app_windows, merge_minutes, set_slo
from store.workflows import upsert_workflow


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


COLUMNS = {"device_samples": DEVICE_SAMPLE_COLUMNS, "process_samples": PROCESS_SAMPLE_COLUMNS}


def _samples(store: Store, with_id: bool = False) -> dict[str, Counter]:
    """Every sample row of both tables, as a multiset of value tuples (without the id unless asked)."""
    out = {}
    with store.engine.connect() as conn:
        for table, columns in COLUMNS.items():
            names = ("id", *columns) if with_id else columns
            out[table] = Counter(conn.execute(text(f"SELECT {', '.join(names)} FROM {table}")).tuples())
    return out


def _sample_schema(store: Store) -> dict:
    """The sample tables' columns (name, type, nullable, default), primary key and indexes."""
    with store.engine.connect() as conn:
        found = inspect(conn)
        return {table: (sorted((c["name"], str(c["type"]), c["nullable"], c["default"])
                               for c in found.get_columns(table)),
                        (found.get_pk_constraint(table)["name"], found.get_pk_constraint(table)["constrained_columns"]),
                        sorted((i["name"], tuple(i["column_names"])) for i in found.get_indexes(table)))
                for table in SAMPLE_TABLES}


def _write(store: Store, times: list[float], pid: int = 7) -> None:
    """Samples as a writer of an early revision wrote them: without late-hour marks (their table comes with 0017)."""
    with mock.patch("store.late_hours.mark"):
        write_samples(store, [{"device_id": 1 + k % 2, "ts": t, "gpu_util": k / 10, "mem_used": k << 20}
                              for k, t in enumerate(times)],
                      [{"device_id": 1 + k % 2, "workflow_id": f"wf{k % 3}", "host_id": "h1", "pid": pid, "ts": t,
                        "mem_used": k << 20, "sm_util": 0.5} for k, t in enumerate(times)])


def _ids_dropped_and_restored(store: Store) -> None:
    """0005 -> 0006 -> 0005 on a database holding samples (on PostgreSQL in day partitions and in the default one):
    every row is kept both ways, the ids go and come back (unique, a sequence going on after them), the schema
    is 0005's again, and day partitions made at 0006 come out without ids and come back with them."""
    postgres = store.is_postgres
    assert upgrade(store, "0005") == "0005"
    schema_0005 = _sample_schema(store)
    now = time.time()
    times = [now - 3 * DAY, now - 3 * DAY, now - 60.0, now - 60.0, now, now + 10 * DAY]  # ten days ahead: default
    _write(store, times)
    rows = _samples(store)
    assert sum(rows["device_samples"].values()) == len(times) == sum(rows["process_samples"].values())

    assert upgrade(store) == head_revision()  # 0006, and the later revisions, which leave the sample tables alone
    assert _diff(store) == []
    assert _samples(store) == rows
    with store.engine.connect() as conn:
        for table in SAMPLE_TABLES:
            assert "id" not in {c["name"] for c in inspect(conn).get_columns(table)}
            assert inspect(conn).get_pk_constraint(table)["constrained_columns"] == []
            if postgres:
                assert conn.execute(text("SELECT to_regclass(:s)"), {"s": f"{table}_id_seq"}).scalar() is None
    if postgres:  # days made now, filled from the default partition, have the parent's columns: no id
        ahead, before = day_of(now + 10 * DAY), day_of(now - 3 * DAY)
        assert set(adopt_early_rows(store)) == {partition_name(t, d) for t in SAMPLE_TABLES for d in (ahead, before)}
        with store.engine.connect() as conn:
            assert conn.execute(text(f"SELECT count(*) FROM {partition_name('device_samples', ahead)}")).scalar() == 1
            assert "id" not in {c["name"] for c in inspect(conn).get_columns(partition_name("device_samples", ahead))}
    _write(store, [now + 1.0], pid=8)  # written at 0006: no id given, none made
    rows = _samples(store)

    downgrade(store, "0005")
    assert current_revision(store) == "0005"
    assert _sample_schema(store) == schema_0005
    back = _samples(store, with_id=True)
    for table in SAMPLE_TABLES:
        assert Counter({row[1:]: n for row, n in back[table].items()}) == rows[table]  # every row, no other
        ids = [row[0] for row in back[table].elements()]
        assert len(set(ids)) == len(ids) == sum(rows[table].values()) and None not in ids
    _write(store, [now + 2.0], pid=9)  # the restored sequence carries on past every id it gave
    newer = _samples(store, with_id=True)
    for table in SAMPLE_TABLES:
        old_ids = {row[0] for row in back[table]}
        new_ids = {row[0] for row in newer[table]} - old_ids
        assert len(new_ids) == 1 and min(new_ids) > max(old_ids)
    if postgres:  # every day partition, the one made at 0006 too, has its primary key back
        with store.engine.connect() as conn:
            for table in SAMPLE_TABLES:
                names = {p.name for p in partitions(conn, table)}
                keyed = set(conn.execute(text(
                    "SELECT conrelid::regclass::text FROM pg_constraint WHERE contype = 'p' "
                    "AND conrelid::regclass::text = ANY(:names)"), {"names": sorted(names)}).scalars())
                assert keyed == names and partition_name(table, day_of(now + 10 * DAY)) in names


def test_0006_drops_the_sample_ids_and_its_downgrade_restores_them_on_sqlite(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        _ids_dropped_and_restored(store)
    finally:
        store.dispose()


@pytest.mark.pg
def test_0006_drops_the_sample_ids_and_its_downgrade_restores_them_on_postgresql(pg_url):
    store = Store(pg_url)
    try:
        _ids_dropped_and_restored(store)
    finally:
        store.dispose()


def _raw_requests_up_and_down(store: Store) -> None:
    """0011 adds the opt-in raw serving requests and their counts; its downgrade takes both away and leaves 0010's
    serving tables (and their rows) as they were."""
    upgrade(store, "0010")
    assert not {"serving_requests", "serving_raw_counts"} & store.table_names()
    upgrade(store, "0011")
    assert current_revision(store) == "0011"
    with store.session() as session:
        upsert_workflow(session, "svc", id_source="env")
        set_slo(session, "svc", "a", 1.0)
    with store.engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_requests (workflow_id, app, arrival, wait_s, exec_s, latency_s, "
                          "batch_size) VALUES ('svc', 'a', 1.0, 0.0, 0.5, 0.5, 1), "
                          "('svc', 'a', 2.0, 0.1, 0.5, 0.6, 2)"))
        conn.execute(text("INSERT INTO serving_raw_counts (workflow_id, stored, over_cap) VALUES ('svc', 2, 3)"))
        ids = conn.execute(text("SELECT id FROM serving_requests ORDER BY id")).scalars().all()
    assert len(set(ids)) == 2  # the id is generated
    downgrade(store, "0010")
    assert current_revision(store) == "0010"
    assert not {"serving_requests", "serving_raw_counts"} & store.table_names()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM serving_apps")).scalar() == 1
    upgrade(store, "0011")
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM serving_requests")).scalar() == 0


def test_0011_raw_serving_requests_up_and_down_on_sqlite(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'raw.db'}")
    try:
        _raw_requests_up_and_down(store)
    finally:
        store.dispose()


def _placements_keep_measured_memory(store: Store) -> None:
    """0011 -> 0012 -> 0011 on placements written with P' = charged(P): the upgrade keeps P = floor(P' / 1.1), the
    downgrade gives P' back (charged again: at most the byte its first rounding up added), unknown memory stays
    unknown."""
    assert upgrade(store, "0011") == "0011"
    measured = [1, 10, 100 << 20, 1 << 30, 7 * (1 << 30) + 12345, 80 * (1 << 30), None]
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="cpu")
        (device_id,) = register_devices(s, "h1", [DeviceSpec(0, "cpu:h1:0", "cpu", 1 << 40, (0,))],
                                        source="cpu").values()
        for k, p in enumerate(measured):
            upsert_workflow(s, f"wf{k}", now=1.0, id_source="managed")
            s.add(Placement(workflow_id=f"wf{k}", device_id=device_id, host_id="h1",
                            mem_persistent=None if p is None else charged(p), mem_ephemeral=5, started_at=1.0))

    def kept() -> list[int | None]:
        with store.engine.connect() as conn:
            return [r[0] for r in conn.execute(text("SELECT mem_persistent FROM placements ORDER BY id"))]

    assert upgrade(store) == head_revision()
    assert _diff(store) == []
    assert kept() == [None if p is None else (10 * charged(p)) // 11 for p in measured]
    assert kept() == measured  # P as it was measured (1.1 P rounded up, then floored back)
    downgrade(store, "0011")
    assert current_revision(store) == "0011"
    assert kept() == [None if p is None else charged(p) for p in measured]


def test_0012_placements_keep_measured_memory_on_sqlite(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        _placements_keep_measured_memory(store)
    finally:
        store.dispose()


@pytest.mark.pg
def test_0011_raw_serving_requests_up_and_down_on_postgresql(pg_url):
    store = Store(pg_url)
    try:
        _raw_requests_up_and_down(store)
    finally:
        store.dispose()


@pytest.mark.pg
def test_0012_placements_keep_measured_memory_on_postgresql(pg_url):
    store = Store(pg_url)
    try:
        _placements_keep_measured_memory(store)
    finally:
        store.dispose()


# slurm_jobs as 0012 left it: written in SQL, since the model has 0013's column
SLURM_0012 = table("slurm_jobs", *(column(c) for c in (
    "workflow_id", "job_id", "submit_time", "state", "node", "gpus", "shards", "requeue", "restart_count",
    "opted_in", "seen_at")), column("gpu_indices", Json))
# {job: (state, batch node, its GPUs there, the workflow's slurm_gpus label)}, as the import before 0013 wrote them
OLD_ROWS = {
    1: ("RUNNING", "n1", [0, 1], [["n1", [0, 1]]]),
    2: ("RUNNING", "n1", [2], [["n1", [2]], ["n2", [0, 3]]]),  # on two nodes: the label has both
    3: ("RUNNING", "n2", [1], None),  # written before the label was
    4: ("RUNNING", "n1", [3], [["n7", [5]]]),  # a label that does not agree with the row: the row wins
    5: ("PENDING", None, [], []),
    6: ("GONE", "n1", [], []),
}


def _slurm_gpus_by_node(store: Store) -> None:
    """0012 -> 0013 -> 0012 -> 0013 on slurm_jobs rows the import wrote before 0013: the upgrade fills every node's
    GPUs (its workflow's label where it agrees with the row, else the row's batch node), [] for a job holding none;
    a row written without the column gets []; the downgrade drops it and leaves the batch node's as they were."""
    assert upgrade(store, "0012") == "0012"
    with store.session() as s:
        for j, (_, _, _, label) in OLD_ROWS.items():
            wf = upsert_workflow(s, f"slurm-{j}", now=1.0, id_source="slurm")
            wf.labels = None if label is None else {"slurm_gpus": label}
        upsert_workflow(s, "slurm-7", now=1.0, id_source="slurm")  # its row comes after the upgrade
    with store.engine.begin() as conn:
        conn.execute(SLURM_0012.insert(), [
            {"workflow_id": f"slurm-{j}", "job_id": j, "submit_time": 1.0, "state": state, "node": node,
             "gpus": 0, "shards": 1, "requeue": True, "restart_count": 0, "opted_in": False, "seen_at": 1.0,
             "gpu_indices": indices} for j, (state, node, indices, _) in OLD_ROWS.items()])

    def rows() -> dict[int, tuple]:
        with store.session() as s:
            return {r.job_id: (r.node, r.gpu_indices, r.gpus_by_node) for r in s.scalars(select(SlurmJob))}

    assert upgrade(store) == head_revision()
    assert _diff(store) == []
    assert rows() == {1: ("n1", [0, 1], [["n1", [0, 1]]]), 2: ("n1", [2], [["n1", [2]], ["n2", [0, 3]]]),
                      3: ("n2", [1], [["n2", [1]]]), 4: ("n1", [3], [["n1", [3]]]), 5: (None, [], []),
                      6: ("n1", [], [])}
    with store.engine.begin() as conn:  # what code from before 0013 writes: the column's default
        conn.execute(SLURM_0012.insert(), {"workflow_id": "slurm-7", "job_id": 7, "submit_time": 1.0,
                                           "state": "PENDING", "node": None, "gpus": 0, "shards": 0, "requeue": True,
                                           "restart_count": 0, "opted_in": False, "seen_at": 1.0, "gpu_indices": []})
    assert rows()[7] == (None, [], [])

    downgrade(store, "0012")
    assert current_revision(store) == "0012"
    with store.engine.connect() as conn:
        assert "gpus_by_node" not in {c["name"] for c in inspect(conn).get_columns("slurm_jobs")}
        kept = conn.execute(select(SLURM_0012.c.job_id, SLURM_0012.c.node, SLURM_0012.c.gpu_indices)).all()
    assert {j: (node, indices) for j, node, indices in kept} == {
        **{j: (node, indices) for j, (_, node, indices, _) in OLD_ROWS.items()}, 7: (None, [])}
    with store.session() as s:
        assert s.get(Workflow, "slurm-2").labels == {"slurm_gpus": OLD_ROWS[2][3]}
    assert upgrade(store) == head_revision()
    assert rows()[2] == ("n1", [2], [["n1", [2]], ["n2", [0, 3]]])


def test_0013_slurm_jobs_keep_every_node_s_gpus_on_sqlite(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    try:
        _slurm_gpus_by_node(store)
    finally:
        store.dispose()


@pytest.mark.pg
def test_0013_slurm_jobs_keep_every_node_s_gpus_on_postgresql(pg_url):
    store = Store(pg_url)
    try:
        _slurm_gpus_by_node(store)
    finally:
        store.dispose()


def _downgrades_keep_the_rows_that_reference_a_rebuilt_table(store: Store) -> None:
    """SQLite rebuilds a table to drop a column (0008's actions.detail, 0003's workflows.checkpoint_url): the rows
    of other tables that reference it (ON DELETE CASCADE) stay, as on PostgreSQL, which alters in place."""
    upgrade(store)
    now = time.time()
    with store.session() as s:
        upsert_workflow(s, "wf")
        s.flush()
        action = Action(workflow_id="wf", state="resumed", created_at=now, updated_at=now)
        s.add(action)
        s.flush()
        s.add(ActionEvent(action_id=action.id, ts=now, from_state="planned", to_state="resumed", message="moved"))
        s.add(Finding(fingerprint="fp", workflow_id="wf", rule="idle_holder", source="telemetry", severity="high",
                      title="idle", fix="release it", created_at=now, updated_at=now))
    tables = ("workflows", "actions", "action_events", "findings")

    def counts() -> dict[str, int]:
        with store.engine.connect() as conn:
            return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in tables}

    assert counts() == dict.fromkeys(tables, 1)
    for revision in ("0007", "0002"):
        downgrade(store, revision)
        assert counts() == dict.fromkeys(tables, 1), revision
    if not store.is_postgres:  # and the connections check foreign keys again
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA foreign_key_check").all() == []
    store.dispose()


def test_downgrades_keep_the_rows_that_reference_a_rebuilt_table_on_sqlite(tmp_path):
    _downgrades_keep_the_rows_that_reference_a_rebuilt_table(Store(f"sqlite:///{tmp_path / 'fk.db'}"))


@pytest.mark.pg
def test_downgrades_keep_the_rows_that_reference_a_rebuilt_table_on_postgresql(pg_url):
    _downgrades_keep_the_rows_that_reference_a_rebuilt_table(Store(pg_url))


def _serving_batch_sizes(store: Store) -> None:
    """0015 -> 0016 -> 0015 on serving minutes written before 0016: they keep every count and have no batch-size
    classes (read as such: `batch_sized` 0), a part added to such a minute leaves it without; a new minute has
    them; the downgrade drops the column and keeps the rows."""
    assert upgrade(store, "0015") == "0015"
    with store.session() as session:
        upsert_workflow(session, "svc", id_source="env")
    with store.engine.begin() as conn:  # what the agent wrote before 0016
        conn.execute(text("INSERT INTO serving_minutes (workflow_id, app, minute, n, dropped, met, exec_sum, "
                          "exec_sumsq, wait_sum, latency_sum, batch_sum, devices, exec_hist, latency_hist) VALUES "
                          "('svc', 'a', 60.0, 2, 0, 2, 0.2, 0.02, 0.0, 0.2, 8, 1, '{\"-116\": 2}', "
                          "'{\"-116\": 2}')"))
    assert upgrade(store) == head_revision()
    assert _diff(store) == []
    new = {"app": "a", "n": 1, "dropped": 0, "met": None, "exec_sum": 0.1, "exec_sumsq": 0.01, "wait_sum": 0.0,
           "latency_sum": 0.1, "batch_sum": 4, "exec_hist": {"-116": 1}, "latency_hist": {"-116": 1},
           "exec_by_batch": {"4": {"n": 1, "batch_sum": 4, "hist": {"-116": 1}}}}
    with store.session() as session:
        (old,) = app_windows(session, 0.0, 120.0)
        assert (old.n, old.batch_sum, old.batch_sized, old.exec_by_batch) == (2, 8, 0, {})
        merge_minutes(session, "svc", [{**new, "minute": 60.0}, {**new, "minute": 120.0}])
    with store.engine.connect() as conn:
        kept = dict(conn.execute(text("SELECT minute, exec_by_batch FROM serving_minutes ORDER BY minute")).all())
    assert kept[60.0] is None  # part of it has no batch sizes: none (SQL NULL, as before 0016)
    with store.session() as session:
        (w,) = app_windows(session, 0.0, 1000.0)
    assert (w.n, w.batch_sized, {c: sc.n for c, sc in w.exec_by_batch.items()}) == (4, 1, {4: 1})
    downgrade(store, "0015")
    with store.engine.connect() as conn:
        assert "exec_by_batch" not in {c["name"] for c in inspect(conn).get_columns("serving_minutes")}
        assert conn.execute(text("SELECT sum(n) FROM serving_minutes")).scalar() == 4
    assert upgrade(store) == head_revision()


def test_0016_serving_minutes_batch_sizes_on_sqlite(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'b.db'}")
    try:
        _serving_batch_sizes(store)
    finally:
        store.dispose()


@pytest.mark.pg
def test_0016_serving_minutes_batch_sizes_on_postgresql(pg_url):
    store = Store(pg_url)
    try:
        _serving_batch_sizes(store)
    finally:
        store.dispose()
