"""traces.claim_token, claimed_at, attempts: which run analyses a trace, when it last said so, how many tried

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 14:20:00

A run sets a trace 'analyzing' before its analysis. A run killed outright (the OOM killer, SIGKILL, its host down)
left it so for good under `fleetlens serve`. Now a run's claim is its random `claim_token`, renewed in `claimed_at`
while it works; a claim not renewed for a whole lease (FLEETLENS_TRACE_CLAIM_TIMEOUT_S) is a dead run's and the next
run retakes the trace; `attempts` counts the claims, and past FLEETLENS_TRACE_MAX_ATTEMPTS the trace is failed.
The upgrade leaves the columns NULL and attempts 0: a trace an older fleetlens left 'analyzing' has no claim time,
so the next run retakes it at once (analyzer.traces.claims). The downgrade drops them.
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("traces") as batch_op:
        batch_op.add_column(sa.Column("claim_token", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("claimed_at", sa.Double(), nullable=True))
        batch_op.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("traces") as batch_op:
        batch_op.drop_column("attempts")
        batch_op.drop_column("claimed_at")
        batch_op.drop_column("claim_token")
