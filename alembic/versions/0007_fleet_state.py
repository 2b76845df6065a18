"""fleet state: actions.engine names the actuator that carries each move out

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 05:20:00

A move is carried out by one actuator (enforcer.actuators): signed commands to agents for `fleetlens run` jobs, and
next a Slurm requeue or a Ray Tune resource change. Every existing action was carried out by the agents, so the
column's default ('agents') is what each existing row gets.
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch_op:
        batch_op.add_column(sa.Column("engine", sa.String(length=16), nullable=False, server_default="agents"))


def downgrade() -> None:
    with op.batch_alter_table("actions") as batch_op:
        batch_op.drop_column("engine")
