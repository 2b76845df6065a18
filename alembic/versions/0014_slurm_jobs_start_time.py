"""slurm_jobs.start_time: when a Slurm job's current run began, so that a finding on its GPUs counts from it

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 11:00:00

The finding "GPUs held with no process" gives a job a grace period after it starts; it counted from the workflow's
creation (the job's first import, often while it waited in the queue), so a job queued longer than the grace was
flagged the moment it started. The new column is squeue's start_time while the job holds its GPUs (else when the
import first saw it hold them), NULL otherwise.
The upgrade leaves it NULL: every import rewrites the rows of the jobs squeue lists, so a running job has it after
the next import, and until then the finding does not judge it. The downgrade drops the column.
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("slurm_jobs") as batch_op:
        batch_op.add_column(sa.Column("start_time", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("slurm_jobs") as batch_op:
        batch_op.drop_column("start_time")
