"""Alembic environment: migrates the Store handed in by store.migrations, else FLEETLENS_DB_URL."""

from logging.config import fileConfig

from alembic import context
from store.db import Store
from store.models import Base
from store.partitions import is_partition
from store.settings import get_settings

config = context.config
if config.config_file_name is not None and not config.attributes.get("store"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def run_migrations_online() -> None:
    store = config.attributes.get("store") or Store.from_settings(get_settings())
    sqlite = store.dialect == "sqlite"
    with store.engine.connect() as connection:
        if sqlite:
            # Batch mode rebuilds a table (a column dropped) by copying it, dropping it and renaming the copy; with
            # foreign keys on, SQLite's DROP TABLE deletes every row referencing it (ON DELETE CASCADE: a downgrade
            # of actions would empty action_events, one of workflows the findings). The pragma is a no-op inside a
            # transaction, so it goes off before the migrations' transaction, and on again after it.
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        try:
            with connection.begin():
                context.configure(
                    connection=connection,
                    target_metadata=target_metadata,
                    compare_type=True,
                    # day partitions of the sample tables are made at run time (store/partitions.py), not by
                    # migrations
                    include_name=lambda name, kind, _parents: not (kind == "table" and is_partition(name)),
                    render_as_batch=sqlite,
                )
                with context.begin_transaction():
                    context.run_migrations()
        finally:
            if sqlite:
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()


def run_migrations_offline() -> None:
    context.configure(url=Store.from_settings(get_settings()).url, target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
