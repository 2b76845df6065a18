"""A benchmark's PostgreSQL line: the database URL the environment names, and a scratch schema dropped at the end.

`bench_pg_url()` is FLEETLENS_BENCH_PG_URL, else FLEETLENS_TEST_PG_URL, else None (the caller says the line is
skipped). `scratch_schema(url)` creates a schema of its own and yields the URL that puts it first on the search
path, so a benchmark's tables never meet anyone else's; the schema is dropped however the block ends.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text

from store.db import Store


def bench_pg_url() -> str | None:
    return os.environ.get("FLEETLENS_BENCH_PG_URL") or os.environ.get("FLEETLENS_TEST_PG_URL") or None


@contextmanager
def scratch_schema(pg_url: str, prefix: str = "bench") -> Iterator[str]:
    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(Store(pg_url).url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        try:
            sep = "&" if "?" in pg_url else "?"
            yield f"{pg_url}{sep}options=-csearch_path%3D{schema}"
        finally:
            with admin.connect() as conn:
                conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    finally:
        admin.dispose()
