"""A detection run resolves a telemetry finding only on evidence that it is gone: its device reported in the window
without the pattern, or its workflow ended there. A host whose agent is down (or cut off) while others report keeps
its findings, and their acknowledgement, as they are."""

from __future__ import annotations

from sqlalchemy import delete, select, update

from analyzer.telemetry import detect
from store.findings import set_finding_status
from store.models import Finding, Host, Workflow
from tests.analyzer.telemetry_fleet import Fleet

WINDOW = 3 * 3600


def _rows(store) -> dict[tuple[str, int, str], tuple[int, str, float]]:
    """(workflow, device, rule) -> (id, status, updated_at) of every telemetry finding."""
    with store.session() as s:
        return {(f.workflow_id, f.device_id, f.rule): (f.id, f.status, f.updated_at)
                for f in s.scalars(select(Finding).where(Finding.source == "telemetry"))}


def _two_idle_hosts(store) -> tuple[Fleet, int, int]:
    """Host a and host b, one idle holder on each for three hours, detected; the idle holder on a acknowledged."""
    fleet = Fleet(store)
    a, b = fleet.device(host="a"), fleet.device(host="b")
    fleet.workflow("on-a")
    fleet.workflow("on-b")
    fleet.run(a, "on-a", 0, 180, util=0.0, mem_gib=70)
    fleet.run(b, "on-b", 0, 180, util=0.0, mem_gib=70)
    fleet.flush()
    found = detect(store, now=fleet.minute(180), window_s=WINDOW)
    assert {(f.workflow_id, f.rule) for f in found} >= {("on-a", "idle_holder"), ("on-b", "idle_holder")}
    with store.session() as s:
        held = s.scalar(select(Finding.id).where(Finding.workflow_id == "on-a", Finding.rule == "idle_holder"))
        set_finding_status(s, held, "acknowledged", by="ops")
    return fleet, a, b


def test_a_silent_host_keeps_its_findings_while_another_host_reports(any_store):
    fleet, a, b = _two_idle_hosts(any_store)
    before = _rows(any_store)
    # the next three hours host a's agent is down; host b reports, its job now busy
    fleet.run(b, "on-b", 180, 360, util=0.95, mem_gib=70)
    fleet.flush()
    assert detect(any_store, now=fleet.minute(360), window_s=WINDOW) == []
    after = _rows(any_store)
    on_a = {k for k in before if k[0] == "on-a"}
    assert on_a and {k: after[k] for k in on_a} == {k: before[k] for k in on_a}  # untouched: not even refreshed
    assert after["on-a", a, "idle_holder"][1] == "acknowledged"
    assert {after[k][1] for k in before if k[0] == "on-b"} == {"resolved"}  # b was seen without the pattern

    # host a comes back, its job still idle: the same rows, still acknowledged
    fleet.run(a, "on-a", 360, 540, util=0.0, mem_gib=70)
    fleet.run(b, "on-b", 360, 540, util=0.95, mem_gib=70)
    fleet.flush()
    found = detect(any_store, now=fleet.minute(540), window_s=WINDOW)
    assert {(f.workflow_id, f.device_id, f.rule): f.id for f in found} == {k: before[k][0] for k in on_a}
    assert _rows(any_store)["on-a", a, "idle_holder"][1] == "acknowledged"


def test_a_host_back_without_the_pattern_resolves_its_findings(sqlite_store):
    fleet, a, b = _two_idle_hosts(sqlite_store)
    fleet.run(b, "on-b", 180, 360, util=0.0, mem_gib=70)  # a silent, b still idle
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW)
    assert {s for (wf, _, _), (_, s, _) in _rows(sqlite_store).items()} == {"open", "acknowledged"}
    # a reports again, its job now busy: a was seen without the pattern
    fleet.run(a, "on-a", 360, 540, util=0.95, mem_gib=70)
    fleet.run(b, "on-b", 360, 540, util=0.0, mem_gib=70)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(540), window_s=WINDOW)
    rows = _rows(sqlite_store)
    assert {s for (wf, _, _), (_, s, _) in rows.items() if wf == "on-a"} == {"resolved"}
    assert {s for (wf, _, _), (_, s, _) in rows.items() if wf == "on-b"} == {"open"}


def test_a_workflow_on_two_hosts_is_judged_on_each_device_that_reported(sqlite_store):
    fleet = Fleet(sqlite_store)
    a, b = fleet.device(host="a"), fleet.device(host="b")
    fleet.workflow("both", gpus=2)
    fleet.run(a, "both", 0, 180, util=0.0, mem_gib=70)
    fleet.run(b, "both", 0, 180, util=0.0, mem_gib=70, pid=200)
    fleet.flush()
    assert {f.device_id for f in detect(sqlite_store, now=fleet.minute(180), window_s=WINDOW)} == {a, b}
    # host a falls silent; on host b the job works hard
    fleet.run(b, "both", 180, 360, util=0.95, mem_gib=70, pid=200)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW)
    rows = _rows(sqlite_store)
    assert {s for (_, dev, _), (_, s, _) in rows.items() if dev == a} == {"open"}
    assert {s for (_, dev, _), (_, s, _) in rows.items() if dev == b} == {"resolved"}


def test_findings_of_an_ended_workflow_resolve_as_before(sqlite_store):
    fleet = Fleet(sqlite_store)
    a, b, c = fleet.device(host="a"), fleet.device(host="b"), fleet.device(host="c")
    for wf in ("ended-silent", "finished-silent", "ended-seen", "busy"):
        fleet.workflow(wf)
    # its processes on host a ended (the agent recorded it), then host a went down
    fleet.process("ended-silent", "a", 100, 0, ended_min=180)
    fleet.run(a, "ended-silent", 0, 180, util=0.0, mem_gib=70)
    # a Slurm job the scheduler reports finished while its node's agent is down
    fleet.run(b, "finished-silent", 0, 180, util=0.0, mem_gib=70)
    # ended, and its device still reports (free now)
    fleet.process("ended-seen", "c", 100, 0, ended_min=180)
    fleet.run(c, "ended-seen", 0, 180, util=0.0, mem_gib=70)
    fleet.flush()
    first = detect(sqlite_store, now=fleet.minute(180), window_s=WINDOW)
    assert {f.workflow_id for f in first} == {"ended-silent", "finished-silent", "ended-seen"}
    with sqlite_store.session() as s:
        s.execute(update(Workflow).where(Workflow.id == "finished-silent").values(state="finished"))
    fleet.run(c, None, 180, 360, util=0.0, mem_gib=0)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW)
    assert {s for _, s, _ in _rows(sqlite_store).values()} == {"resolved"}


def test_zombie_memory_on_a_silent_host_stays_open_until_its_device_reports_it_freed(sqlite_store):
    fleet = Fleet(sqlite_store)
    a, b = fleet.device(host="a"), fleet.device(host="b")
    fleet.workflow("gone")
    fleet.workflow("busy")
    fleet.process("gone", "a", 7, 0, ended_min=60)
    fleet.run(a, "gone", 0, 60, util=0.8, mem_gib=50, pid=7)
    fleet.run(a, None, 60, 180, util=0.0, mem_gib=50)
    fleet.run(b, "busy", 0, 180, util=0.95, mem_gib=70)
    fleet.flush()
    assert [f.rule for f in detect(sqlite_store, now=fleet.minute(180), window_s=WINDOW)] == ["zombie_memory"]
    # host a is silent: its workflow ended long ago, but the memory it left may still be held
    fleet.run(b, "busy", 180, 360, util=0.95, mem_gib=70)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW)
    assert [s for _, s, _ in _rows(sqlite_store).values()] == ["open"]
    # host a reports again, the memory freed
    fleet.run(a, None, 360, 540, util=0.0, mem_gib=0)
    fleet.run(b, "busy", 360, 540, util=0.95, mem_gib=70)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(540), window_s=WINDOW)
    assert [s for _, s, _ in _rows(sqlite_store).values()] == ["resolved"]


def test_findings_of_a_device_no_longer_in_the_store_resolve(sqlite_store):
    fleet, a, b = _two_idle_hosts(sqlite_store)
    with sqlite_store.session() as s:
        s.execute(delete(Host).where(Host.id == "a"))  # the host left the fleet: its devices go with it
    fleet.run(b, "on-b", 180, 360, util=0.0, mem_gib=70)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW)
    rows = _rows(sqlite_store)
    assert {s for (wf, _, _), (_, s, _) in rows.items() if wf == "on-a"} == {"resolved"}
    assert {s for (wf, _, _), (_, s, _) in rows.items() if wf == "on-b"} == {"open"}
