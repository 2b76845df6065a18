"""telemetry hours: each closed hour's summary for the telemetry detectors (statistics, histograms, runs)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'telemetry_hours',
        sa.Column('hour', sa.Double(), primary_key=True, autoincrement=False),
        sa.Column('key', sa.String(length=64), nullable=False),
        sa.Column('computed_at', sa.Double(), nullable=False),
        sa.Column('first_ts', sa.Double(), nullable=True),
        sa.Column('last_end', sa.Double(), nullable=True),
        sa.Column('pairs', sa.LargeBinary(), nullable=False),
        sa.Column('hist', sa.LargeBinary(), nullable=False),
        sa.Column('runs', sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('telemetry_hours')
