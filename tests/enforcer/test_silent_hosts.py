"""A host whose agent has gone silent (crashed, powered off, cut off): its devices are neither where the planner or
consolidation moves a job nor where they take one from, and the plan says why; a host heard from lately is planned
as before. A Slurm node's liveness is what its importer last recorded, not an agent's heartbeat; and a node Slurm
reports down, not responding or failed is not heard from, whatever its agent says, while one drained, draining, in
maintenance or reserved is alive but takes no job: its jobs may leave it, none may come."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import func, select, update

from collector.importers.slurm import record_view
from enforcer.consolidation_store import make_consolidation_plan
from enforcer.fleet_state import read_fleet_state
from enforcer.migration import MoveRefused, start_migration
from enforcer.plan_store import apply_plan, make_plan
from store.checkpoints import record_probes
from store.db import Store
from store.errors import InvalidInput
from store.findings import FindingSpec, upsert_finding
from store.ingest import write_samples
from store.models import Action, Host, Lane, Placement, Plan, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.slurm import SlurmView, parse_nodes
from store.workflows import sign_workflow_spec, upsert_workflow
from tests.fakes.fake_slurm import META

GIB = 2**30
NOW = 1_800_000_000.0


def _seed(store: Store, location: str, h2_heard: float, minutes: int = 60) -> dict[tuple[str, int], int]:
    """h1 (heard from now): one 16 GiB device, an idle movable job checkpointing into the shared `location`.
    h2 (heard from at `h2_heard`): two 16 GiB devices, an idle movable job on the first (its checkpoints on its own
    host), a busy job that may not move on the second. Both hosts said, when last heard from, that they can read
    `location`; each job has `minutes` of per-minute samples up to when its host was last heard from."""
    ids: dict[tuple[str, int], int] = {}
    with store.session() as s:
        for host, n, heard in (("h1", 1, NOW), ("h2", 2, h2_heard)):
            register_host(s, host, hostname=host, source="replay", now=heard - 60 * minutes)
            got = register_devices(s, host, [DeviceSpec(i, f"GPU-{host}-{i}", "T4", 16 * GIB) for i in range(n)],
                                   source="replay", now=heard - 60 * minutes)
            ids.update({(host, i): d for i, d in got.items()})
            s.execute(update(Host).where(Host.id == host).values(last_seen=heard))  # the agent's last flush
        for name, host, dev, p, movable, url in (("idle-1", "h1", 0, GIB, True, location),
                                                 ("idle-2", "h2", 0, GIB, True, None),
                                                 ("busy-2", "h2", 1, 6 * GIB, False, None)):
            upsert_workflow(s, name, now=NOW - 60 * minutes, managed=True, movable=movable,
                            command=["python", "train.py"], mem_persistent=p, mem_ephemeral=0, id_source="managed",
                            state="running", checkpoint_url=url)
            s.add(Placement(workflow_id=name, device_id=ids[(host, dev)], host_id=host, pid=100,
                            mem_persistent=p, mem_ephemeral=0, started_at=NOW - 60 * minutes))
            if movable:
                upsert_finding(s, FindingSpec(rule="idle_holder", workflow_id=name, source="telemetry",
                                              severity="high", title="t", fix="f",
                                              evidence={"util_mean_while_idle": 0.01},
                                              device_id=ids[(host, dev)], gpu_hours_per_day=10.0), now=NOW)
        record_probes(s, "h1", [(location, None)], now=NOW)
        record_probes(s, "h2", [(location, None)], now=h2_heard)
    rows = [dict(device_id=ids[(host, dev)], workflow_id=name, host_id=host, pid=100,
                 ts=(NOW if host == "h1" else h2_heard) - 60.0 * k, mem_used=mem, sm_util=util, cpu_util=None)
            for k in range(minutes)
            for name, host, dev, mem, util in (("idle-1", "h1", 0, GIB, 0.01), ("idle-2", "h2", 0, GIB, 0.01),
                                               ("busy-2", "h2", 1, 6 * GIB, 0.5))]
    write_samples(store, [], rows)
    return ids


# heard from 150 s ago: past the default silence limit (120 s)
SILENT = NOW - 150.0
# its last storage probe still counts: the storage rule alone would let jobs move onto it
PROBES_KEPT = Settings(storage_probe_max_age_s=900.0)


@pytest.mark.parametrize("silent_s", [150.0, 600.0])
def test_the_planner_moves_nothing_onto_or_off_a_silent_host_and_says_why(any_store: Store, tmp_path,
                                                                           silent_s: float) -> None:
    _seed(any_store, str(tmp_path / "shared"), NOW - silent_s)
    result = make_plan(any_store, "pack", settings=PROBES_KEPT, now=NOW)
    # neither idle-2 within its silent host, nor idle-1 onto it: nothing the silent host's agent would have to do
    assert result.moves == [] and result.devices_freed == [] and result.refused == []
    assert result.skipped["on a host not heard from"] == 1  # idle-2: its agent could not checkpoint it
    assert result.skipped["no device has room"] == 1  # idle-1: the only room was on the silent host
    with any_store.session() as s:
        summary = s.get(Plan, result.plan_id).summary
    assert summary["not_heard_from"] == {"h2": f"has not been heard from for {silent_s:.0f} s (more than 120 s, "
                                               "FLEETLENS_HOST_SILENT_AFTER_S)"}


def test_the_planner_still_plans_a_host_heard_from_lately(any_store: Store, tmp_path) -> None:
    ids = _seed(any_store, str(tmp_path / "shared"), NOW - 5.0)
    result = make_plan(any_store, "pack", settings=PROBES_KEPT, now=NOW)
    assert {(m.workflow_id, m.to_device_id) for m in result.moves} == {("idle-1", ids[("h2", 1)]),
                                                                         ("idle-2", ids[("h2", 1)])}
    assert "on a host not heard from" not in result.skipped
    with any_store.session() as s:
        assert s.get(Plan, result.plan_id).summary["not_heard_from"] == {}


@pytest.mark.parametrize("h2_heard", [SILENT, NOW - 5.0], ids=["silent", "heard-lately"])
def test_consolidation_moves_nothing_onto_or_off_a_silent_host(any_store: Store, tmp_path, h2_heard) -> None:
    ids = _seed(any_store, str(tmp_path / "shared"), h2_heard)
    settings = PROBES_KEPT.model_copy(update={"consolidate_min_history_s": 1200.0})
    _, plan = make_consolidation_plan(any_store, settings, now=NOW)
    summary = plan.summary()
    if h2_heard == SILENT:
        assert plan.moves == [] and plan.devices_freed == []
        assert summary["skipped"] == {"on a host not heard from": 1}  # idle-2 stays where it is
        assert summary["not_heard_from"] == {
            "h2": "has not been heard from for 150 s (more than 120 s, FLEETLENS_HOST_SILENT_AFTER_S)"}
    else:
        assert {(m.job_id, m.to_device_id) for m in plan.moves} == {("idle-1", ids[("h2", 1)]),
                                                                     ("idle-2", ids[("h2", 1)])}
        assert summary["skipped"] == {} and summary["not_heard_from"] == {}


def test_a_plan_applied_after_its_target_went_silent_and_a_move_by_hand_are_refused_with_nothing_recorded(
        any_store: Store, tmp_path) -> None:
    ids = _seed(any_store, str(tmp_path / "shared"), NOW - 5.0)
    result = make_plan(any_store, "pack", settings=PROBES_KEPT, now=NOW)  # a dry run: h2 was heard from then
    assert len(result.moves) == 2
    later = NOW + 300.0  # h1's agent still writes; h2's has been silent for 305 s
    with any_store.session() as s:
        s.execute(update(Host).where(Host.id == "h1").values(last_seen=later))
        sign_workflow_spec(s.get(Workflow, "idle-1"), PROBES_KEPT.secret_bytes())  # as `fleetlens run` registers it
    with pytest.raises(InvalidInput, match="host h2 has not been heard from for 305 s"):
        apply_plan(any_store, result.plan_id, settings=PROBES_KEPT, now=later)
    with pytest.raises(MoveRefused, match="host h2 has not been heard from for 305 s.*could not start the job"):
        start_migration(any_store, "idle-1", ids[("h2", 1)], new_lane_size=2 * GIB, settings=PROBES_KEPT, now=later)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Action)) == 0
        assert s.scalar(select(func.count()).select_from(Lane)) == 0  # no lane opened for a refused move
        assert s.get(Plan, result.plan_id).applied is False
    # heard from again: the same move by hand is begun
    with any_store.session() as s:
        s.execute(update(Host).where(Host.id == "h2").values(last_seen=later))
    assert start_migration(any_store, "idle-1", ids[("h2", 1)], new_lane_size=2 * GIB, settings=PROBES_KEPT,
                           now=later) > 0


def test_an_imported_slurm_node_is_heard_from_when_its_importer_last_recorded_it(sqlite_store: Store) -> None:
    # the Slurm importer registers a node's host once and refreshes its GPUs at every import; no agent runs there
    with sqlite_store.session() as s:
        register_host(s, "node1", hostname="node1", source="slurm", now=NOW - 3600)
        register_devices(s, "node1", [DeviceSpec(0, "slurm:node1:gpu0", "Slurm GPU 0 of node1", None)],
                         source="slurm", now=NOW - 3600)
        register_devices(s, "node1", [DeviceSpec(0, "slurm:node1:gpu0", "Slurm GPU 0 of node1", None)],
                         source="slurm", now=NOW - 10)  # the last import
    with sqlite_store.session() as s:
        assert read_fleet_state(s, now=NOW, settings=Settings()).not_heard_from == {}
        assert read_fleet_state(s, now=NOW + 600, settings=Settings()).not_heard_from == {
            "node1": "has not been heard from for 610 s (more than 120 s, FLEETLENS_HOST_SILENT_AFTER_S)"}


def test_the_silence_limit_follows_the_agents_flush_interval_within_the_command_ttl() -> None:
    assert Settings().host_silence_s == 120.0  # twelve 10 s flushes, two Slurm imports
    assert Settings(flush_interval_s=30.0).host_silence_s == 180.0  # six flushes
    assert Settings(flush_interval_s=120.0).host_silence_s == 300.0  # never past a command's TTL
    assert Settings(flush_interval_s=1.0).host_silence_s == 120.0
    assert Settings(host_silent_after_s=30.0, flush_interval_s=120.0).host_silence_s == 30.0


def _slurm_says(store: Store, node: str, state: str, flags: list[str], reason: str = "", now: float = NOW) -> None:
    """The Slurm import lists `node` (a host whose agent runs there too, its GPUs its own) as sinfo --json gives it."""
    doc = {"meta": META, "errors": [], "nodes": [{"name": node, "state": state, "state_flags": flags,
                                                 "reason": reason, "gres": "gpu:2", "partitions": ["p"]}]}
    record_view(store, SlurmView("22.05.8", parse_nodes(doc)[1]), Settings(), now=now)


# what sinfo --json (openapi v0.0.38) says of a node Slurm does not hear from, or that failed or is off
UNANSWERING = [("down", [], "DOWN"), ("idle", ["NOT_RESPONDING"], "IDLE+NOT_RESPONDING"),
               ("mixed", ["FAIL"], "MIXED+FAIL"), ("idle", ["DRAIN", "NOT_RESPONDING"], "IDLE+DRAIN+NOT_RESPONDING"),
               ("idle", ["POWERED_DOWN"], "IDLE+POWERED_DOWN")]


@pytest.mark.parametrize(("state", "flags", "text"), UNANSWERING, ids=[t for _, _, t in UNANSWERING])
def test_a_slurm_node_that_does_not_answer_slurm_is_not_heard_from_though_its_agent_writes(
        any_store: Store, tmp_path, state: str, flags: list[str], text: str) -> None:
    ids = _seed(any_store, str(tmp_path / "shared"), NOW - 5.0)  # h2's agent wrote 5 s ago
    _slurm_says(any_store, "h2", state, flags, reason="slurmd gone")
    why = (f"is not heard from: Slurm's latest listing shows it {text} (reason: slurmd gone): its slurmd does not "
           "answer Slurm, or the node failed or is powered off")
    with any_store.session() as s:
        assert read_fleet_state(s, now=NOW, settings=PROBES_KEPT).not_heard_from == {"h2": why}
    result = make_plan(any_store, "pack", settings=PROBES_KEPT, now=NOW)
    assert result.moves == [] and result.skipped["on a host not heard from"] == 1  # idle-2 stays on h2
    assert result.skipped["no device has room"] == 1  # idle-1: the only room was on h2
    with any_store.session() as s:
        assert s.get(Plan, result.plan_id).summary["not_heard_from"] == {"h2": why}
    _, plan = make_consolidation_plan(any_store, PROBES_KEPT.model_copy(update={"consolidate_min_history_s": 1200.0}),
                                      now=NOW)
    assert plan.moves == [] and plan.summary()["skipped"] == {"on a host not heard from": 1}
    assert plan.summary()["not_heard_from"] == {"h2": why}
    with any_store.session() as s:
        sign_workflow_spec(s.get(Workflow, "idle-1"), PROBES_KEPT.secret_bytes())
    said = re.escape(f"host h2 is not heard from: Slurm's latest listing shows it {text}")
    with pytest.raises(MoveRefused, match=said):
        start_migration(any_store, "idle-1", ids[("h2", 1)], new_lane_size=2 * GIB, settings=PROBES_KEPT, now=NOW)
    # Slurm hears from it again: planned as before
    _slurm_says(any_store, "h2", "mixed", [], now=NOW)
    assert {m.workflow_id for m in make_plan(any_store, "pack", settings=PROBES_KEPT, now=NOW).moves} == {
        "idle-1", "idle-2"}


# what sinfo --json says of a node that runs its jobs on but takes no new one (`drained` is idle with DRAIN)
CLOSED = [("mixed", ["DRAIN"], "MIXED+DRAIN"), ("idle", ["DRAIN"], "IDLE+DRAIN"),
          ("idle", ["MAINTENANCE", "RESERVED"], "IDLE+MAINTENANCE+RESERVED"), ("mixed", ["RESERVED"], "MIXED+RESERVED")]


@pytest.mark.parametrize(("state", "flags", "text"), CLOSED, ids=[t for _, _, t in CLOSED])
def test_a_draining_slurm_node_takes_no_job_but_its_jobs_may_leave(any_store: Store, tmp_path, state: str,
                                                                    flags: list[str], text: str) -> None:
    ids = _seed(any_store, str(tmp_path / "shared"), NOW - 5.0)
    with any_store.session() as s:  # idle-2 checkpoints where h1 can read too: it may leave its host
        s.get(Workflow, "idle-2").checkpoint_url = str(tmp_path / "shared")
    _slurm_says(any_store, "h2", state, flags, reason="swap a fan")
    why = f"takes no new job: Slurm's latest listing shows it {text} (reason: swap a fan): its jobs run on, but " \
          "Slurm starts no new job there"
    with any_store.session() as s:
        state_now = read_fleet_state(s, now=NOW, settings=PROBES_KEPT)
    assert state_now.closed == {"h2": why} and state_now.not_heard_from == {}
    # idle-1 is not moved onto h2 (the only room); idle-2 leaves h2 for h1, next to idle-1
    result = make_plan(any_store, "pack", settings=PROBES_KEPT, now=NOW)
    assert [(m.workflow_id, m.to_device_id) for m in result.moves] == [("idle-2", ids[("h1", 0)])]
    assert result.skipped["no device has room"] == 1 and "on a host not heard from" not in result.skipped
    with any_store.session() as s:
        summary = s.get(Plan, result.plan_id).summary
    assert summary["closed"] == {"h2": why} and summary["not_heard_from"] == {}
    _, plan = make_consolidation_plan(any_store, PROBES_KEPT.model_copy(update={"consolidate_min_history_s": 1200.0}),
                                      now=NOW)
    assert [(m.job_id, m.to_device_id) for m in plan.moves] == [("idle-2", ids[("h1", 0)])]
    assert plan.summary()["closed"] == {"h2": why} and plan.devices_freed == [ids[("h2", 0)]]
    # a move by hand onto it is refused, with nothing recorded
    with any_store.session() as s:
        sign_workflow_spec(s.get(Workflow, "idle-1"), PROBES_KEPT.secret_bytes())
    said = re.escape(f"host h2 takes no new job: Slurm's latest listing shows it {text}")
    with pytest.raises(MoveRefused, match=said):
        start_migration(any_store, "idle-1", ids[("h2", 1)], new_lane_size=2 * GIB, settings=PROBES_KEPT, now=NOW)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Action)) == 0
