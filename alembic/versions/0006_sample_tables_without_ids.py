"""sample tables without ids: device_samples and process_samples lose their surrogate id and its primary key

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 20:20:50

Nothing reads a sample by its id, and the primary key's index was one more index for every COPY to keep up
(store/models.py says why the sample tables have no key in the database). Every row is kept.
PostgreSQL (tables partitioned by day, 0002): the constraint goes from the parent and so from every day partition,
then the id column and its sequence. SQLite: batch mode rebuilds each table without the column, its indexes
recreated. The downgrade gives every row an id again from a new sequence (PostgreSQL; the column comes last) or
as SQLite's INTEGER PRIMARY KEY (first, as 0001 made it), and restores the primary key: (id, ts) on a partitioned
table, as PostgreSQL wants the partition key in it; (id) otherwise.
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from store.partitions import SAMPLE_TABLES, is_partitioned

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for table in SAMPLE_TABLES:
        if postgres:
            op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey")
            op.execute(f"ALTER TABLE {table} DROP COLUMN id")  # the sequence it owns (0001, 0002) goes with it
            op.execute(f"DROP SEQUENCE IF EXISTS {table}_id_seq")
        else:
            with op.batch_alter_table(table, recreate="always") as batch_op:
                batch_op.drop_column("id")


def downgrade() -> None:
    bind = op.get_bind()
    for table in SAMPLE_TABLES:
        if bind.dialect.name == "postgresql":
            key = "id, ts" if is_partitioned(bind, table) else "id"
            op.execute(f"CREATE SEQUENCE {table}_id_seq")
            # a volatile default numbers every existing row (each partition rewritten once), then stays the default
            op.execute(f"ALTER TABLE {table} ADD COLUMN id bigint NOT NULL DEFAULT nextval('{table}_id_seq')")
            op.execute(f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id")
            op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY ({key})")
        else:
            # the rows are copied without an id: SQLite numbers them, INTEGER PRIMARY KEY being the rowid
            columns = [c["name"] for c in sa.inspect(bind).get_columns(table)]
            with op.batch_alter_table(table, recreate="always", partial_reordering=[("id", *columns)]) as batch_op:
                batch_op.add_column(sa.Column("id", sa.Integer(), nullable=False, primary_key=True))
