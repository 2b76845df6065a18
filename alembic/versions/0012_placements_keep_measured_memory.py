"""placements keep the persistent memory P as measured, not P' = 1.1 P: the headroom is applied when read

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 09:00:00

Rows written before this kept P' (the charged persistent memory) in placements.mem_persistent; the upgrade turns each
into P = floor(P' / 1.1) (exactly, in integers: 10 P' // 11), the downgrade back into P' with store.headroom.charged,
the rule the enforcer reads them with. A value may come back a byte off the one it started as (P' was rounded up when
it was charged), never more.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from store.headroom import charged

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

placements = sa.table('placements', sa.column('id', sa.BigInteger()), sa.column('mem_persistent', sa.BigInteger()))


def upgrade() -> None:
    op.execute(placements.update().where(placements.c.mem_persistent.is_not(None))
               .values(mem_persistent=placements.c.mem_persistent * 10 // 11))


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.select(placements.c.id, placements.c.mem_persistent)
                        .where(placements.c.mem_persistent.is_not(None))).all()
    for row_id, persistent in rows:
        conn.execute(placements.update().where(placements.c.id == row_id)
                     .values(mem_persistent=charged(int(persistent))))
