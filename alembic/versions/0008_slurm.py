"""slurm: what Slurm says of its jobs (slurm_jobs), and what an actuator needs to carry a move on (actions.detail)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 05:25:00

collector.importers.slurm writes one slurm_jobs row per Slurm job it sees (workflow `slurm-<id>`); the Slurm actuator
(enforcer.actuators.slurm) records its moves as actions with engine 'slurm' and keeps the job id and the gres before
and after in actions.detail, so a move can be carried on or rolled back after a restart of the enforcer.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
FLOAT = sa.Double()


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch_op:
        batch_op.add_column(sa.Column("detail", JSON, nullable=True))
    op.create_table(
        "slurm_jobs",
        sa.Column("workflow_id", sa.String(length=512), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("submit_time", FLOAT, nullable=False),
        sa.Column("name", sa.String(length=255), nullable=True),
        sa.Column("user", sa.String(length=255), nullable=True),
        sa.Column("account", sa.String(length=255), nullable=True),
        sa.Column("partition", sa.String(length=255), nullable=True),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("time_limit_s", FLOAT, nullable=True),
        sa.Column("gres", sa.String(length=255), nullable=True),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("shards", sa.Integer(), nullable=False),
        sa.Column("gpu_indices", JSON, nullable=False),
        sa.Column("requeue", sa.Boolean(), nullable=False),
        sa.Column("restart_count", sa.Integer(), nullable=False),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("opted_in", sa.Boolean(), nullable=False),
        sa.Column("not_movable_reason", sa.Text(), nullable=True),
        sa.Column("seen_at", FLOAT, nullable=False),
        sa.ForeignKeyConstraint(["workflow_id"], ["workflows.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("workflow_id"),
    )
    op.create_index("ix_slurm_jobs_job_id", "slurm_jobs", ["job_id"])
    op.create_index("ix_slurm_jobs_seen_at", "slurm_jobs", ["seen_at"])


def downgrade() -> None:
    op.drop_index("ix_slurm_jobs_seen_at", table_name="slurm_jobs")
    op.drop_index("ix_slurm_jobs_job_id", table_name="slurm_jobs")
    op.drop_table("slurm_jobs")
    with op.batch_alter_table("actions") as batch_op:
        batch_op.drop_column("detail")
