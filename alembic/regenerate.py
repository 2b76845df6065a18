"""Rewrite the initial migration from the models (`make migration`); only while no release has shipped."""

import tempfile
from pathlib import Path

from alembic import command
from store.db import Store
from store.migrations import ALEMBIC_DIR, alembic_config

for old in (ALEMBIC_DIR / "versions").glob("0001_*.py"):
    old.unlink()
with tempfile.TemporaryDirectory() as tmp:
    store = Store(f"sqlite:///{Path(tmp) / 'empty.db'}")
    command.revision(alembic_config(store), message="initial schema", autogenerate=True, rev_id="0001")
for path in (ALEMBIC_DIR / "versions").glob("0001_*.py"):
    # alembic renders JSONB's astext_type without its module prefix
    path.write_text(path.read_text().replace("astext_type=Text()", "astext_type=sa.Text()"))
    print("wrote", path)
