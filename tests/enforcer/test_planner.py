"""The planner on real stores: which jobs move where, what comes free, limits, cool-downs, apply, bad input, CLI."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import delete, func, select

from enforcer.migration import plan_action
from enforcer.plan_store import apply_plan, load_state, make_plan
from enforcer.planner import Holding, PlanDevice, plan_moves
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.findings import FindingSpec, upsert_finding
from store.ingest import write_samples
from store.models import Action, ActionEvent, Lane, Placement, Plan, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings, get_settings
from store.workflows import upsert_workflow
from ui.cli import run

GIB = 2**30
NOW = 1_800_000_000.0


def seed(store: Store, now: float = NOW) -> dict[int, int]:
    """One host, four 16 GiB devices: two idle movable jobs, one busy job that may not move, one foreign user."""
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="replay", now=now)
        ids = register_devices(s, "h1", [DeviceSpec(i, f"GPU-{i}", "T4", 16 * GIB) for i in range(4)],
                               source="replay", now=now)
        jobs = {
            "idle-a": dict(device=ids[0], p=2 * GIB, e=GIB // 2, movable=True, rule="idle_holder",
                           evidence={"util_mean_while_idle": 0.01, "mem_held_gib": 2.5}),
            "idle-b": dict(device=ids[1], p=2 * GIB, e=0, movable=True, rule="low_utilization",
                           evidence={"util_p95": 0.1, "util_mean": 0.05}),
            "busy-c": dict(device=ids[2], p=4 * GIB, e=GIB, movable=False, rule=None, evidence={}),
        }
        for name, j in jobs.items():
            upsert_workflow(s, name, now=now, managed=True, movable=j["movable"], command=["python", "train.py"],
                            mem_persistent=j["p"], mem_ephemeral=j["e"], id_source="managed")
            s.add(Placement(workflow_id=name, device_id=j["device"], host_id="h1", pid=100,
                            mem_persistent=j["p"], mem_ephemeral=j["e"], started_at=now))
            if j["rule"]:
                upsert_finding(s, FindingSpec(rule=j["rule"], workflow_id=name, source="telemetry", severity="high",
                                              title="t", fix="f", evidence=j["evidence"], device_id=j["device"],
                                              gpu_hours_per_day=10.0), now=now)
        # an unmanaged job flagged idle: never moved
        upsert_workflow(s, "foreign-d", now=now)
        upsert_finding(s, FindingSpec(rule="idle_holder", workflow_id="foreign-d", source="telemetry",
                                      severity="high", title="t", fix="f", evidence={"util_mean_while_idle": 0.0},
                                      device_id=ids[3]), now=now)
    write_samples(store, [dict(device_id=ids[3], ts=now, mem_used=10 * GIB, mem_total=16 * GIB, gpu_util=0.0)], [])
    return ids


def counts(store: Store) -> tuple[int, int]:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(Action)), s.scalar(select(func.count()).select_from(Lane))


def test_pack_frees_two_devices_and_apply_creates_planned_actions(any_store: Store) -> None:
    ids = seed(any_store)
    result = make_plan(any_store, "pack", settings=Settings(max_moves_per_cycle=4), now=NOW)
    assert {m.workflow_id for m in result.moves} == {"idle-a", "idle-b"}
    # both go next to the busy job (best fit): devices 0 and 1 come free, the busy and foreign jobs stay
    assert {m.to_device_id for m in result.moves} == {ids[2]}
    assert sorted(result.devices_freed) == sorted([ids[0], ids[1]])
    for m in result.moves:
        assert m.to_lane_id is None and m.new_lane  # each opens its own lane next to busy-c's
        assert 1.0 <= m.expected_slowdown < 1.5
        assert m.lane_size >= m.p_prime + m.ephemeral
    assert counts(any_store) == (0, 0)  # dry run: nothing recorded but the plan
    with any_store.session() as s:
        plan = s.get(Plan, result.plan_id)
        assert not plan.applied and plan.devices_freed == 2 and len(plan.moves) == 2

    actions = apply_plan(any_store, result.plan_id, settings=Settings(), now=NOW + 1)
    assert [a.state for a in actions] == ["planned", "planned"]
    with any_store.session() as s:
        assert s.get(Plan, result.plan_id).applied
        rows = s.scalars(select(Action).order_by(Action.id)).all()
        assert {(r.workflow_id, r.to_device_id, r.state) for r in rows} == {
            ("idle-a", ids[2], "planned"), ("idle-b", ids[2], "planned")}
        lanes = {lane.id: lane for lane in s.scalars(select(Lane))}
        assert all(r.to_lane_id in lanes and lanes[r.to_lane_id].device_id == ids[2] for r in rows)
        assert sum(lane.size_bytes for lane in lanes.values()) <= 16 * GIB
        assert s.scalar(select(func.count()).select_from(ActionEvent)) == 2
        # nothing moved yet: the migration state machine does that
        assert {p.device_id for p in s.scalars(select(Placement).where(Placement.workflow_id == "idle-a"))} == {ids[0]}
    with pytest.raises(InvalidInput, match="applied already"):
        apply_plan(any_store, result.plan_id, settings=Settings())
    # the next cycle leaves the jobs alone: their moves are under way, and their lanes stay reserved
    again = make_plan(any_store, "pack", settings=Settings(), now=NOW + 2)
    assert again.moves == [] and again.skipped.get("in cool-down") == 2
    with any_store.session() as s:
        _, holdings = load_state(s, Settings(), NOW + 2)
    reserved = {h.workflow_id: h for h in holdings if h.workflow_id.startswith("arriving:")}
    assert set(reserved) == {"arriving:idle-a", "arriving:idle-b"}
    assert all(h.device_id == ids[2] and h.p_prime == h.lane_size for h in reserved.values())


def test_plan_counts_the_room_of_a_job_registered_but_not_started(any_store: Store) -> None:
    ids = seed(any_store)
    with any_store.session() as s:
        # busy-c in a 6 GiB lane, and beside it a 9 GiB lane for a job `fleetlens run` placed a moment ago
        busy = Lane(device_id=ids[2], size_bytes=6 * GIB, compute_share=0.5, state="open", created_at=NOW)
        new = Lane(device_id=ids[2], size_bytes=9 * GIB, compute_share=0.5, state="open", created_at=NOW)
        s.add_all([busy, new])
        s.flush()
        s.scalars(select(Placement).where(Placement.workflow_id == "busy-c")).one().lane_id = busy.id
        upsert_workflow(s, "new-e", now=NOW, managed=True, movable=True, command=["python", "train.py"],
                        mem_persistent=7 * GIB, mem_ephemeral=GIB, id_source="managed")
        s.add(Placement(workflow_id="new-e", device_id=ids[2], lane_id=new.id, host_id="h1", pid=None,
                        state="pending", mem_persistent=7 * GIB, mem_ephemeral=GIB, started_at=NOW))
    result = make_plan(any_store, "pack", settings=Settings(max_moves_per_cycle=4), now=NOW)
    # device 2 has 1 GiB left beside its two lanes: neither idle job's lane fits there
    assert result.moves and all(m.to_device_id != ids[2] for m in result.moves)
    assert "new-e" not in {m.workflow_id for m in result.moves}  # not started: nothing to move


def test_a_job_on_its_way_into_a_shared_lane_holds_its_own_share_of_it(any_store: Store) -> None:
    ids = seed(any_store)
    settings = Settings(max_moves_per_cycle=4)
    with any_store.session() as s:
        # device 2 is two 8 GiB lanes: busy-c's (4.4 + 1 GiB) and a full one
        shared = Lane(device_id=ids[2], size_bytes=8 * GIB, compute_share=0.5, state="open", created_at=NOW)
        full = Lane(device_id=ids[2], size_bytes=8 * GIB, compute_share=0.5, state="open", created_at=NOW)
        s.add_all([shared, full])
        s.flush()
        s.scalars(select(Placement).where(Placement.workflow_id == "busy-c")).one().lane_id = shared.id
        upsert_workflow(s, "filler", now=NOW, managed=True, command=["python", "train.py"], mem_persistent=7 * GIB,
                        mem_ephemeral=0, id_source="managed")
        s.add(Placement(workflow_id="filler", device_id=ids[2], lane_id=full.id, host_id="h1", pid=9,
                        mem_persistent=7 * GIB, mem_ephemeral=0, started_at=NOW))
        # idle-a is on its way into busy-c's lane, with P' 2.2 GiB and E 0.5 GiB: 0.4 GiB of the lane stay free
        plan_action(s, "idle-a", "pack", ids[0], ids[2], shared.id, now=NOW, message="by hand", settings=settings,
                    detail={"p_prime": int(2.2 * GIB), "ephemeral": GIB // 2, "persistent": 2 * GIB})
        lane_id = shared.id
    with any_store.session() as s:
        _, holdings = load_state(s, settings, NOW + 1)
    held = [(h.lane_id, h.p_prime, h.ephemeral) for h in holdings if h.workflow_id == "arriving:idle-a"]
    assert held == [(lane_id, int(2.2 * GIB), GIB // 2)]
    result = make_plan(any_store, "pack", settings=settings, now=NOW + 1)
    # the planner no longer offers idle-b (2.2 GiB) the room idle-a takes in that lane, so its plan applies
    assert result.moves and all(m.to_lane_id != lane_id for m in result.moves)
    assert "placement inconsistent with memory" not in result.skipped
    apply_plan(any_store, result.plan_id, settings=settings, now=NOW + 2)
    with any_store.session() as s:  # idle-a got there (its move not over yet): its placement holds it, once
        s.add(Placement(workflow_id="idle-a", device_id=ids[2], lane_id=lane_id, host_id="h1", pid=11,
                        mem_persistent=2 * GIB, mem_ephemeral=GIB // 2, started_at=NOW + 3))
    with any_store.session() as s:
        _, holdings = load_state(s, settings, NOW + 4)
    assert [h.lane_id for h in holdings if h.workflow_id in ("idle-a", "arriving:idle-a")].count(lane_id) == 1


def test_fair_spreads_and_frees_less(sqlite_store: Store) -> None:
    ids = seed(sqlite_store)
    result = make_plan(sqlite_store, "fair", settings=Settings(), now=NOW)
    # idle-b goes to the least loaded device (idle-a's), which then stays in use
    assert [(m.workflow_id, m.to_device_id) for m in result.moves] == [("idle-b", ids[0])]
    assert result.devices_freed == [ids[1]]


def test_move_limit_and_cooldown(sqlite_store: Store) -> None:
    ids = seed(sqlite_store)
    one = make_plan(sqlite_store, "pack", settings=Settings(max_moves_per_cycle=1), now=NOW)
    assert len(one.moves) == 1 and one.skipped["over the moves-per-cycle limit"] == 1
    with sqlite_store.session() as s:  # idle-b was moved an hour ago and has finished moving
        s.add(Action(workflow_id="idle-b", state="resumed", created_at=NOW - 100, updated_at=NOW - 100))
    cool = make_plan(sqlite_store, "pack", settings=Settings(cooldown_s=3600), now=NOW)
    assert [m.workflow_id for m in cool.moves] == ["idle-a"] and cool.devices_freed == [ids[0]]
    later = make_plan(sqlite_store, "pack", settings=Settings(cooldown_s=60), now=NOW)
    assert len(later.moves) == 2


def test_not_movable_and_unmanaged_jobs_stay(sqlite_store: Store) -> None:
    seed(sqlite_store)
    with sqlite_store.session() as s:
        s.get(Workflow, "idle-a").movable = False
    result = make_plan(sqlite_store, "pack", settings=Settings(), now=NOW)
    assert [m.workflow_id for m in result.moves] == ["idle-b"]
    assert result.skipped["not movable"] == 1
    # ... unless the team opts in
    with sqlite_store.session() as s:
        s.get(Workflow, "idle-a").team = "research"
    result = make_plan(sqlite_store, "pack", settings=Settings(movable_teams=["research"]), now=NOW)
    assert {m.workflow_id for m in result.moves} == {"idle-a", "idle-b"}


def test_never_over_memory(sqlite_store: Store) -> None:
    seed(sqlite_store)
    with sqlite_store.session() as s:  # the busy job grows to fill its device: no room for anyone
        s.get(Workflow, "busy-c").mem_persistent = 13 * GIB
        for name in ("idle-a", "idle-b"):
            s.get(Workflow, name).mem_persistent = 7 * GIB
    result = make_plan(sqlite_store, "pack", settings=Settings(), now=NOW)
    # 7 GiB jobs ask lanes of 8.1 (+E) GiB: neither fits next to the other's 16 GiB device's lane, nor busy-c's
    assert result.moves == [] and result.devices_freed == []
    assert result.skipped["no device has room"] == 2


def test_plan_naming_a_workflow_that_has_gone(any_store: Store) -> None:
    seed(any_store)
    result = make_plan(any_store, "pack", settings=Settings(), now=NOW)
    with any_store.session() as s:
        s.execute(delete(Workflow).where(Workflow.id == "idle-b"))
    with pytest.raises(NotFound, match="'idle-b', which is no longer in the store; nothing was moved"):
        apply_plan(any_store, result.plan_id, settings=Settings())
    assert counts(any_store) == (0, 0)
    with any_store.session() as s:
        assert not s.get(Plan, result.plan_id).applied
    with pytest.raises(NotFound, match="no plan 999"):
        apply_plan(any_store, 999, settings=Settings())


def test_plan_for_a_job_that_has_already_left(sqlite_store: Store) -> None:
    seed(sqlite_store)
    result = make_plan(sqlite_store, "pack", settings=Settings(), now=NOW)
    with sqlite_store.session() as s:
        s.execute(Placement.__table__.update().where(Placement.workflow_id == "idle-a").values(state="ended"))
    with pytest.raises(InvalidInput, match="'idle-a' is no longer on device"):
        apply_plan(sqlite_store, result.plan_id, settings=Settings())
    assert counts(sqlite_store) == (0, 0)


def test_unknown_policy(sqlite_store: Store) -> None:
    with pytest.raises(InvalidInput, match="known policies: fair, fifo, pack, srtf"):
        make_plan(sqlite_store, "greedy", settings=Settings())
    with sqlite_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Plan)) == 0


def test_pure_core_keeps_lanes_and_foreign_memory() -> None:
    devices = [PlanDevice(1, 16 * GIB, "h"), PlanDevice(2, 16 * GIB, "h", foreign=15 * GIB),
               PlanDevice(3, 16 * GIB, "h")]
    holdings = [
        Holding("a", 1, GIB, util=0.05, movable=True, rules=("idle_holder",)),
        # a job in a store lane, on a device also used by processes fleetlens does not manage
        Holding("b", 2, GIB // 2, util=0.1, lane_id=7, lane_size=GIB, p_prime=GIB // 2 + GIB // 20),
        Holding("c", 3, 2 * GIB, util=0.5),
    ]
    result = plan_moves(devices, holdings, "pack", max_moves=4)
    # device 2 has 15 GiB used by others: only device 3 has room for a's lane
    assert [(m.workflow_id, m.to_device_id) for m in result.moves] == [("a", 3)]
    assert result.devices_freed == [1]


def test_pure_core_never_puts_a_job_into_the_lane_of_a_whole_device_holder() -> None:
    # "holder" holds device 1 whole (no lane in the store, so no gate): its 1 GiB + 20 GiB peak is all its own,
    # it takes no turns with anyone. The planner counts it as its Salus lane (22.2 GiB) to move others beside it.
    def plan(capacity: int):
        devices = [PlanDevice(1, capacity, "h"), PlanDevice(2, capacity, "h")]
        holdings = [Holding("holder", 1, GIB, ephemeral=20 * GIB, util=0.1),
                    Holding("small", 2, GIB // 2, ephemeral=5 * GIB, util=0.1, movable=True, rules=("idle_holder",))]
        return plan_moves(devices, holdings, "pack", max_moves=4)

    # 24 GiB: no room for small's own lane beside it; joining the holder's would put small's 5 GiB peak on top of
    # the holder's 21 GiB
    assert plan(24 * GIB).moves == []
    # 32 GiB: small gets a lane of its own next to the holder
    roomy = plan(32 * GIB)
    assert [(m.workflow_id, m.to_device_id, m.new_lane is not None) for m in roomy.moves] == [("small", 1, True)]
    assert roomy.moves[0].lane_size < 6 * GIB and roomy.devices_freed == [2]


def test_cli_enforce_and_lanes(fleet_home, capsys) -> None:
    assert run(["init"]) == 0
    store = Store.from_settings(get_settings())
    seed(store, now=time.time())
    capsys.readouterr()
    assert run(["enforce", "--policy", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'nosuch'; known policies: fair, fifo, pack, srtf" in err and err.count("\n") == 1
    assert run(["enforce", "--policy", "pack"]) == 0
    out = capsys.readouterr().out
    assert "idle-a" in out and "idle-b" in out and "devices freed: 2" in out and "dry run" in out
    assert counts(store) == (0, 0)
    assert run(["enforce", "--policy", "pack", "--apply"]) == 0
    out = capsys.readouterr().out
    assert "applied" in out
    assert counts(store)[0] == 2
    assert run(["lanes"]) == 0
    out = capsys.readouterr().out
    assert "arriving" in out and "busy-c" in out and "whole device" in out
    store.dispose()


def _three_hosts(readable: frozenset[str] | None) -> tuple[list[PlanDevice], list[Holding]]:
    """An idle job on host h1; h2's device is the fuller (PACK's first choice), h3's has room too."""
    devices = [PlanDevice(1, 16 * GIB, "h1"), PlanDevice(2, 16 * GIB, "h2"), PlanDevice(3, 16 * GIB, "h3")]
    holdings = [
        Holding("idle", 1, GIB, util=0.05, movable=True, rules=("idle_holder",), readable_hosts=readable),
        Holding("busy-2", 2, 6 * GIB, util=0.2),
        Holding("busy-3", 3, 2 * GIB, util=0.2),
    ]
    return devices, holdings


def test_pure_core_moves_a_job_only_to_a_host_that_can_read_its_checkpoints() -> None:
    # without storage facts (a simulation) PACK picks h2's fuller device
    free_for_all = plan_moves(*_three_hosts(None), "pack", max_moves=4)
    assert [(m.workflow_id, m.to_device_id) for m in free_for_all.moves] == [("idle", 2)]
    # h2 cannot read the job's checkpoint location, h3 can: the planner chooses h3 instead, and still frees device 1
    result = plan_moves(*_three_hosts(frozenset({"h3"})), "pack", max_moves=4)
    assert [(m.workflow_id, m.to_device_id) for m in result.moves] == [("idle", 3)]
    assert result.devices_freed == [1] and result.refused == []


def test_pure_core_keeps_a_job_no_host_with_room_can_read_and_says_why() -> None:
    result = plan_moves(*_three_hosts(frozenset()), "pack", max_moves=4)
    assert result.moves == [] and result.devices_freed == []
    assert result.skipped["refused: not safe to move"] == 1 and "no device has room" not in result.skipped
    (refusal,) = result.refused
    assert (refusal["workflow_id"], refusal["from_device_id"], refusal["to_device_id"], refusal["to_host"]) == (
        "idle", 1, 2, "h2")
    assert "cannot read its checkpoint location" in refusal["reason"] and "runs on where it is" in refusal["reason"]
    # a job that fits nowhere at all is not blamed on storage
    devices, holdings = _three_hosts(frozenset())
    holdings[0].persistent = 15 * GIB
    full = plan_moves(devices, holdings, "pack", max_moves=4)
    assert full.refused == [] and full.skipped["no device has room"] == 1


def _seed_three_hosts(store: Store, location: str | None) -> dict[str, int]:
    """Three hosts of one 16 GiB device each; an idle movable job on h1 checkpointing into `location`; busy jobs on
    h2 (the fuller: PACK's first choice) and h3."""
    ids = {}
    with store.session() as s:
        for host in ("h1", "h2", "h3"):
            register_host(s, host, hostname=host, source="replay", now=NOW)
            ids[host] = register_devices(s, host, [DeviceSpec(0, f"GPU-{host}", "T4", 16 * GIB)],
                                         source="replay", now=NOW)[0]
        for name, host, p, movable in (("idle", "h1", GIB, True), ("busy-2", "h2", 6 * GIB, False),
                                       ("busy-3", "h3", 2 * GIB, False)):
            upsert_workflow(s, name, now=NOW, managed=True, movable=movable, command=["python", "train.py"],
                            mem_persistent=p, mem_ephemeral=0, id_source="managed", state="running",
                            checkpoint_url=location if name == "idle" else None)
            s.add(Placement(workflow_id=name, device_id=ids[host], host_id=host, pid=100,
                            mem_persistent=p, mem_ephemeral=0, started_at=NOW))
        upsert_finding(s, FindingSpec(rule="idle_holder", workflow_id="idle", source="telemetry", severity="high",
                                      title="t", fix="f", evidence={"util_mean_while_idle": 0.01},
                                      device_id=ids["h1"], gpu_hours_per_day=10.0), now=NOW)
    return ids


def test_plan_goes_to_the_host_that_can_read_the_checkpoint_location(any_store: Store, tmp_path) -> None:
    from store.checkpoints import record_probes

    location = str(tmp_path / "shared" / "idle")
    ids = _seed_three_hosts(any_store, location)
    with any_store.session() as s:
        record_probes(s, "h2", [(location, f"{location} is not a folder this host can see")], now=NOW)
        record_probes(s, "h3", [(location, None)], now=NOW)
    result = make_plan(any_store, "pack", settings=Settings(), now=NOW + 1)
    assert [(m.workflow_id, m.from_device_id, m.to_device_id) for m in result.moves] == [
        ("idle", ids["h1"], ids["h3"])]
    assert result.devices_freed == [ids["h1"]] and result.refused == []
    actions = apply_plan(any_store, result.plan_id, settings=Settings(), now=NOW + 2)
    assert [(a.workflow_id, a.to_device_id) for a in actions] == [("idle", ids["h3"])]


def test_plan_keeps_a_job_whose_checkpoints_no_host_with_room_can_read(any_store: Store, tmp_path) -> None:
    from store.checkpoints import record_probes

    location = str(tmp_path / "shared" / "idle")
    ids = _seed_three_hosts(any_store, location)
    with any_store.session() as s:
        record_probes(s, "h2", [(location, f"{location} is not a folder this host can see")], now=NOW)
        record_probes(s, "h3", [(location, None)], now=NOW - 3600)  # said so an hour ago: its agent may be gone
    result = make_plan(any_store, "pack", settings=Settings(), now=NOW + 1)
    assert result.moves == [] and result.devices_freed == []
    (refusal,) = result.refused
    assert (refusal["workflow_id"], refusal["from_device_id"], refusal["to_device_id"]) == ("idle", ids["h1"],
                                                                                            ids["h2"])
    assert f"host h2 cannot read {location}: {location} is not a folder this host can see" in refusal["reason"]
    with any_store.session() as s:
        plan = s.get(Plan, result.plan_id)
        assert plan.moves == [] and plan.summary["refused"] == result.refused
        assert plan.summary["skipped"]["refused: not safe to move"] == 1
    # a job checkpointing into its own host's FLEETLENS_HOME is kept too, with that reason
    with any_store.session() as s:
        s.get(Workflow, "idle").checkpoint_url = None
    homebound = make_plan(any_store, "pack", settings=Settings(), now=NOW + 2)
    assert homebound.moves == [] and "own FLEETLENS_HOME" in homebound.refused[0]["reason"]
