"""slurm_jobs.gpus_by_node: the GPUs a Slurm job holds on every node it runs on, not only on its batch script's node

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 09:00:00

A job on several nodes holds GPUs on each (squeue's gres_detail, one entry per node); the row kept only the batch
node's (`node`, `gpu_indices`), which stay, as they were, for code that reads them. The new column is
[[node, [GPU index, ...]], ...], sorted by node, the same value as the workflow's `slurm_gpus` label. The upgrade fills
the rows written before it: a row holding GPUs takes its workflow's label when the label names the row's batch node
with the same GPUs (the import wrote both in one transaction, so a job on several nodes keeps all of them), else
[[node, gpu_indices]]; a row holding none gets []. The downgrade drops the column; `node` and `gpu_indices` are
still right for the code before it.
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

slurm_jobs = sa.table('slurm_jobs', sa.column('workflow_id', sa.String()), sa.column('node', sa.String()),
                      sa.column('gpu_indices', JSON), sa.column('gpus_by_node', JSON))
workflows = sa.table('workflows', sa.column('id', sa.String()), sa.column('labels', JSON))


def upgrade() -> None:
    with op.batch_alter_table("slurm_jobs") as batch_op:
        batch_op.add_column(sa.Column("gpus_by_node", JSON, nullable=False, server_default=sa.text("'[]'")))
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(slurm_jobs.c.workflow_id, slurm_jobs.c.node, slurm_jobs.c.gpu_indices, workflows.c.labels)
        .join(workflows, workflows.c.id == slurm_jobs.c.workflow_id, isouter=True)
        .where(slurm_jobs.c.node.is_not(None))).all()
    filled = [{"wid": wid, "by_node": by_node} for wid, node, indices, labels in rows
              if (by_node := _by_node(node, indices, labels))]
    if filled:
        conn.execute(slurm_jobs.update().where(slurm_jobs.c.workflow_id == sa.bindparam("wid"))
                     .values(gpus_by_node=sa.bindparam("by_node")), filled)


def _by_node(node: str, indices: Any, labels: Any) -> list[list[Any]]:
    """The row's GPUs on every node: the label's when it agrees with the row on the batch node, else the row's."""
    indices = [int(i) for i in indices or []]
    if not indices:
        return []
    label = (labels or {}).get("slurm_gpus") if isinstance(labels, dict) else None
    if isinstance(label, list) and [node, indices] in label:
        return sorted([str(n), [int(i) for i in ix]] for n, ix in label)
    return [[node, indices]]


def downgrade() -> None:
    with op.batch_alter_table("slurm_jobs") as batch_op:
        batch_op.drop_column("gpus_by_node")
