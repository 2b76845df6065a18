"""The plan-level checks of a move run once, where the move is begun, and no actuator receives a move they refuse."""

from __future__ import annotations

from typing import ClassVar

import pytest
from sqlalchemy import func, select

import enforcer.migration as migration
from enforcer.actuators.base import Move, StepOutcome
from enforcer.actuators.drive import drive_actions
from enforcer.actuators.registry import ACTUATORS
from enforcer.fleet_state import read_fleet_state
from enforcer.migration import MoveRefused, plan_action
from enforcer.migration_steps import transition
from enforcer.plan_store import apply_plan, make_plan
from store.db import Store
from store.errors import InvalidInput
from store.models import Action, Device, Lane, Placement, Plan
from store.placements import end_placements
from store.settings import Settings
from store.workflows import upsert_workflow
from tests.enforcer.test_planner import GIB, NOW, seed


class SpyActuator:
    """Stands in for the agents' actuator at the registry: records every action the driver hands it."""

    engine: ClassVar[str] = "agents"
    received: ClassVar[list[int]] = []

    def __init__(self, store: Store, settings: Settings) -> None:
        pass

    def begin(self, move: Move, *, now: float) -> int:
        raise AssertionError("the driver never begins a move")

    def advance(self, action_id: int, *, now: float) -> list[StepOutcome]:
        SpyActuator.received.append(action_id)
        return []


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    SpyActuator.received = []
    monkeypatch.setitem(ACTUATORS, "agents", SpyActuator)
    calls: list[tuple] = []
    checked = migration.move_refusal

    def counting(session, wf, *args, **kwargs):
        calls.append((wf.id if wf is not None else None, *args[:3]))
        return checked(session, wf, *args, **kwargs)

    monkeypatch.setattr(migration, "move_refusal", counting)
    return {"calls": calls, "received": SpyActuator.received}


def test_the_plan_level_check_runs_once_per_move_and_the_actuator_gets_each_move(sqlite_store: Store,
                                                                                 spy: dict) -> None:
    seed(sqlite_store)
    settings = Settings(max_moves_per_cycle=4)
    result = make_plan(sqlite_store, "pack", settings=settings, apply=True, now=NOW)
    assert len(result.moves) == 2 and result.applied
    # planning checks nothing (the planner plans around the fleet's facts); applying begins each move once
    assert sorted(c[0] for c in spy["calls"]) == ["idle-a", "idle-b"]
    drive_actions(sqlite_store, settings)
    drive_actions(sqlite_store, settings)
    with sqlite_store.session() as s:
        ids = sorted(s.scalars(select(Action.id)))
    assert sorted(set(spy["received"])) == ids and len(spy["received"]) == 4  # one step each, twice
    assert len(spy["calls"]) == 2  # driving never checks again


def test_a_move_the_plan_level_check_refuses_never_reaches_an_actuator(sqlite_store: Store, spy: dict) -> None:
    ids = seed(sqlite_store)
    settings = Settings(max_moves_per_cycle=4)
    result = make_plan(sqlite_store, "pack", settings=settings, now=NOW)
    with sqlite_store.session() as s:
        s.get(Device, ids[2]).state = "lost"  # the target goes between planning and applying
    with pytest.raises(InvalidInput, match=rf"refused to move 'idle-\w': target device {ids[2]} is gone.*nothing was"):
        apply_plan(sqlite_store, result.plan_id, settings=settings, now=NOW + 1)
    with sqlite_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Action)) == 0
        assert s.scalar(select(func.count()).select_from(Lane)) == 0  # the lanes it opened were not kept
        assert not s.get(Plan, result.plan_id).applied
    assert len(spy["calls"]) == 1  # the first refusal ends the plan
    assert drive_actions(sqlite_store, settings) == {} and spy["received"] == []


def test_target_capacity_counts_the_jobs_placed_there_and_those_on_their_way(sqlite_store: Store, spy: dict) -> None:
    ids = seed(sqlite_store)
    settings = Settings()
    with sqlite_store.session() as s:
        lane = Lane(device_id=ids[3], size_bytes=4 * GIB, compute_share=0.5, state="open", created_at=NOW)
        s.add(lane)
        s.flush()
        lane_id = lane.id
        # idle-a (P' 2.2 GiB, E 0.5 GiB) fits the empty 4 GiB lane: begun
        first = plan_action(s, "idle-a", "pack", ids[0], ids[3], lane_id, now=NOW, message="by hand",
                            detail={"p_prime": int(2.2 * GIB), "ephemeral": GIB // 2}, settings=settings).id
    with sqlite_store.session() as s:
        # idle-b (P' 2.2 GiB) would fit the lane alone, not beside idle-a on its way there
        with pytest.raises(MoveRefused, match=f"target lane {lane_id} is full"):
            plan_action(s, "idle-b", "pack", ids[1], ids[3], lane_id, now=NOW, message="by hand",
                        detail={"p_prime": int(2.2 * GIB), "ephemeral": 0}, settings=settings)
    with sqlite_store.session() as s:
        s.add(Placement(workflow_id="busy-c", device_id=ids[3], lane_id=lane_id, host_id="h1", pid=7,
                        mem_persistent=GIB, mem_ephemeral=0, started_at=NOW))
        s.get(Action, first).state = "failed"  # idle-a's move is over; a job placed in the lane now holds it
    with sqlite_store.session() as s:
        with pytest.raises(MoveRefused, match=f"target lane {lane_id} is full.*idle-b needs"):
            plan_action(s, "idle-b", "pack", ids[1], ids[3], lane_id, now=NOW, message="by hand",
                        detail={"p_prime": 3 * GIB + 1, "ephemeral": 0}, settings=settings)
        # a whole device with a job on it is taken
        with pytest.raises(MoveRefused, match=f"target device {ids[2]} is taken by busy-c"):
            plan_action(s, "idle-b", "pack", ids[1], ids[2], None, now=NOW, message="by hand",
                        detail={"p_prime": GIB, "ephemeral": 0}, settings=settings)
    with sqlite_store.session() as s:
        assert [a.id for a in s.scalars(select(Action))] == [first]
    assert len(spy["calls"]) == 4
    assert drive_actions(sqlite_store, settings) == {} and spy["received"] == []  # the one move recorded is over


def test_a_lane_stays_reserved_for_a_job_on_its_way_when_its_lane_mates_end(sqlite_store: Store, spy: dict) -> None:
    ids = seed(sqlite_store)
    with sqlite_store.session() as s:
        lane = Lane(device_id=ids[3], size_bytes=8 * GIB, compute_share=0.5, state="open", created_at=NOW)
        s.add(lane)
        s.flush()
        lane_id = lane.id
        upsert_workflow(s, "mate", now=NOW, managed=True, command=["python", "train.py"], id_source="managed")
        s.add(Placement(workflow_id="mate", device_id=ids[3], lane_id=lane_id, host_id="h1", pid=7,
                        mem_persistent=GIB, mem_ephemeral=0, started_at=NOW))
        action_id = plan_action(s, "idle-a", "pack", ids[0], ids[3], lane_id, now=NOW, message="by hand",
                                detail={"p_prime": int(2.2 * GIB), "ephemeral": GIB // 2}, settings=Settings()).id
    end_placements(sqlite_store, "mate", 7, "finished", now=NOW + 1)  # its only job ends before idle-a arrives
    with sqlite_store.session() as s:
        assert s.get(Lane, lane_id).state == "open"
        # still held for idle-a: admission and the planner do not hand its room out
        assert [(a.workflow_id, a.lane.lane_id) for a in read_fleet_state(s).arriving] == [("idle-a", lane_id)]
        transition(s, s.get(Action, action_id), "failed", "it never got there", NOW + 2)
    with sqlite_store.session() as s:  # the move is over, the lane empty: it closes
        assert s.get(Lane, lane_id).state == "closed" and read_fleet_state(s).arriving == []
