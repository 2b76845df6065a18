"""A real consolidation cycle on this machine: a real agent (cpu source), two real torch jobs on two cpu devices,
the enforce cycle re-packs them by what their samples show and carries the move out; one device comes free and
the recorded plan names the move and its reason."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from enforcer.actuators.drive import drive_actions
from enforcer.cycle import run_cycle
from store.models import Placement, Plan, ProcessSample
from tests.collector.agent_helpers import wait_for
from tests.enforcer.migration_helpers import (  # noqa: F401  (rig_fixture: the `rig` fixture)
    FAST,
    Rig,
    rig_fixture,
    train_cmd,
)

pytestmark = pytest.mark.slow


def samples_since(rig: Rig, workflow_id: str, since: float) -> int:
    with rig.store.session() as s:
        return s.scalar(select(func.count()).select_from(ProcessSample).where(
            ProcessSample.workflow_id == workflow_id, ProcessSample.ts >= since, ProcessSample.mem_used.is_not(None)))


def test_a_consolidation_cycle_frees_a_cpu_device(rig: Rig) -> None:
    devices = rig.agent.devices(rig.store)
    assert len(devices) >= 2, "the cpu source gives one device per core; this test needs two"
    jobs = [rig.launch(train_cmd(5000, step_sleep=0.3), steps=5000, name=f"light-{k}", devices=[devices[k].id],
                       mem_bytes=64 << 20) for k in range(2)]
    assert {j.device_ids[0] for j in jobs} == {devices[0].id, devices[1].id}
    # light jobs: once they have run past their start-up (imports keep a core busy), a window of samples
    # shows low utilisation and steady memory
    with rig.store.session() as s:
        start = s.scalar(select(func.max(ProcessSample.ts))) or 0.0
    wait_for(lambda: all(samples_since(rig, j.workflow_id, start + 20) >= 10 for j in jobs), timeout=120, every=1)
    settings = rig.settings.model_copy(update={
        "enforce": True, "enforce_drive_s": 0, "consolidate_window_s": 8.0, "consolidate_min_history_s": 10.0,
        "consolidate_downtime_s": 5.0})
    result = run_cycle(rig.store, settings)
    cons = result["consolidation"]
    assert cons is not None and cons["moves"] == 1 and cons["devices_freed"] == 1, cons
    assert cons["outcome"]["applied"]
    plan_id = cons["plan_id"]
    states = drive_actions(rig.store, plan_id=plan_id, settings=rig.settings, migration_options=FAST, timeout_s=90)
    assert list(states.values()) == ["resumed"], states
    with rig.store.session() as s:
        active = s.execute(select(Placement.workflow_id, Placement.device_id).where(
            Placement.state == "active", Placement.workflow_id.in_([j.workflow_id for j in jobs]))).all()
        plan = s.get(Plan, plan_id)
        # both jobs now run on one device; the other holds nothing of theirs
        assert len(active) == 2 and len({d for _, d in active}) == 1
        freed = ({devices[0].id, devices[1].id} - {d for _, d in active}).pop()
        assert plan.policy == "consolidate" and plan.applied and plan.summary["freed_device_ids"] == [freed]
        assert plan.summary["move_reasons"][0]["reason"] == "free_device"
