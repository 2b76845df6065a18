"""checkpoints as facts, host storage probes, signed relaunch specs

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 17:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')
_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'checkpoints',
        sa.Column('id', _ID, nullable=False),
        sa.Column('workflow_id', sa.String(length=512), nullable=False),
        sa.Column('action_id', sa.BigInteger(), nullable=True),
        sa.Column('host_id', sa.String(length=255), nullable=False),
        sa.Column('step', sa.Integer(), nullable=True),
        sa.Column('size_bytes', sa.BigInteger(), nullable=False),
        sa.Column('url', sa.Text(), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(['action_id'], ['actions.id'], ondelete='SET NULL'),
        sa.ForeignKeyConstraint(['workflow_id'], ['workflows.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_checkpoints_workflow_created', 'checkpoints', ['workflow_id', 'created_at'], unique=False)
    op.create_table(
        'host_storage',
        sa.Column('host_id', sa.String(length=255), nullable=False),
        sa.Column('url', sa.String(length=1024), nullable=False),
        sa.Column('readable', sa.Boolean(), nullable=False),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('checked_at', sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('host_id', 'url'),
    )
    with op.batch_alter_table('workflows') as batch:
        batch.add_column(sa.Column('checkpoint_url', sa.Text(), nullable=True))
        batch.add_column(sa.Column('spec_env', _JSON, nullable=True))
        batch.add_column(sa.Column('spec_signature', sa.String(length=128), nullable=True))
    with op.batch_alter_table('actions') as batch:
        batch.add_column(sa.Column('checkpoint_id', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('actions') as batch:
        batch.drop_column('checkpoint_id')
    with op.batch_alter_table('workflows') as batch:
        batch.drop_column('spec_signature')
        batch.drop_column('spec_env')
        batch.drop_column('checkpoint_url')
    op.drop_table('host_storage')
    op.drop_index('ix_checkpoints_workflow_created', table_name='checkpoints')
    op.drop_table('checkpoints')
