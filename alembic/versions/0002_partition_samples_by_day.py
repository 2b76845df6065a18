"""sample tables partitioned by day on PostgreSQL

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 17:30:00

On PostgreSQL, device_samples and process_samples become tables partitioned by range of ts, one partition per
UTC day plus a DEFAULT partition (see store/partitions.py); their rows are copied over in this transaction, ids
and the id sequence kept. The primary key becomes (id, ts), as PostgreSQL wants the partition key in it.
SQLite (one host) keeps its plain tables: nothing changes there.
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

from store.partitions import DAY, SAMPLE_TABLES, create_day, day_of, default_name

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {
    "device_samples": {"ix_device_samples_device_ts": "device_id, ts", "ix_device_samples_ts": "ts"},
    "process_samples": {"ix_process_samples_workflow_ts": "workflow_id, ts", "ix_process_samples_device_ts":
                        "device_id, ts"},
}


def _swap(table: str, partitioned: bool) -> None:
    bind = op.get_bind()
    old = f"{table}_old"
    op.execute(f"ALTER TABLE {table} RENAME TO {old}")
    op.execute(f"ALTER TABLE {old} RENAME CONSTRAINT {table}_pkey TO {old}_pkey")
    for name in INDEXES[table]:
        op.execute(f"ALTER INDEX {name} RENAME TO {name}_old")
    if partitioned:
        op.execute(f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS) PARTITION BY RANGE (ts)")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id, ts)")
    else:
        op.execute(f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS)")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id)")
    for name, columns in INDEXES[table].items():
        op.execute(f"CREATE INDEX {name} ON {table} ({columns})")
    if partitioned:
        op.execute(f"CREATE TABLE {default_name(table)} PARTITION OF {table} DEFAULT")
        days = {float(d) for (d,) in bind.execute(text(f"SELECT DISTINCT floor(ts / {DAY!r}) * {DAY!r} FROM {old}"))}
        today = day_of(bind.execute(text("SELECT extract(epoch FROM now())")).scalar())
        days |= {today + k * DAY for k in range(-1, 3)}
        for day in sorted(days):
            create_day(bind, table, day)
    op.execute(f"INSERT INTO {table} SELECT * FROM {old}")
    op.execute(f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id")
    op.execute(f"DROP TABLE {old}")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in SAMPLE_TABLES:
        _swap(table, partitioned=True)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in SAMPLE_TABLES:
        _swap(table, partitioned=False)
