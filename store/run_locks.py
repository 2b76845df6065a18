"""One run at a time of a long job that writes the store (an import), across processes and hosts.

PostgreSQL: a session-level advisory lock, on a connection of its own in autocommit (no transaction, so no snapshot
is held for the job's length), released when the job ends or the connection drops. SQLite: a lock on a file beside
the database (flock): the database's own write lock would stop every other writer (agents' samples) for as long.
Nothing waits: a run that finds the lock taken is told so at once.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, OperationalError

from store.db import Store


@contextmanager
def single_run(store: Store, name: str) -> Iterator[bool]:
    """Hold the lock `name` while the block runs; yields False, holding nothing, when another run holds it."""
    if store.is_postgres:
        # the key is the schema's and the name's, as store.partitions.create_day's: stores in two schemas of one
        # server (a test database's) do not hold each other's locks
        try:
            conn = store.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except OperationalError as exc:
            raise store.unavailable(exc) from None
        try:
            held = bool(conn.scalar(text("SELECT pg_try_advisory_lock(hashtext(current_schema() || '.' || :key))"),
                                    {"key": name}))
        except OperationalError as exc:
            conn.close()
            raise store.unavailable(exc) from None
        try:
            yield held
        finally:
            try:
                if held:
                    conn.execute(text("SELECT pg_advisory_unlock(hashtext(current_schema() || '.' || :key))"),
                                 {"key": name})
            except DBAPIError:  # the connection is lost, and its session's locks with it
                pass
            finally:
                conn.close()
        return
    database = store.url.database
    if not database or database == ":memory:":  # one process's own database: nobody else writes it
        yield True
        return
    path = Path(database).expanduser().resolve()
    with open(path.with_name(f"{path.name}.{name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
