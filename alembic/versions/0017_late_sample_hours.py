"""late_sample_hours: hours that samples reached after they closed, for the next rollup to roll up again

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 14:30:00

A rollup rolls up each closed hour once. Samples that reach an hour after it closed (an agent's spool sent when the
database came back, an import of the past) were never rolled up: the waste and the ranking, which read the rollups,
undercounted that hour for good. Every sample write now marks the closed hours it wrote into (store.late_hours): one
row per hour, its `version` raised by each write, so the rollup can roll the hour up again and clear the mark only
if no write came since it read it. The upgrade creates the table empty; the downgrade drops it.
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0017'
down_revision: str | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "late_sample_hours",
        sa.Column("hour", sa.Double(), autoincrement=False, nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("hour"),
    )


def downgrade() -> None:
    op.drop_table("late_sample_hours")
