"""A step summary the database refuses (a value out of its column's range the socket does not check: here the rank)
loses nothing else: the agent writes the
other rows of the same write, gives up the refused one alone, counts it in its stats and says so once per workflow
and kind; and the database going away while the write is being split keeps every row not yet written."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import select

from collector import protocol as p
from collector import sdk_handlers
from collector.agent import Agent
from collector.sdk_handlers import SdkHandlers
from store.db import Store
from store.errors import DatabaseUnavailable
from store.models import StepStat, Workflow
from store.settings import Settings
from tests.collector.agent_helpers import StubSource

TOO_BIG = 10**20  # no INTEGER column holds it: PostgreSQL and SQLite both refuse the row


def _batch(first: int, last: int, *, n: int | None = None) -> dict:
    return {"first_step": first, "last_step": last, "n_steps": n if n is not None else last - first + 1,
            "ts_start": 1000.0 + first, "ts_end": 1001.0 + first, "mean_s": 0.1, "p50_s": 0.1, "p95_s": 0.1,
            "max_s": 0.1, "mem_persistent": 1_000_000, "mem_peak": 1_500_000, "mem_source": "rss"}


def _steps(workflow: str, batches: list[dict], rank: int = 0) -> dict:
    return {"op": p.STEPS, "v": p.VERSION, "workflow": workflow, "pid": 4242, "rank": rank, "name": workflow,
            "batches": batches}


def _stored(store: Store) -> dict[str, list[int]]:
    with store.session() as s:
        rows = s.execute(select(StepStat.workflow_id, StepStat.first_step).order_by(StepStat.first_step)).all()
    out: dict[str, list[int]] = {}
    for wf, first in rows:
        out.setdefault(wf, []).append(first)
    return out


def test_a_refused_step_summary_loses_no_other_row(any_store: Store, fleet_home: Path, caplog) -> None:
    settings = Settings()
    agent = Agent(any_store, settings, StubSource(n=1), host_id="h-refused", flush_interval_s=3600,
                  serve_socket=True)
    handlers = agent.sdk_handler
    assert isinstance(handlers, SdkHandlers)
    handlers.sync_interval_s = 3600  # written when the test flushes: every message below lands in one write
    agent.start()
    try:
        conn = p.AgentConnection(settings.socket_path)
        try:
            # two jobs; the second sends two summaries with a rank no INTEGER column holds
            assert conn.request(_steps("wf-good", [_batch(0, 9), _batch(10, 19)]))["ok"]
            assert conn.request(_steps("wf-bad", [_batch(0, 9)]))["ok"]
            assert conn.request(_steps("wf-bad", [_batch(10, 19), _batch(20, 21)], rank=TOO_BIG))["ok"]
            assert conn.request(_steps("wf-good", [_batch(20, 29)]))["ok"]
        finally:
            conn.close()
        with caplog.at_level(logging.ERROR, logger="collector.sdk_handlers"):
            agent.flush_sdk()
            agent.flush_sdk()  # nothing is left queued: a second flush writes and says nothing more
    finally:
        agent.stop()

    assert _stored(any_store) == {"wf-good": [0, 10, 20], "wf-bad": [0]}
    assert agent.stats.sdk_rows_refused == 2
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, refused  # once for the workflow and kind, with how many rows and the database's reason
    assert "2 step summaries of workflow 'wf-bad'" in refused[0]
    assert "out of range" in refused[0] or "too large" in refused[0]  # PostgreSQL's reason, SQLite's
    with any_store.session() as s:  # the memory figures written with the rows are not lost either
        assert s.get(Workflow, "wf-good").mem_persistent == 1_000_000
        assert s.get(Workflow, "wf-bad").mem_persistent == 1_000_000


class _GoesAway:
    """The store until `after` sessions were opened, then a database that cannot be reached (a real one, on a port
    nothing listens on)."""

    def __init__(self, store: Store, after: int) -> None:
        self._store, self._left = store, after
        self._down = Store("postgresql+psycopg://nobody@127.0.0.1:1/none", connect_timeout_s=1)

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def session(self):
        self._left -= 1
        return (self._store if self._left >= 0 else self._down).session()


@pytest.mark.parametrize("after", [1, 4, 8])
def test_the_database_going_away_while_a_refused_write_is_split_keeps_every_unwritten_row(
        any_store: Store, fleet_home: Path, after: int) -> None:
    handlers = SdkHandlers(any_store, "h-split", Settings(), sync_interval_s=3600)
    assert handlers.handle(_steps("wf-a", [_batch(0, 9)]))["ok"]
    assert handlers.handle(_steps("wf-a", [_batch(10, 19)], rank=TOO_BIG))["ok"]
    assert handlers.handle(_steps("wf-a", [_batch(20, 29)]))["ok"]
    assert handlers.handle(_steps("wf-b", [_batch(0, 9), _batch(10, 19)]))["ok"]
    handlers.store = _GoesAway(any_store, after)  # the whole write refused; gone after `after` sessions of the split
    with pytest.raises(DatabaseUnavailable):
        handlers.flush()
    written = _stored(any_store)
    handlers.store = any_store  # back
    handlers.flush()
    handlers.close()
    assert _stored(any_store) == {"wf-a": [0, 20], "wf-b": [0, 10]}  # every good row once, none twice
    assert handlers.stats.sdk_rows_refused == 1
    assert sum(map(len, written.values())) < 4  # the database did go away before the split was done


def test_step_summaries_past_the_queue_cap_during_an_outage_are_counted_and_logged_once(
        any_store: Store, fleet_home: Path, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the database was away, the oldest step summaries past the cap were dropped with no count the agent
    showed and no line in the log."""
    monkeypatch.setattr(sdk_handlers, "MAX_QUEUED_STEP_ROWS", 3)
    handlers = SdkHandlers(any_store, "h-cap", Settings(), sync_interval_s=3600)
    handlers.store = _GoesAway(any_store, 0)  # away from the start
    with caplog.at_level(logging.WARNING, logger="collector.sdk_handlers"):
        for first in range(0, 50, 10):  # five summaries, one message each
            assert handlers.handle(_steps("wf-a", [_batch(first, first + 9)]))["ok"]
        with pytest.raises(DatabaseUnavailable):
            handlers.flush()
        assert handlers.handle(_steps("wf-a", [_batch(50, 59)]))["ok"]
    assert handlers.stats.sdk_rows_over_cap == 3
    over = [r.getMessage() for r in caplog.records if "sdk_rows_over_cap" in r.getMessage()]
    assert len(over) == 1, over  # once for the outage, not once a row
    handlers.store = any_store  # back: the newest three are written
    handlers.flush()
    handlers.close()
    assert _stored(any_store) == {"wf-a": [30, 40, 50]}
