"""Memory in admission, on SQLite and PostgreSQL: a job of unknown memory runs alone until its memory has been seen
for `memory_seen_steps` steps (SDK) or process samples (NVML), on both sides (`fleetlens run` and the planner);
memory that processes outside the placements use is never handed out; a job bigger than any device is refused."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from enforcer.managed import PlacementError, register_managed
from enforcer.migration import start_migration
from enforcer.plan_store import load_state, make_plan
from store.db import Store
from store.device_memory import MEM_STEPS_LABEL, unplaced_memory
from store.errors import InvalidInput
from store.findings import FindingSpec, upsert_finding
from store.ingest import write_samples
from store.models import Action, Lane, Placement, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings, get_settings
from store.workflows import sign_workflow_spec, upsert_workflow
from tests.conftest import PROJECT_ROOT

GIB = 2**30
NOW = 1_800_000_000.0
SEEN = 5  # memory_seen_steps in these tests


def host(store: Store, n: int = 2, size: int = 8 * GIB) -> dict[int, int]:
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="nvml", now=NOW)
        return register_devices(s, "h1", [DeviceSpec(i, f"GPU-{i}", "T4", size) for i in range(n)], source="nvml",
                                now=NOW)


def settings(fleet_home) -> Settings:
    return Settings(home=fleet_home, host_id="h1", memory_seen_steps=SEEN, secret="t")


def register(store: Store, s: Settings, workflow_id: str, **options):
    return register_managed(store, ["python", "train.py"], settings=s, lane="auto", workflow_id=workflow_id,
                            cwd=PROJECT_ROOT, policy="pack", util=0.2, **options)


def sdk_memory(store: Store, workflow_id: str, persistent: int, steps: int) -> None:
    """What the agent's SDK handlers write once a job has reported its memory for `steps` steps."""
    with store.session() as s:
        wf = s.get(Workflow, workflow_id)
        wf.mem_persistent, wf.mem_ephemeral = persistent, persistent // 10
        wf.labels = {**(wf.labels or {}), "mem_source": "cuda", MEM_STEPS_LABEL: steps}
        for p in s.scalars(select(Placement).where(Placement.workflow_id == workflow_id)):
            p.state = "ended"  # the job ended; it is started again below


def test_unknown_memory_runs_alone_until_seen_for_enough_steps(any_store: Store, fleet_home) -> None:
    host(any_store)
    s = settings(fleet_home)
    first = register(any_store, s, "grows")
    assert first.lane_id is None and first.extra["alone"] == "its memory is not known yet"
    with any_store.session() as session:
        placement = session.get(Placement, first.placement_ids[0])
        assert placement.mem_persistent is None  # nobody plans with a guess
    sdk_memory(any_store, "grows", GIB, steps=SEEN - 1)
    again = register(any_store, s, "grows")
    assert again.lane_id is None and "alone" in again.extra  # seen, but not for long enough
    sdk_memory(any_store, "grows", GIB, steps=SEEN)
    known = register(any_store, s, "grows")
    assert known.lane_id is not None and not known.extra
    with any_store.session() as session:
        placement = session.get(Placement, known.placement_ids[0])
        assert placement.mem_persistent == GIB  # P as measured: the lane charged it P' = 1.1 P


def test_nvml_per_process_memory_seen_long_enough_makes_a_job_known(any_store: Store, fleet_home) -> None:
    ids = host(any_store)
    s = settings(fleet_home)
    first = register(any_store, s, "no-sdk")
    assert first.lane_id is None
    with any_store.session() as session:
        for p in session.scalars(select(Placement)):
            p.state = "ended"
    rows = [dict(device_id=ids[0], workflow_id="no-sdk", host_id="h1", pid=7, ts=NOW + i, mem_used=GIB // 2)
            for i in range(SEEN - 1)]
    write_samples(any_store, [], rows)
    assert register(any_store, s, "no-sdk").lane_id is None
    with any_store.session() as session:
        for p in session.scalars(select(Placement)):
            p.state = "ended"
    write_samples(any_store, [], [dict(device_id=ids[0], workflow_id="no-sdk", host_id="h1", pid=7, ts=NOW + 99,
                                       mem_used=GIB)])
    known = register(any_store, s, "no-sdk")
    assert known.lane_id is not None
    with any_store.session() as session:
        assert session.get(Placement, known.placement_ids[0]).mem_persistent >= GIB  # its largest use, as measured


def test_the_planner_moves_a_job_only_once_its_memory_was_seen_long_enough(any_store: Store, fleet_home) -> None:
    ids = host(any_store, n=2, size=16 * GIB)
    s = settings(fleet_home)
    with any_store.session() as session:
        for name, device, p in (("idle", ids[0], 2 * GIB), ("busy", ids[1], 4 * GIB)):
            upsert_workflow(session, name, now=NOW, managed=True, movable=True, command=["python", "t.py"],
                            id_source="managed", mem_persistent=p, mem_ephemeral=0,
                            labels={"mem_source": "cuda", MEM_STEPS_LABEL: SEEN})
            session.add(Placement(workflow_id=name, device_id=device, host_id="h1", pid=1, started_at=NOW))
        session.get(Workflow, "idle").labels = {"mem_source": "cuda", MEM_STEPS_LABEL: SEEN - 1}
        upsert_finding(session, FindingSpec(rule="idle_holder", workflow_id="idle", source="telemetry",
                                            severity="high", title="t", fix="f",
                                            evidence={"util_mean_while_idle": 0.01}, device_id=ids[0],
                                            gpu_hours_per_day=10.0), now=NOW)
    early = make_plan(any_store, "pack", settings=s, now=NOW)
    assert early.moves == [] and early.skipped.get("memory unknown") == 1
    with any_store.session() as session:
        session.get(Workflow, "idle").labels = {"mem_source": "cuda", MEM_STEPS_LABEL: SEEN}
    later = make_plan(any_store, "pack", settings=s, now=NOW)
    assert [(m.workflow_id, m.to_device_id) for m in later.moves] == [("idle", ids[1])]


def test_memory_used_outside_the_placements_is_never_handed_out(any_store: Store, fleet_home) -> None:
    ids = host(any_store)
    s = settings(fleet_home)
    # device 0: an unmanaged process holds 7.5 of 8 GiB (seen per process, the device sample is older and lower)
    write_samples(any_store, [dict(device_id=ids[0], ts=NOW - 60, mem_used=GIB, mem_total=8 * GIB)],
                  [dict(device_id=ids[0], workflow_id="someone-else", host_id="h1", pid=9, ts=NOW,
                        mem_used=int(7.5 * GIB))])
    # device 1: the device sample shows 7 GiB used, and no process list explains it
    write_samples(any_store, [dict(device_id=ids[1], ts=NOW, mem_used=7 * GIB, mem_total=8 * GIB)], [])
    with any_store.session() as session:
        assert unplaced_memory(session, list(ids.values()), {}, {}) == {ids[0]: int(7.5 * GIB), ids[1]: 7 * GIB}
        devices, _ = load_state(session, s, NOW)
        assert {d.device_id: d.foreign for d in devices} == {ids[0]: int(7.5 * GIB), ids[1]: 7 * GIB}
    with pytest.raises(PlacementError, match="memory used outside fleetlens"):
        register(any_store, s, "wants-2g", mem_bytes=2 * GIB)
    # 1 GiB left on device 1: its 0.58 GiB lane and the default 0.5 GiB context beside it do not fit...
    with pytest.raises(PlacementError, match="memory used outside fleetlens"):
        register(any_store, s, "wants-half", mem_bytes=GIB // 2)
    # ...with a 256 MiB context they do (0.5 GiB on device 0 is still too little)
    small = register(any_store, s.model_copy(update={"context_mb": 256}), "wants-half", mem_bytes=GIB // 2)
    assert small.device_ids == [ids[1]]
    with pytest.raises(PlacementError):  # nor is it there for a whole-device job, though no placement holds it
        register_managed(any_store, ["python", "t.py"], settings=s, workflow_id="whole", cwd=PROJECT_ROOT,
                         devices=[ids[0]], gpus=1, mem_bytes=GIB)


def test_a_job_bigger_than_any_device_is_refused_with_what_it_needs(any_store: Store, fleet_home) -> None:
    host(any_store)
    with pytest.raises(InvalidInput, match=r"needs \d+ bytes on a device .* CUDA context .* more than any device"):
        register(any_store, settings(fleet_home), "huge", mem_bytes=8 * GIB)
    # asking for a whole device does not make it fit: refused the same way, not told to wait for room
    with pytest.raises(InvalidInput, match=r"needs \d+ bytes on a device .* more than any device .* no device can"):
        register_managed(any_store, ["python", "train.py"], settings=settings(fleet_home), gpus=1,
                         workflow_id="huge", cwd=PROJECT_ROOT, mem_bytes=8 * GIB)
    with any_store.session() as session:
        assert session.get(Workflow, "huge") is None  # nothing written


def test_a_lane_smaller_than_the_jobs_persistent_memory_is_refused_when_a_move_is_asked(any_store: Store) -> None:
    ids = host(any_store)
    with any_store.session() as session:
        wf = upsert_workflow(session, "mover", now=NOW, managed=True, command=["python", "t.py"],
                             id_source="managed", state="running")
        sign_workflow_spec(wf, get_settings().secret_bytes())  # as `fleetlens run` registers it
        session.add(Placement(workflow_id="mover", device_id=ids[0], host_id="h1", pid=1, state="active",
                              mem_persistent=GIB, mem_ephemeral=GIB // 4, started_at=NOW))
        small = Lane(device_id=ids[1], size_bytes=GIB, compute_share=0.5, state="open", created_at=NOW)
        session.add(small)
        session.flush()
        small_id = small.id
    with pytest.raises(InvalidInput, match=r"a lane of 536870912 bytes cannot hold 'mover'.* at least 1449551463"):
        start_migration(any_store, "mover", ids[1], settings=get_settings(), new_lane_size=GIB // 2)
    with pytest.raises(InvalidInput, match=r"a lane of 1073741824 bytes cannot hold 'mover'"):
        start_migration(any_store, "mover", ids[1], settings=get_settings(), to_lane_id=small_id)
    with any_store.session() as session:
        assert session.scalars(select(Action)).all() == []  # nothing written
        assert [lane.id for lane in session.scalars(select(Lane))] == [small_id]
    assert start_migration(any_store, "mover", ids[1], settings=get_settings(),
                           new_lane_size=2 * GIB)  # a lane that holds it is fine


def test_on_cpu_devices_a_process_that_ran_on_the_cores_holds_none_of_their_memory(any_store: Store) -> None:
    with any_store.session() as session:
        register_host(session, "c1", hostname="c1", source="cpu", now=NOW)
        (cpu,) = register_devices(session, "c1", [DeviceSpec(0, "cpu:c1:0", "cpu core 0", 8 * GIB, (0,))],
                                  source="cpu", now=NOW).values()
    write_samples(any_store, [dict(device_id=cpu, ts=NOW, mem_used=GIB, mem_total=8 * GIB)],
                  [dict(device_id=cpu, workflow_id="busy-elsewhere", host_id="c1", pid=5, ts=NOW, mem_used=3 * GIB)])
    with any_store.session() as session:
        assert unplaced_memory(session, [cpu], {}, {}) == {cpu: GIB}  # the device's own reading only


def test_consolidation_counts_memory_used_outside_the_placements_too(any_store: Store) -> None:
    from enforcer.consolidation_sizing import ConsolidateParams
    from enforcer.consolidation_store import load_demands

    ids = host(any_store)
    with any_store.session() as session:
        upsert_workflow(session, "placed", now=NOW, managed=True, command=["python", "t.py"], id_source="managed")
        session.add(Placement(workflow_id="placed", device_id=ids[0], host_id="h1", pid=1, started_at=NOW))
    write_samples(any_store, [], [
        dict(device_id=ids[0], workflow_id="placed", host_id="h1", pid=1, ts=NOW, mem_used=3 * GIB),
        dict(device_id=ids[1], workflow_id="someone-else", host_id="h1", pid=2, ts=NOW, mem_used=5 * GIB)])
    with any_store.session() as session:
        devices, _, _ = load_demands(session, Settings(), NOW, ConsolidateParams())
    assert dict(devices) == {ids[0]: 8 * GIB, ids[1]: 3 * GIB}  # its own job's use is not taken off device 0


def test_admission_leaves_a_lane_opened_for_a_move_under_way_to_the_job_on_its_way(any_store: Store,
                                                                                  fleet_home) -> None:
    ids = host(any_store, n=1)  # one 8 GiB device
    s = settings(fleet_home)
    with any_store.session() as session:
        upsert_workflow(session, "mover", now=NOW, managed=True, command=["python", "t.py"], id_source="managed",
                        state="running")
        lane = Lane(device_id=ids[0], size_bytes=5 * GIB, compute_share=0.5, state="open", created_at=NOW)
        session.add(lane)
        session.flush()
        # a move into that lane, begun (its job still on a device of another host, not on this one yet)
        session.add(Action(kind="migrate", engine="agents", workflow_id="mover", from_device_id=None,
                           to_device_id=ids[0], to_lane_id=lane.id, state="checkpoint_requested", attempts=0,
                           created_at=NOW, updated_at=NOW))
    # 3 GiB asks a lane of ~3.5 GiB and a 0.5 GiB context (an NVML GPU's default): it would fit in the device's
    # 8 GiB, not in the 2.5 GiB the move's lane and its job's context leave
    with pytest.raises(PlacementError):
        register(any_store, s, "newcomer", mem_bytes=3 * GIB)
    small = register(any_store, s, "small", mem_bytes=GIB)  # ~1.2 GiB + 0.5: beside the reserved lane, in its own
    with any_store.session() as session:
        placed = session.get(Placement, small.placement_ids[0])
        assert small.device_ids == [ids[0]] and placed.lane_id not in (None, lane.id)
    with any_store.session() as session:  # once the move is over, its lane is no longer held for it
        session.scalar(select(Action)).state = "failed"
        session.get(Lane, lane.id).state = "closed"
    assert register(any_store, s, "newcomer", mem_bytes=3 * GIB).device_ids == [ids[0]]
