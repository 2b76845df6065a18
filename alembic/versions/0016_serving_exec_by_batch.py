"""serving_minutes.exec_by_batch: a minute's execution times per batch-size class, so batching is not taken for a
model's own variation

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 14:00:00

A request's execution time is its batch's, which grows with the batch's size, so the one execution-time histogram of
a minute mixes what batching does with what the model does. The new column keeps, per batch-size class, the class's
request count, the sum of its requests' batch sizes and a histogram of their execution times
(store.batch_sizes). The upgrade leaves it NULL on the rows written before it: their batch sizes are gone, so every
reader falls back to the histogram over all sizes for them, and says so. The downgrade drops the column.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("serving_minutes") as batch_op:
        batch_op.add_column(sa.Column("exec_by_batch", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("serving_minutes") as batch_op:
        batch_op.drop_column("exec_by_batch")
