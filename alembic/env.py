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
    with store.engine.begin() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            compare_type=True,
            # day partitions of the sample tables are made at run time (store/partitions.py), not by migrations
            include_name=lambda name, kind, _parents: not (kind == "table" and is_partition(name)),
            render_as_batch=store.dialect == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=Store.from_settings(get_settings()).url, target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
