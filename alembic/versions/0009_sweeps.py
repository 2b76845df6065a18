"""sweeps: hyper-parameter sweeps sized by Fluid, and every start, resize, hold-back and end of their trials

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 05:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    json = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')
    op.create_table(
        'sweeps',
        sa.Column('id', sa.String(length=255), nullable=False),
        sa.Column('engine', sa.String(length=32), nullable=False),
        sa.Column('gpus', sa.Integer(), nullable=False),
        sa.Column('settings', json, nullable=False),
        sa.Column('created_at', sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_table(
        'sweep_events',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('sweep_id', sa.String(length=255), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('ts', sa.Double(), nullable=False),
        sa.Column('trial_id', sa.String(length=255), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('old_width', sa.Double(), nullable=False),
        sa.Column('new_width', sa.Double(), nullable=False),
        sa.Column('steps_left', sa.Double(), nullable=True),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_sweep_events_sweep_seq', 'sweep_events', ['sweep_id', 'seq'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_sweep_events_sweep_seq', table_name='sweep_events')
    op.drop_table('sweep_events')
    op.drop_table('sweeps')
