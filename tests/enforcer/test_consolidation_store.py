"""Consolidation on real stores: demand read from process samples, plans recorded with reasons, applied as actions."""

from __future__ import annotations

import time

import numpy as np
import pytest
from sqlalchemy import func, select, update

from enforcer.consolidation_sizing import ConsolidateParams, JobDemand, size_jobs
from enforcer.consolidation_store import POLICY, consolidation_due, load_demands, make_consolidation_plan
from enforcer.cycle import run_cycle
from enforcer.migration import plan_action
from store.checkpoints import record_checkpoint, record_probes
from store.db import Store
from store.device_memory import known_memory
from store.ingest import write_samples
from store.models import Action, Lane, Placement, Plan, ProcessSample, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.workflows import upsert_workflow
from ui.cli import run

GIB = 2**30
NOW = 1_800_000_000.0


def seed(store: Store, minutes: int = 120, now: float = NOW) -> dict[int, int]:
    """Three 16 GiB devices: two small movable jobs on devices 0 and 1, one job that may not move on device 2,
    each with `minutes` of per-minute process samples."""
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="replay", now=now)
        ids = register_devices(s, "h1", [DeviceSpec(i, f"GPU-{i}", "T4", 16 * GIB) for i in range(3)],
                               source="replay", now=now)
        for name, dev, movable in (("a", ids[0], True), ("b", ids[1], True), ("c", ids[2], False)):
            upsert_workflow(s, name, now=now, managed=True, movable=movable, command=["python", "t.py"],
                            id_source="managed")
            s.add(Placement(workflow_id=name, device_id=dev, host_id="h1", pid=100, started_at=now - 60 * minutes))
    rows = [dict(device_id=dev, workflow_id=name, host_id="h1", pid=100, ts=now - 60.0 * k, mem_used=mem,
                 sm_util=0.1, cpu_util=None)
            for k in range(minutes) for name, dev, mem in (("a", ids[0], 2 * GIB), ("b", ids[1], 3 * GIB),
                                                             ("c", ids[2], 4 * GIB))]
    write_samples(store, [], rows)
    return ids


def n_actions(store: Store) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(Action))


def test_demand_comes_from_process_samples(any_store: Store):
    ids = seed(any_store)
    with any_store.session() as s:
        devices, demands, _ = load_demands(s, Settings(), NOW, ConsolidateParams(window_s=1800.0))
    assert sorted(devices) == sorted((i, 16 * GIB) for i in ids.values())
    by = {d.job_id: d for d in demands}
    assert by["a"].device_id == ids[0] and by["a"].movable and not by["c"].movable
    assert float(by["b"].mem.max()) == 3 * GIB
    # the window holds 30 minutes of samples, but the job has been watched for two hours
    assert by["a"].times[-1] - by["a"].times[0] == pytest.approx(119 * 60.0)


def test_live_sizing_takes_the_window_as_the_pure_core_does(any_store: Store):
    ids = seed(any_store)
    params = ConsolidateParams(window_s=1800.0, min_history_s=3600.0)
    # b peaked at 10 GiB at the very start of the window
    with any_store.session() as s:
        s.execute(update(ProcessSample).where(ProcessSample.workflow_id == "b", ProcessSample.ts == NOW - 1800.0)
                  .values(mem_used=10 * GIB))
        _, demands, _ = load_demands(s, Settings(), NOW, params)
    times = NOW - 60.0 * np.arange(120)[::-1]
    mem = np.where(times == NOW - 1800.0, 10 * GIB, 3 * GIB).astype(float)
    # the same samples as the simulator hands them to the pure core: the same size
    alone = size_jobs([JobDemand("b", ids[1], times, mem, np.full(120, 0.1))], NOW, params)["b"]
    live = size_jobs([d for d in demands if d.job_id == "b"], NOW, params)["b"]
    assert alone.mem == live.mem == 10 * GIB


def test_plan_frees_a_device_records_reasons_and_applies(any_store: Store):
    ids = seed(any_store)
    settings = Settings(consolidate_min_history_s=3600.0)
    plan_id, plan = make_consolidation_plan(any_store, settings, now=NOW)
    # both small jobs go next to the one that may not move: two devices come free
    assert [(m.job_id, m.to_device_id, m.reason) for m in plan.moves] == [("a", ids[2], "free_device"),
                                                                          ("b", ids[2], "free_device")]
    assert plan.devices_held == 3 and plan.devices_needed == 1 and sorted(plan.devices_freed) == [ids[0], ids[1]]
    assert n_actions(any_store) == 0  # a dry run records the plan only
    with any_store.session() as s:
        row = s.get(Plan, plan_id)
        assert row.policy == POLICY and not row.applied and row.devices_freed == 2
        assert row.moves[0]["rules"] == ["free_device"] and row.moves[0]["to_device_id"] in ids.values()
        assert row.summary["move_reasons"][0]["reason"] == "free_device"
    plan_id, plan = make_consolidation_plan(any_store, settings, now=NOW + 1, apply=True)
    assert n_actions(any_store) == 2
    with any_store.session() as s:
        actions = s.scalars(select(Action).order_by(Action.id)).all()
        assert [(a.workflow_id, a.state, a.plan_id, a.to_device_id) for a in actions] == [
            ("a", "planned", plan_id, ids[2]), ("b", "planned", plan_id, ids[2])]


def test_a_job_registered_but_not_started_holds_its_lane(any_store: Store):
    ids = seed(any_store)
    with any_store.session() as s:
        # c in a 6 GiB lane, and beside it a 9 GiB lane `fleetlens run` gave a job a moment ago: 1 GiB is left
        busy = Lane(device_id=ids[2], size_bytes=6 * GIB, compute_share=0.5, state="open", created_at=NOW)
        new = Lane(device_id=ids[2], size_bytes=9 * GIB, compute_share=0.5, state="open", created_at=NOW)
        s.add_all([busy, new])
        s.flush()
        s.scalars(select(Placement).where(Placement.workflow_id == "c")).one().lane_id = busy.id
        upsert_workflow(s, "e", now=NOW, managed=True, movable=True, command=["python", "t.py"],
                        mem_persistent=7 * GIB, mem_ephemeral=GIB, id_source="managed")
        s.add(Placement(workflow_id="e", device_id=ids[2], lane_id=new.id, host_id="h1", pid=None, state="pending",
                        mem_persistent=7 * GIB, mem_ephemeral=GIB, started_at=NOW))
    _, plan = make_consolidation_plan(any_store, Settings(consolidate_min_history_s=3600.0), now=NOW)
    # a and b no longer both go next to c: a joins b instead, and e is not moved
    assert [(m.job_id, m.to_device_id) for m in plan.moves] == [("a", ids[1])]
    assert plan.sizes["e"].why == "declared" and plan.sizes["e"].mem == 8 * GIB


def test_a_job_on_its_way_into_a_lane_holds_its_room_there(any_store: Store):
    ids = seed(any_store)
    settings = Settings(consolidate_min_history_s=3600.0)
    with any_store.session() as s:
        # a is on its way into a new 9 GiB lane next to c: c's 4.6 GiB lane and b's 3.5 GiB would not fit beside it
        lane = Lane(device_id=ids[2], size_bytes=9 * GIB, compute_share=0.5, state="open", created_at=NOW)
        s.add(lane)
        s.flush()
        plan_action(s, "a", "pack", ids[0], ids[2], lane.id, now=NOW - 5, message="by hand", settings=settings,
                    detail={"p_prime": int(2.2 * GIB), "ephemeral": 0, "persistent": 2 * GIB})
    _, plan = make_consolidation_plan(any_store, settings, now=NOW)
    assert plan.moves and all(m.to_device_id != ids[2] for m in plan.moves)
    assert plan.sizes["arriving:a"].mem == 9 * GIB


def test_a_job_on_two_devices_keeps_both(any_store: Store):
    with any_store.session() as s:
        register_host(s, "h1", hostname="h1", source="replay", now=NOW)
        ids = register_devices(s, "h1", [DeviceSpec(i, f"GPU-{i}", "T4", 16 * GIB) for i in range(3)],
                               source="replay", now=NOW)
        upsert_workflow(s, "ddp", now=NOW, managed=True, movable=True, command=["python", "t.py"],
                        id_source="managed", gpus=2)
        upsert_workflow(s, "c", now=NOW, managed=True, command=["python", "t.py"], id_source="managed")
        for name, dev in (("ddp", ids[0]), ("ddp", ids[1]), ("c", ids[2])):
            s.add(Placement(workflow_id=name, device_id=dev, host_id="h1", pid=100, started_at=NOW - 7200))
    write_samples(any_store, [], [dict(device_id=dev, workflow_id=name, host_id="h1", pid=100, ts=NOW - 60.0 * k,
                                       mem_used=2 * GIB, sm_util=0.1, cpu_util=None)
                                  for k in range(120) for name, dev in (("ddp", ids[0]), ("ddp", ids[1]),
                                                                        ("c", ids[2]))])
    _, plan = make_consolidation_plan(any_store, Settings(consolidate_min_history_s=3600.0), now=NOW)
    # small and idle on each of its devices, but one rank of a two-device job is never moved off on its own
    assert plan.moves == [] and plan.devices_freed == []
    assert plan.devices_held == plan.devices_needed == 3
    assert {j: s.why for j, s in plan.sizes.items()} == {"ddp#0": "whole_device", "ddp#1": "whole_device",
                                                          "c": "steady"}


def test_work_since_the_latest_checkpoint_is_each_moves_cost(any_store: Store):
    ids = seed(any_store)
    with any_store.session() as s:
        for name, ts in (("a", NOW - 7200.0), ("a", NOW - 600.0), ("b", NOW - 5400.0), ("b", NOW + 60.0)):
            record_checkpoint(s, name, host_id="h1", url=f"file:///ck/{name}/{ts}", step=1, sha256="0" * 64,
                              size_bytes=1, now=ts)
    with any_store.session() as s:
        _, demands, _ = load_demands(s, Settings(), NOW, ConsolidateParams())
    since = {d.job_id: d.since_checkpoint_s for d in demands}
    # a: its newest checkpoint; b: the one after `now` is not seen yet; c never checkpointed
    assert since == {"a": 600.0, "b": 5400.0, "c": 0.0}
    # b's 90 minutes of work at stake outweigh the hour its device would come back: only a moves
    _, plan = make_consolidation_plan(any_store, Settings(consolidate_min_history_s=3600.0), now=NOW)
    assert [(m.job_id, m.to_device_id, m.cost_s) for m in plan.moves] == [("a", ids[2], 630.0)]


def test_short_history_moves_nothing(any_store: Store):
    seed(any_store, minutes=10)
    _, plan = make_consolidation_plan(any_store, Settings(), now=NOW)
    assert plan.moves == [] and plan.sizes["a"].why == "short_history"


def test_the_live_cycle_consolidates_once_per_interval(any_store: Store):
    seed(any_store)
    settings = Settings(enforce=True, enforce_drive_s=0, consolidate_interval_s=900.0)
    first = run_cycle(any_store, settings, now=NOW)
    assert first["consolidation"]["moves"] == 2 and first["consolidation"]["outcome"]["applied"]
    assert not consolidation_due(any_store, settings, NOW + 60)
    assert run_cycle(any_store, settings, now=NOW + 60)["consolidation"] is None
    assert consolidation_due(any_store, settings, NOW + 900)


def test_enforce_cli_runs_a_consolidation_cycle(fleet_home, sqlite_store: Store, monkeypatch, capsys):
    ids = seed(sqlite_store, now=time.time())
    monkeypatch.setenv("FLEETLENS_DB_URL", str(sqlite_store.url))
    assert run(["enforce", "--policy", "consolidate"]) == 0
    out = capsys.readouterr().out
    assert "free_device" in out and "dry run" in out and f"freed: {ids[0]}, {ids[1]}" in out
    assert n_actions(sqlite_store) == 0
    assert run(["enforce", "--policy", "consolidate", "--apply"]) == 0
    assert n_actions(sqlite_store) == 2


def seed_three_hosts(store: Store, location: str, minutes: int = 120) -> dict[str, int]:
    """Three hosts of one 16 GiB device each: a small movable job "a" on h1 checkpointing into `location`; jobs
    that may not move on h2 (the fuller: best fit's first choice) and h3."""
    ids = {}
    with store.session() as s:
        for host in ("h1", "h2", "h3"):
            register_host(s, host, hostname=host, source="replay", now=NOW)
            ids[host] = register_devices(s, host, [DeviceSpec(0, f"GPU-{host}", "T4", 16 * GIB)],
                                         source="replay", now=NOW)[0]
        for name, host, movable in (("a", "h1", True), ("b", "h2", False), ("c", "h3", False)):
            upsert_workflow(s, name, now=NOW, managed=True, movable=movable, command=["python", "t.py"],
                            id_source="managed", state="running", checkpoint_url=location if name == "a" else None)
            s.add(Placement(workflow_id=name, device_id=ids[host], host_id=host, pid=100,
                            started_at=NOW - 60 * minutes))
    rows = [dict(device_id=ids[host], workflow_id=name, host_id=host, pid=100, ts=NOW - 60.0 * k, mem_used=mem,
                 sm_util=0.1, cpu_util=None)
            for k in range(minutes) for name, host, mem in (("a", "h1", 2 * GIB), ("b", "h2", 6 * GIB),
                                                              ("c", "h3", 3 * GIB))]
    write_samples(store, [], rows)
    return ids


def test_consolidation_moves_a_job_only_to_a_host_that_can_read_its_checkpoints(any_store: Store, tmp_path):
    location = str(tmp_path / "shared" / "a")
    ids = seed_three_hosts(any_store, location)
    with any_store.session() as s:
        record_probes(s, "h2", [(location, f"{location} is not a folder this host can see")], now=NOW)
        record_probes(s, "h3", [(location, None)], now=NOW)
        _, demands, hosts = load_demands(s, Settings(), NOW, ConsolidateParams())
    assert {d.job_id: d.readable_hosts for d in demands}["a"] == frozenset({"h3"})
    assert hosts == {ids["h1"]: "h1", ids["h2"]: "h2", ids["h3"]: "h3"}
    settings = Settings(consolidate_min_history_s=3600.0)
    plan_id, plan = make_consolidation_plan(any_store, settings, now=NOW + 1, apply=True)
    assert [(m.job_id, m.from_device_id, m.to_device_id) for m in plan.moves] == [("a", ids["h1"], ids["h3"])]
    assert plan.devices_freed == [ids["h1"]] and plan.refused == []
    with any_store.session() as s:
        assert [(a.workflow_id, a.to_device_id, a.plan_id) for a in s.scalars(select(Action))] == [
            ("a", ids["h3"], plan_id)]


def test_consolidation_keeps_a_job_no_host_with_room_can_read_and_records_why(any_store: Store, tmp_path):
    location = str(tmp_path / "shared" / "a")
    ids = seed_three_hosts(any_store, location)
    with any_store.session() as s:
        record_probes(s, "h2", [(location, f"{location} is not a folder this host can see")], now=NOW)
        record_probes(s, "h3", [(location, None)], now=NOW - 3600)  # said so an hour ago: its agent may be gone
    settings = Settings(consolidate_min_history_s=3600.0)
    # applied without complaint: the plan holds no move apply_plan would refuse
    plan_id, plan = make_consolidation_plan(any_store, settings, now=NOW + 1, apply=True)
    assert plan.moves == [] and plan.devices_freed == [] and n_actions(any_store) == 0
    (refusal,) = plan.refused
    assert (refusal["workflow_id"], refusal["from_device_id"], refusal["to_device_id"]) == ("a", ids["h1"],
                                                                                            ids["h2"])
    assert f"host h2 cannot read {location}: {location} is not a folder this host can see" in refusal["reason"]
    with any_store.session() as s:
        assert s.get(Plan, plan_id).summary["refused"] == plan.refused
    # a job checkpointing into its own host's FLEETLENS_HOME is kept too, with that reason
    with any_store.session() as s:
        s.get(Workflow, "a").checkpoint_url = None
    _, homebound = make_consolidation_plan(any_store, settings, now=NOW + 2)
    assert homebound.moves == [] and "own FLEETLENS_HOME" in homebound.refused[0]["reason"]


def test_admission_trusts_memory_seen_for_steps_before_consolidation_trusts_its_history(any_store: Store):
    # two rules on purpose (enforcer.consolidation_sizing's docstring): 30 one-minute samples are enough steps for
    # admission to know a's memory, and not enough history for consolidation to co-locate it by its peak
    seed(any_store, minutes=30)
    with any_store.session() as s:
        assert known_memory(s, s.get(Workflow, "a"), Settings().memory_seen_steps) == (2 * GIB, 0)
    _, plan = make_consolidation_plan(any_store, Settings(), now=NOW)
    assert plan.moves == [] and plan.sizes["a"].why == "short_history" and not plan.sizes["a"].shareable
    _, plan = make_consolidation_plan(any_store, Settings(consolidate_min_history_s=1200.0), now=NOW + 1)
    assert [m.job_id for m in plan.moves] == ["a", "b"]
