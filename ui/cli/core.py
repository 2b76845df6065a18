"""`fleetlens init` and `fleetlens status`: create or upgrade the database, and say what is in it (and which hosts
the enforcer leaves alone)."""

from __future__ import annotations

import time

from rich.table import Table
from sqlalchemy import func, select

from store import models
from store.db import Store
from store.migrations import current_revision, head_revision, upgrade
from store.registry import hosts_left_alone
from ui.cli.app import app, console, settings


@app.command()
def init() -> None:
    """Create FLEETLENS_HOME and create or upgrade the database schema."""
    s = settings()
    s.ensure_home()
    store = Store.from_settings(s)
    revision = upgrade(store)
    s.secret_bytes()
    console.print(f"fleetlens home {s.home}")
    console.print(f"database {store.masked_url} at schema revision {revision}")


@app.command()
def status() -> None:
    """Database URL, schema revision, counts of what the store holds, and the hosts not heard from or taking no
    new job."""
    s = settings()
    store = Store.from_settings(s)
    store.ping()
    revision = current_revision(store)
    head = head_revision()
    table = Table(title="fleetlens status", show_header=False)
    table.add_row("database", store.masked_url)
    note = "" if revision == head else f" (this fleetlens expects {head}; run `fleetlens init`)"
    table.add_row("schema revision", f"{revision or 'none'}{note}")
    if revision is not None:
        counts = {
            "hosts": models.Host,
            "devices": models.Device,
            "workflows": models.Workflow,
            "device samples": models.DeviceSample,
            "process samples": models.ProcessSample,
            "findings": models.Finding,
        }
        with store.session() as session:
            for label, model in counts.items():
                table.add_row(label, str(session.scalar(select(func.count()).select_from(model))))
            # the hosts the enforcer leaves alone, by the store's one rule (`fleetlens enforce` says why)
            silent, closed = hosts_left_alone(session, session.scalars(select(models.Host.id)), s.host_silence_s,
                                              time.time())
            table.add_row("hosts not heard from", _named(silent))
            table.add_row("hosts taking no new job", _named(closed))
    console.print(table)


def _named(hosts: dict[str, str], most: int = 10) -> str:
    """How many hosts, and which (the first `most` by name)."""
    names = sorted(hosts)
    shown = ", ".join(names[:most]) + (f", … ({len(names) - most} more)" if len(names) > most else "")
    return f"{len(names)}" + (f": {shown}" if names else "")
