"""host events: what an agent did or met on its host outside any one job (the MPS daemon)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 17:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    op.create_table(
        'host_events',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), primary_key=True),
        sa.Column('ts', sa.Double(), nullable=False, index=True),
        sa.Column('host_id', sa.String(length=255), sa.ForeignKey('hosts.id', ondelete='CASCADE'), nullable=False,
                  index=True),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('level', sa.String(length=16), nullable=False),
        sa.Column('message', sa.Text(), nullable=False),
        sa.Column('detail', JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table('host_events')
