"""Schema revisions: upgrade a database with alembic, and refuse one this code does not understand."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.exc import DBAPIError, OperationalError

from alembic import command
from store.db import Store
from store.errors import SchemaError
from store.partitions import ensure_partitions

PROJECT_ROOT = Path(__file__).resolve().parent.parent
ALEMBIC_DIR = PROJECT_ROOT / "alembic"


def alembic_config(store: Store | None = None) -> Config:
    cfg = Config(str(PROJECT_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ALEMBIC_DIR))
    if store is not None:
        cfg.attributes["store"] = store
    return cfg


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    return heads[0]


def known_revisions() -> set[str]:
    return {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def current_revision(store: Store) -> str | None:
    try:
        with store.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except (OperationalError, DBAPIError) as exc:
        raise store.unavailable(exc) from None


def _refuse_newer(store: Store, current: str | None) -> None:
    if current is not None and current not in known_revisions():
        raise SchemaError(
            f"the database at {store.masked_url} is at schema revision {current}, newer than this "
            f"fleetlens knows (head {head_revision()}); upgrade fleetlens, or point FLEETLENS_DB_URL elsewhere"
        )


def upgrade(store: Store, revision: str = "head") -> str:
    """Create or upgrade the schema; returns the revision the database is at afterwards."""
    store.ping()
    _refuse_newer(store, current_revision(store))
    try:
        command.upgrade(alembic_config(store), revision)
        ensure_partitions(store)  # today's and the next days' sample partitions (PostgreSQL)
    except (OperationalError, DBAPIError) as exc:
        raise store.unavailable(exc) from None
    return current_revision(store) or "base"


def downgrade(store: Store, revision: str = "base") -> None:
    command.downgrade(alembic_config(store), revision)


def check_schema(store: Store) -> str:
    """The database's revision if it is this code's head; otherwise a SchemaError saying what to do."""
    current = current_revision(store)
    if current is None:
        raise SchemaError(f"the database at {store.masked_url} has no fleetlens schema; run `fleetlens init`")
    _refuse_newer(store, current)
    if current != head_revision():
        raise SchemaError(
            f"the database at {store.masked_url} is at schema revision {current}, older than this "
            f"fleetlens ({head_revision()}); run `fleetlens init` to upgrade it"
        )
    return current
