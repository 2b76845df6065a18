"""The periodic entry points the DAGs and `fleetlens serve` call, directly on a real seeded SQLite store: their
summaries, and the bad paths (expired requests, nothing to analyse, a plan that can no longer be applied)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select, update

from analyzer import periodic, profiles
from enforcer import cycle
from store import profiling
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.migrations import upgrade
from store.models import Action, Placement, Plan, ProfileRequest, Rollup
from store.settings import Settings
from tests.analyzer.telemetry_fleet import T0, Fleet
from tests.dags.seed import Seeded, flag_idle, seed

HOUR = 3600.0


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[Store, Seeded, Settings]:
    store = Store(f"sqlite:///{tmp_path / 'fleetlens.db'}")
    upgrade(store)
    settings = Settings(home=tmp_path / "home", enforce_drive_s=0)
    out = seed(store, checkpoint_root=str(tmp_path / "checkpoints"), secret=settings.secret_bytes())
    yield store, out, settings
    store.dispose()


def test_rollup_then_retention_keeps_every_sample_until_its_hour_is_rolled_up(seeded) -> None:
    store, out, settings = seeded
    settings = settings.model_copy(update={"retention_days": 0.05})
    kept = periodic.retain(store, settings, now=out.now)  # nothing rolled up yet: nothing may go
    assert (kept["device_samples_deleted"], kept["process_samples_deleted"]) == (0, 0) and kept["hours_kept"] > 0
    both = periodic.rollup_and_retain(store, settings, now=out.now)
    assert both["rollup"]["device_rows"] > 0 and both["retention"]["device_samples_deleted"] > 0


def test_periodic_profile_skips_workflows_with_a_request_open(seeded) -> None:
    store, out, settings = seeded
    periodic.rollup_hours(store, settings, now=out.now)
    with store.session() as s:
        profiling.request_profile(s, "busy-c", 5, now=out.now)
    result = profiles.profile_top_workflows(store, settings, n=2, now=out.now)
    assert [r["workflow_id"] for r in result["requested"]] == ["idle-a", "idle-b"]
    assert result["skipped"] == {"done-d": "not running", "busy-c": "a profile request is already open"}
    with pytest.raises(InvalidInput, match="0 or more"):
        profiles.profile_top_workflows(store, settings, n=-1)
    assert profiles.profile_top_workflows(store, settings, n=0, now=out.now)["requested"] == []


def test_on_demand_steps_report_unknown_expired_and_unfinished_requests(seeded) -> None:
    store, _, settings = seeded
    with pytest.raises(NotFound, match="no workflow 'ghost'"):
        profiles.request_on_demand(store, settings, "ghost", 5)
    with pytest.raises(InvalidInput, match="between 1 and"):
        profiles.request_on_demand(store, settings, "busy-c", 0)
    request = profiles.request_on_demand(store, settings, "busy-c", 5)
    status = profiles.request_status(store, settings, request["request_id"])
    assert (status["status"], status["done"], status["traces"]) == ("pending", False, 0)
    with pytest.raises(profiles.ProfileNotCaptured, match="is pending, not done"):
        profiles.analyze_request(store, settings, request["request_id"])
    with store.session() as s:  # nobody picked it up in time
        s.execute(update(ProfileRequest).values(expires_at=time.time() - 1))
    with pytest.raises(profiles.ProfileNotCaptured, match="expired: no job of this workflow polled an agent"):
        profiles.request_status(store, settings, request["request_id"])
    with pytest.raises(NotFound, match="no profile request #999"):
        profiles.request_status(store, settings, 999)


def test_an_on_demand_trace_that_cannot_be_analysed_fails_with_its_reason(seeded, tmp_path: Path) -> None:
    store, _, settings = seeded
    request_id = profiles.request_on_demand(store, settings, "busy-c", 5)["request_id"]
    bad = tmp_path / "rank0.pt.trace.json"
    bad.write_text("{ not json")
    with store.session() as s:
        profiling.claim(s, request_id)
        profiling.register_trace(s, "busy-c", bad, 0, request_id)
        profiling.complete(s, request_id)
    with pytest.raises(profiles.ProfileAnalysisFailed, match="1 of 1 traces could not be analysed"):
        profiles.analyze_request(store, settings, request_id)


def test_cycle_records_a_dry_run_and_an_applied_plan(seeded) -> None:
    store, out, settings = seeded
    flag_idle(store, out)
    dry = cycle.run_cycle(store, settings)
    assert dry["moves"] == 2 and dry["outcome"] == {"mode": "dry_run", "applied": False, "actions": []}
    applied = cycle.run_cycle(store, settings, enforce=True)
    with store.session() as s:
        actions = list(s.scalars(select(Action).where(Action.plan_id == applied["plan_id"])))
        plan = s.get(Plan, applied["plan_id"])
    assert plan.applied and plan.summary["outcome"]["actions"] == [a.id for a in actions] and len(actions) == 2
    assert set(applied["driven"].values()) == {"checkpoint_requested"}
    with pytest.raises(InvalidInput):
        cycle.run_cycle(store, settings, policy="no-such-policy")


def test_a_plan_that_cannot_be_applied_is_recorded_with_the_reason(seeded, monkeypatch: pytest.MonkeyPatch) -> None:
    store, out, settings = seeded
    flag_idle(store, out)
    real_apply = cycle.apply_plan

    def job_moved_meanwhile(store_, plan_id, **kw):
        with store_.session() as s:  # idle-a's job went away between planning and applying
            s.execute(update(Placement).where(Placement.workflow_id == "idle-a").values(state="ended"))
        return real_apply(store_, plan_id, **kw)

    monkeypatch.setattr(cycle, "apply_plan", job_moved_meanwhile)
    with pytest.raises(InvalidInput, match="no longer on device"):
        cycle.run_cycle(store, settings.model_copy(update={"enforce": True}))
    with store.session() as s:
        plan = s.scalar(select(Plan))
        assert not plan.applied
        outcome = plan.summary["outcome"]
        assert outcome["mode"] == "enforce" and "no longer on device" in outcome["error"]
        assert s.scalar(select(Action)) is None  # all or nothing


def test_the_hourly_rollup_rolls_up_again_the_hours_of_the_retention_that_late_samples_reached(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'late.db'}")
    upgrade(store)
    try:
        settings = Settings(home=tmp_path / "home", retention_days=3 / 24)
        fleet = Fleet(store)
        live, cut_off = fleet.device("h1"), fleet.device("h2")
        fleet.workflow("w")
        fleet.workflow("spooled")
        fleet.run(live, "w", 0, 240, util=0.5, mem_gib=40)
        fleet.flush()
        now = T0 + 4 * HOUR
        first = periodic.rollup_and_retain(store, settings, now=now)  # cutoff: T0 + 1 h
        assert first["rollup"]["hours"] == 4 and first["retention"]["device_samples_deleted"] == 60
        # h2's spool: samples of the third hour (within the retention) and of the first (its samples deleted)
        fleet.run(cut_off, "spooled", 120, 180, util=0.9, mem_gib=60, pid=7)
        fleet.run(cut_off, "spooled", 0, 60, util=0.9, mem_gib=60, pid=7)
        fleet.flush()
        second = periodic.rollup_and_retain(store, settings, now=now)
        with store.session() as s:
            held = s.scalar(select(Rollup.gpu_hours_held).where(
                Rollup.scope == "workflow", Rollup.subject == "spooled", Rollup.hour == T0 + 2 * HOUR))
        assert held == pytest.approx(1.0)
        assert second["rollup"]["rerolled_hours"] == [T0 + 2 * HOUR] and second["rollup"]["hours"] == 0
        # the first hour is past the look-back: not rolled up again; its late samples are past the retention, and go
        retained = second["retention"]
        assert (retained["device_samples_deleted"], retained["process_samples_deleted"]) == (60, 60)
        assert (retained["hours_kept"], retained["late_samples_deleted"]) == (0, 120)
    finally:
        store.dispose()
