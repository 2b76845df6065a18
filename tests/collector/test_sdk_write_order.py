"""The agent's side of the job SDK writes a job's steps before its goodbye: a workflow is never 'finished' in the
store while steps it sent before saying goodbye are still queued, however the messages and the writes interleave."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from collector import protocol as p
from collector.sdk_handlers import SdkHandlers
from store.errors import DatabaseUnavailable
from store.models import StepStat, Workflow
from store.settings import get_settings


def _msg(op: str, **fields) -> dict:
    return {"op": op, "v": p.VERSION, "workflow": "wf-order", "pid": 4242, "rank": 0, **fields}


def _batch(first: int, last: int) -> dict:
    n = last - first + 1
    return {"first_step": first, "last_step": last, "n_steps": n, "ts_start": 1000.0 + first, "ts_end": 1000.0 + last,
            "mean_s": 0.1, "p50_s": 0.1, "p95_s": 0.1, "max_s": 0.1, "mem_persistent": None, "mem_peak": None,
            "mem_source": None}


def test_a_goodbye_that_arrives_while_steps_are_written_waits_for_its_steps(sqlite_store, fleet_home) -> None:
    handler = SdkHandlers(sqlite_store, "h1", get_settings(fresh=True))
    assert handler.handle(_msg(p.HELLO, name="wf-order", total_steps=10, start_step=0, lane=None,
                               id_source="env"))["ok"]
    assert handler.handle(_msg(p.STEPS, batches=[_batch(0, 4)]))["ok"]
    write_steps = handler._write_steps

    def write_then_the_job_finishes() -> None:
        write_steps()  # steps 0-4 written; meanwhile the job sends its last steps and says goodbye
        assert handler.handle(_msg(p.STEPS, batches=[_batch(5, 9)]))["ok"]
        assert handler.handle(_msg(p.BYE, outcome="finished", last_step=9))["ok"]

    handler._write_steps = write_then_the_job_finishes
    handler.flush()
    handler._write_steps = write_steps

    def state() -> tuple[str | None, int]:
        with sqlite_store.session() as s:
            wf = s.get(Workflow, "wf-order")
            last = s.scalar(select(func.max(StepStat.last_step)).where(StepStat.workflow_id == "wf-order"))
            return (wf.state if wf else None), last

    assert state() == ("running", 4)  # the goodbye waits: its steps are not in the store yet
    handler.flush()
    assert state() == ("finished", 9)


def _memory_batch(first: int, last: int) -> dict:
    return {**_batch(first, last), "mem_persistent": 1_000_000, "mem_peak": 1_500_000, "mem_source": "rss"}


def _during_the_next_write(handler: SdkHandlers, action) -> None:
    """Run `action` once, while the handler's next write is inside its database session."""
    store, session = handler.store, handler.store.session
    done = []

    class Interleaving:
        def __getattr__(self, name):
            return getattr(store, name)

        def session(self):
            if not done:
                done.append(True)
                action()
            return session()

    handler.store = Interleaving()


def test_memory_reported_while_steps_are_written_reaches_the_workflow(sqlite_store, fleet_home) -> None:
    handler = SdkHandlers(sqlite_store, "h1", get_settings(fresh=True))
    assert handler.handle(_msg(p.HELLO, name="wf-order", total_steps=10, start_step=0, lane=None,
                               id_source="env"))["ok"]
    assert handler.handle(_msg(p.STEPS, batches=[_memory_batch(0, 4)]))["ok"]
    # the job's last summary, with its memory, arrives while the first is being written
    _during_the_next_write(handler, lambda: handler.handle(_msg(p.STEPS, batches=[_memory_batch(5, 9)])))
    handler.flush()
    handler.flush()
    with sqlite_store.session() as s:
        wf = s.get(Workflow, "wf-order")
        assert wf.labels["mem_steps"] == 10 and wf.labels["mem_source"] == "rss"
        firsts = s.scalars(select(StepStat.first_step).where(StepStat.workflow_id == "wf-order")
                           .order_by(StepStat.first_step)).all()
    assert firsts == [0, 5]


def test_steps_kept_while_the_database_is_away_stay_in_order_with_later_ones(sqlite_store, fleet_home) -> None:
    handler = SdkHandlers(sqlite_store, "h1", get_settings(fresh=True))
    assert handler.handle(_msg(p.HELLO, name="wf-order", total_steps=15, start_step=0, lane=None,
                               id_source="env"))["ok"]
    assert handler.handle(_msg(p.STEPS, batches=[_memory_batch(0, 4)]))["ok"]

    def away() -> None:
        assert handler.handle(_msg(p.STEPS, batches=[_memory_batch(5, 9)]))["ok"]
        raise DatabaseUnavailable("the database is away")

    _during_the_next_write(handler, away)
    with pytest.raises(DatabaseUnavailable):
        handler.flush()
    assert [r["first_step"] for r in handler._step_rows] == [0, 5]
    assert handler.handle(_msg(p.STEPS, batches=[_memory_batch(10, 14)]))["ok"]
    handler.flush()
    handler.flush()
    with sqlite_store.session() as s:
        rows = s.execute(select(StepStat.first_step, StepStat.id).where(StepStat.workflow_id == "wf-order")
                         .order_by(StepStat.id)).all()
        assert [first for first, _ in rows] == [0, 5, 10]  # written in the order the job sent them
        assert s.get(Workflow, "wf-order").labels["mem_steps"] == 15
