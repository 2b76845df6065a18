"""serving: per-application per-minute request histograms and SLOs of serving workflows

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 05:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), 'postgresql')


def upgrade() -> None:
    op.create_table(
        'serving_minutes',
        sa.Column('workflow_id', sa.String(length=512), sa.ForeignKey('workflows.id', ondelete='CASCADE'),
                  primary_key=True),
        sa.Column('app', sa.String(length=255), primary_key=True),
        sa.Column('minute', sa.Double(), primary_key=True, autoincrement=False),
        sa.Column('n', sa.BigInteger(), nullable=False),
        sa.Column('dropped', sa.BigInteger(), nullable=False),
        sa.Column('met', sa.BigInteger(), nullable=True),
        sa.Column('exec_sum', sa.Double(), nullable=False),
        sa.Column('exec_sumsq', sa.Double(), nullable=False),
        sa.Column('wait_sum', sa.Double(), nullable=False),
        sa.Column('latency_sum', sa.Double(), nullable=False),
        sa.Column('batch_sum', sa.BigInteger(), nullable=False),
        sa.Column('devices', sa.Integer(), nullable=False),
        sa.Column('exec_hist', JSON, nullable=False),
        sa.Column('latency_hist', JSON, nullable=False),
    )
    op.create_index('ix_serving_minutes_minute', 'serving_minutes', ['minute'])
    op.create_table(
        'serving_apps',
        sa.Column('workflow_id', sa.String(length=512), sa.ForeignKey('workflows.id', ondelete='CASCADE'),
                  primary_key=True),
        sa.Column('app', sa.String(length=255), primary_key=True),
        sa.Column('slo_s', sa.Double(), nullable=True),
        sa.Column('target', sa.Double(), nullable=False),
        sa.Column('updated_at', sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('serving_apps')
    op.drop_index('ix_serving_minutes_minute', table_name='serving_minutes')
    op.drop_table('serving_minutes')
