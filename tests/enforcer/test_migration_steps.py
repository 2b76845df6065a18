"""The migration state machine's steps on store rows alone (no agent, no job): what each step reads decides it."""

from __future__ import annotations

from enforcer.migration import action_log, drive
from store.db import Store
from store.models import Action, Command, StepStat, Workflow
from store.settings import Settings

NOW = 1_000_000.0


def _steps(workflow_id: str, host_id: str, pid: int, first: int, last: int, ts: float) -> StepStat:
    return StepStat(workflow_id=workflow_id, host_id=host_id, pid=pid, ts_start=ts, ts_end=ts + 1, first_step=first,
                    last_step=last, n_steps=last - first + 1, mean_s=0.1, p50_s=0.1, p95_s=0.1, max_s=0.1)


def _relaunched(store: Store, checkpoint_step: int, pid: int, host_id: str) -> int:
    """A move in state 'relaunched': its job was started as `pid` on `host_id`, from a checkpoint at that step."""
    with store.session() as s:
        s.add(Workflow(id="wf", managed=True, command=["train"], state="running", created_at=NOW, last_seen=NOW))
        s.flush()
        action = Action(workflow_id="wf", state="relaunched", checkpoint_step=checkpoint_step, created_at=NOW,
                        updated_at=NOW)
        s.add(action)
        s.flush()
        s.add(Command(host_id=host_id, kind="relaunch", payload={"purpose": "move"}, nonce="relaunch-1",
                      issued_at=NOW, expires_at=NOW + 60, action_id=action.id, status="done", result={"pid": pid}))
        return action.id


def test_the_resume_is_judged_by_the_relaunched_process_on_its_host_not_by_another_host_s_same_pid(
        sqlite_store: Store) -> None:
    action_id = _relaunched(sqlite_store, checkpoint_step=100, pid=42, host_id="host-b")
    with sqlite_store.session() as s:  # before the move the job ran on host-a, as pid 42 too (containers' pids)
        s.add(_steps("wf", "host-a", 42, 0, 99, NOW - 500))
    settings = Settings(secret="test-secret")
    # nothing from the new process yet: the move waits, it is not unwound for the old process's step 0
    assert drive(sqlite_store, action_id, settings=settings, now=NOW + 1) == "relaunched"
    with sqlite_store.session() as s:
        s.add(_steps("wf", "host-b", 42, 100, 109, NOW + 2))
    assert drive(sqlite_store, action_id, settings=settings, now=NOW + 3) == "resumed"
    assert "resumed at step 100 (checkpoint step 100) as pid 42" in action_log(sqlite_store, action_id)[-1]["message"]
