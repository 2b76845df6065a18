"""A concurrent writer that stops a transaction is told apart from an outage: a PostgreSQL deadlock's victim and a
SQLite write still locked when its busy timeout runs out raise DatabaseBusy (a DatabaseUnavailable, so writers keep
their batches and retry), with a message that names the cause, and nothing of the stopped transaction is kept."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from sqlalchemy import text

from store.db import Store
from store.errors import DatabaseBusy, DatabaseUnavailable
from store.models import Workflow
from store.workflows import upsert_workflow


@pytest.mark.pg
def test_a_deadlock_victim_raises_database_busy_and_keeps_nothing(pg_store: Store) -> None:
    with pg_store.session() as s:
        for wf in ("a", "b"):
            upsert_workflow(s, wf, id_source="env", now=1.0)
    barrier = threading.Barrier(2)
    outcome: dict[str, BaseException | None] = {}

    def writer(name: str, first: str, second: str) -> None:
        store = Store(pg_store.url)
        try:
            with store.session() as s:
                upsert_workflow(s, first, team=name, now=2.0)  # holds the first row's lock
                barrier.wait(timeout=30)
                upsert_workflow(s, second, team=name, now=2.0)  # waits on the other's: a deadlock
            outcome[name] = None
        except BaseException as exc:
            outcome[name] = exc
        finally:
            store.dispose()

    threads = [threading.Thread(target=writer, args=("one", "a", "b")),
               threading.Thread(target=writer, args=("two", "b", "a"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    errors = {name: exc for name, exc in outcome.items() if exc is not None}
    assert len(outcome) == 2 and len(errors) == 1, outcome
    (loser, exc), = errors.items()
    assert isinstance(exc, DatabaseBusy) and isinstance(exc, DatabaseUnavailable)
    assert "another writer held rows" in str(exc) and "deadlock" in str(exc).lower()
    winner = ({"one", "two"} - {loser}).pop()
    with pg_store.session() as s:  # the winner's two writes, none of the loser's
        assert {s.get(Workflow, wf).team for wf in ("a", "b")} == {winner}


def test_a_sqlite_write_locked_past_its_timeout_raises_database_busy(sqlite_store: Store) -> None:
    with sqlite_store.session() as s:
        upsert_workflow(s, "a", id_source="env", now=1.0)
    path = sqlite_store.engine.url.database
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process's write transaction
        with pytest.raises(DatabaseBusy, match="another writer held rows.*locked"), sqlite_store.session() as s:
            s.connection().exec_driver_sql("PRAGMA busy_timeout=0")  # give up at once instead of after 30 s
            upsert_workflow(s, "a", team="vision", now=2.0)
            s.flush()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with sqlite_store.session() as s:
        s.connection().exec_driver_sql("PRAGMA busy_timeout=30000")
        wf = s.get(Workflow, "a")
        assert (wf.team, wf.last_seen) == (None, 1.0)
        assert s.execute(text("SELECT count(*) FROM workflows")).scalar_one() == 1
