"""The actuator seam with the agents' actuator, on real parts: a real agent and a real training job moved by
`begin` and `advance`, each step reported (checkpointed at step S, stopped, placed, resumed at S' >= S); actions
record their engine; the cycle's driver hands each action to its engine's actuator and leaves an unknown engine's
action alone, saying why."""

from __future__ import annotations

import time

import pytest

from enforcer.actuators.agents import AgentsActuator, step_outcomes
from enforcer.actuators.base import Actuator, Move, Step
from enforcer.actuators.drive import drive_actions
from enforcer.actuators.registry import actuator_for
from enforcer.migration import drive, plan_action
from store.db import Store
from store.errors import InvalidInput
from store.models import Action
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.workflows import upsert_workflow
from tests.collector.agent_helpers import wait_for
from tests.enforcer.migration_helpers import (  # noqa: F401  (rig_fixture: the `rig` fixture)
    FAST,
    Rig,
    action,
    last_step,
    pid_alive,
    rig_fixture,
    train_cmd,
)


def test_the_agents_actuator_moves_a_job_and_reports_each_step(rig: Rig) -> None:
    total = 100_000
    job = rig.launch(train_cmd(total), name="seam", mem_bytes=64 << 20)
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 20, timeout=60)
    actuator = AgentsActuator(rig.store, rig.settings, FAST)
    assert isinstance(actuator, Actuator) and actuator_for("agents", rig.store, rig.settings).engine == "agents"
    target = rig.other_device(job)
    action_id = actuator.begin(Move(job.workflow_id, target, from_device_id=job.device_ids[0],
                                    new_lane_size=1 << 30, compute_share=0.5, policy="pack"), now=time.time())
    assert action(rig.store, action_id).engine == "agents"
    outcomes = []

    def finished() -> bool:
        outcomes.extend(actuator.advance(action_id, now=time.time()))
        return bool(outcomes) and outcomes[-1].terminal

    wait_for(finished, timeout=90, every=0.2)
    steps = [o.step for o in outcomes]
    assert steps == [Step.CHECKPOINTED, Step.STOPPED, Step.PLACED, Step.RESUMED], outcomes
    assert all(o.ok and o.action_id == action_id for o in outcomes)
    checkpointed, resumed = outcomes[0], outcomes[-1]
    moved = action(rig.store, action_id)
    assert checkpointed.training_step == moved.checkpoint_step and checkpointed.training_step >= 20
    assert resumed.training_step is not None and resumed.training_step >= checkpointed.training_step
    assert rig.placement(job.workflow_id).device_id == target and not pid_alive(job.pid)
    with rig.store.session() as s:  # the whole log reads the same, from the start
        assert [o.step for o in step_outcomes(s, action_id)] == [Step.PLANNED, *steps]
    assert actuator.advance(action_id, now=time.time()) == []  # a finished move takes no more steps


def _one_action(store: Store, engine: str) -> int:
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="cpu")
        ids = register_devices(s, "h1", [DeviceSpec(i, f"cpu:h1:{i}", f"cpu {i}", 1 << 30, (i,)) for i in range(2)],
                               source="cpu")
        upsert_workflow(s, "elsewhere", now=1.0, managed=True, command=["python", "t.py"], id_source="managed")
        return plan_action(s, "elsewhere", "pack", ids[0], ids[1], None, now=1.0, message="by hand", detail={},
                           settings=Settings(secret="t"), engine=engine).id


def test_an_action_of_an_engine_no_actuator_carries_is_left_alone(sqlite_store: Store, caplog) -> None:
    action_id = _one_action(sqlite_store, "slurm-next-year")
    settings = Settings(secret="t")
    with pytest.raises(InvalidInput, match="no actuator carries moves of engine 'slurm-next-year'"):
        actuator_for("slurm-next-year", sqlite_store, settings)
    with pytest.raises(InvalidInput, match="carried out by the 'slurm-next-year' actuator"):
        drive(sqlite_store, action_id, settings=settings)  # the agents' machine never touches another engine's move
    assert drive_actions(sqlite_store, settings) == {action_id: "planned"}
    assert "no actuator carries moves of engine 'slurm-next-year'" in caplog.text
    with sqlite_store.session() as s:
        assert s.get(Action, action_id).state == "planned"


def test_the_cycles_driver_hands_an_agents_action_to_the_agents_actuator(sqlite_store: Store) -> None:
    action_id = _one_action(sqlite_store, "agents")
    # its workflow has no checkpoint folder: the agents' state machine fails it at its first step, moving nothing
    assert drive_actions(sqlite_store, Settings(secret="t")) == {action_id: "failed"}
    with sqlite_store.session() as s:
        assert [o.step for o in step_outcomes(s, action_id)] == [Step.PLANNED, Step.FAILED]
        assert "nothing moved" in s.get(Action, action_id).error
