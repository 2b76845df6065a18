"""The agent's side of the job SDK writes a job's steps before its goodbye: a workflow is never 'finished' in the
store while steps it sent before saying goodbye are still queued, however the messages and the writes interleave."""

from __future__ import annotations

from sqlalchemy import func, select

from collector import protocol as p
from collector.sdk_handlers import SdkHandlers
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
