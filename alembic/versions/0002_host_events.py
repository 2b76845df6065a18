"""host events: what an agent did or met on its host outside any one job (the MPS daemon)

Revision ID: 0002_host_events
Revises: 0001
Create Date: 2026-11-23 17:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0002_host_events'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('host_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('host_id', sa.String(length=255), nullable=False),
    sa.Column('ts', sa.Double(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('level', sa.String(length=16), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('detail', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('host_events', schema=None) as batch_op:
        batch_op.create_index('ix_host_events_host_ts', ['host_id', 'ts'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('host_events', schema=None) as batch_op:
        batch_op.drop_index('ix_host_events_host_ts')
    op.drop_table('host_events')
