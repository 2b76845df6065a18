"""serving raw requests: optional, capped per workflow, the excess counted

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'serving_requests',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('workflow_id', sa.String(length=512), sa.ForeignKey('workflows.id', ondelete='CASCADE'),
                  nullable=False),
        sa.Column('app', sa.String(length=255), nullable=False),
        sa.Column('arrival', sa.Double(), nullable=False),
        sa.Column('wait_s', sa.Double(), nullable=False),
        sa.Column('exec_s', sa.Double(), nullable=False),
        sa.Column('latency_s', sa.Double(), nullable=False),
        sa.Column('batch_size', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_serving_requests_workflow_arrival', 'serving_requests', ['workflow_id', 'arrival'])
    op.create_table(
        'serving_raw_counts',
        sa.Column('workflow_id', sa.String(length=512), sa.ForeignKey('workflows.id', ondelete='CASCADE'),
                  primary_key=True),
        sa.Column('stored', sa.BigInteger(), nullable=False),
        sa.Column('over_cap', sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('serving_raw_counts')
    op.drop_index('ix_serving_requests_workflow_arrival', table_name='serving_requests')
    op.drop_table('serving_requests')
