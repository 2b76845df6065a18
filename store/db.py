"""`Store`: one engine and its session factory, with SQLite tuned for a busy agent and PostgreSQL via psycopg 3."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from store.errors import ConfigError, DatabaseBusy, DatabaseFull, DatabaseReadOnly, DatabaseUnavailable
from store.settings import Settings


def mask_url(url: str | URL) -> str:
    """The URL with any password replaced by ***, safe to print."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<malformed URL>"


def parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(
            f"FLEETLENS_DB_URL is not a database URL: {url!r}; use e.g. sqlite:////path/fleetlens.db "
            "or postgresql+psycopg://user@host:5432/db"
        ) from None
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise ConfigError(f"FLEETLENS_DB_URL names {backend!r}; fleetlens runs on sqlite or postgresql")
    if backend == "postgresql" and parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3, never psycopg2
    return parsed


def is_read_only(exc: BaseException) -> bool:
    """PostgreSQL refused a write because the server or the transaction is read-only (SQLSTATE 25006)."""
    return getattr(getattr(exc, "orig", exc), "sqlstate", None) == "25006"


def is_disk_full(exc: BaseException) -> bool:
    """PostgreSQL out of disk (SQLSTATE 53100), or SQLite's file or page limit reached."""
    orig = getattr(exc, "orig", exc)
    return getattr(orig, "sqlstate", None) == "53100" or "database or disk is full" in str(orig)


def is_contention(exc: BaseException) -> bool:
    """A concurrent writer stopped the transaction: PostgreSQL's deadlock victim or serialization failure (SQLSTATE
    class 40, transaction rollback), or SQLite still locked when its busy timeout ran out."""
    orig = getattr(exc, "orig", exc)
    if str(getattr(orig, "sqlstate", None) or "").startswith("40"):
        return True
    return isinstance(orig, sqlite3.OperationalError) and "locked" in str(orig).lower()


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


class Store:
    """The database fleetlens reads and writes. Functions take a Store; there is no global one."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0, echo: bool = False,
                 pool_size: int | None = None) -> None:
        """`pool_size` (PostgreSQL): connections kept open; 0 opens one per use and closes it after, so thousands
        of agents that write every few seconds hold no server connection between writes (None: SQLAlchemy's 5)."""
        self.url = parse_url(url)
        self.dialect = self.url.get_backend_name()
        kwargs: dict = {"echo": echo, "future": True}
        if self.dialect == "sqlite":
            db = self.url.database
            if db and db != ":memory:":
                folder = Path(db).expanduser().resolve().parent
                if not folder.is_dir():
                    raise ConfigError(f"the SQLite database's folder {folder} does not exist; run `fleetlens init`")
            kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        else:
            kwargs["connect_args"] = {"connect_timeout": max(1, int(connect_timeout_s))}
            kwargs["pool_pre_ping"] = True
            if pool_size == 0:
                kwargs["poolclass"] = NullPool
                del kwargs["pool_pre_ping"]  # a fresh connection each time needs no ping
            elif pool_size is not None:
                kwargs["pool_size"] = pool_size
        try:
            self.engine: Engine = create_engine(self.url, **kwargs)
        except (ArgumentError, NoSuchModuleError) as exc:
            raise ConfigError(f"FLEETLENS_DB_URL {mask_url(self.url)} cannot be used: {exc}") from None
        if self.dialect == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> Store:
        return cls(settings.resolved_db_url, pool_size=settings.db_pool_size)

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on any error.

        A database that cannot be reached raises DatabaseUnavailable, so callers can spool or retry.
        """
        session = self._sessions()
        try:
            yield session
            session.commit()
        except OperationalError as exc:
            session.rollback()
            raise self.unavailable(exc) from None
        except DBAPIError as exc:
            session.rollback()
            if is_read_only(exc):
                raise self.read_only(exc) from None
            raise
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def unavailable(self, exc: BaseException) -> DatabaseUnavailable:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0] if str(exc) else type(exc).__name__
        if is_contention(exc):
            return DatabaseBusy(
                f"another writer held rows this transaction needed at {self.masked_url} ({reason}); nothing of it "
                "was written, and writers keep their batches and try again"
            )
        if is_disk_full(exc):
            return DatabaseFull(
                f"the database at {self.masked_url} is full ({reason}), nothing was written; free space on its "
                "disk or grow its volume (writers keep their batches until then)"
            )
        return DatabaseUnavailable(
            f"cannot reach the database at {self.masked_url} ({reason}); "
            "check FLEETLENS_DB_URL and that the database server is running"
        )

    def read_only(self, exc: BaseException) -> DatabaseReadOnly:
        return DatabaseReadOnly(
            f"the database at {self.masked_url} is read-only, nothing was written; point FLEETLENS_DB_URL at the "
            "primary, or make the database writable again (writers keep their batches until then)"
        )

    def ping(self) -> None:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except (OperationalError, DBAPIError) as exc:
            raise self.unavailable(exc) from None

    def table_names(self) -> set[str]:
        try:
            return set(inspect(self.engine).get_table_names())
        except (OperationalError, DBAPIError) as exc:
            raise self.unavailable(exc) from None

    def dispose(self) -> None:
        self.engine.dispose()
