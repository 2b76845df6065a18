"""Every dashboard page on a seeded store (AppTest): the numbers shown are the store's, and the controls work."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select

from analyzer.ranking import rank_workflows
from analyzer.rollups import device_rollups
from analyzer.telemetry.frame import load_window
from analyzer.telemetry.thresholds import load_thresholds
from store.models import Device, DeviceSample, Host, Placement, Plan, ProcessSample, Rollup
from tests.ui.helpers import assert_clean, metrics, page, texts
from tests.ui.seed import GIB, trace_summary
from ui.dashboard.common import WINDOWS
from ui.dashboard.queries import Window
from ui.dashboard.state_queries import workflow_placement
from ui.dashboard.workflow_queries import workflow_series


def _rollup_hours(store, window: Window) -> tuple[float, float]:
    with store.session() as s:
        held, active = s.execute(
            select(func.sum(Rollup.gpu_hours_held), func.sum(Rollup.gpu_hours_active)).where(
                Rollup.scope == "device", Rollup.hour >= window.start, Rollup.hour < window.end)
        ).one()
    return held, active


def test_fleet_week_shows_the_rollups_sums(seeded):
    store, _ = seeded
    at = page("fleet")
    at.selectbox(key="fl_window").set_value("7 days").run()
    assert_clean(at)
    before = Window.last(WINDOWS["7 days"])
    shown = metrics(at)
    expected = {f"{h:,.1f}" for h, _ in [_rollup_hours(store, before), _rollup_hours(store, Window.last(7 * 86400))]}
    assert shown["Device-hours held"] in expected
    held, active = _rollup_hours(store, before)
    assert shown["Device-hours active"] == f"{active:,.1f}" and held > 100
    with store.session() as s:
        assert shown["Hosts"] == str(s.scalar(select(func.count()).select_from(Host)))
        assert shown["Devices"] == str(s.scalar(select(func.count()).select_from(Device)))
    # a week reads rollups: the sidebar says so, and the charts (timeline, histogram, freed) are drawn
    with store.session() as s:
        newest = s.scalar(select(func.max(Rollup.hour)).where(Rollup.scope == "device"))
    to = datetime.fromtimestamp(newest + 3600, tz=UTC)
    assert f"hourly rollups up to {to:%Y-%m-%d %H:%M} UTC" in texts(at.sidebar.caption)
    assert len(at.get("plotly_chart")) >= 3
    # the applied plans of the week: 2 + 1 + 2 + 1 + 1 devices freed
    with store.session() as s:
        freed = s.scalar(select(func.sum(Plan.devices_freed)).where(Plan.applied.is_(True)))
    assert shown["Devices freed (applied plans)"] == str(freed) == "7"


def test_fleet_hour_reads_raw_samples_with_the_analyzers_definition(seeded):
    store, _ = seeded
    th = load_thresholds()

    def held_last_hour() -> float:
        window = Window.last(3600)
        return sum(r["gpu_hours_held"] for r in device_rollups(load_window(store, window.start, window.end,
                                                                           th.common), 0.0))

    # the window slides while the page renders (seconds on a loaded machine): the page's figure is the analyzer's
    # over a window that ended between these two reads
    before = held_last_hour()
    at = page("fleet")
    at.selectbox(key="fl_window").set_value("1 hour").run()
    assert_clean(at)
    after = held_last_hour()
    shown = float(metrics(at)["Device-hours held"].replace(",", ""))
    assert min(before, after) - 0.05 <= shown <= max(before, after) + 0.05
    assert 5.5 < after <= 6.0  # six of the eight seeded devices hold a job's memory the whole hour
    assert "raw samples" in texts(at.sidebar.caption)


def test_fleet_hosts_table_flags_no_host_heard_from_lately(seeded):
    # both agents wrote within the silence limit (tests/ui/test_hosts_left_alone.py flags the silent and closed ones)
    at = page("fleet")
    assert_clean(at)
    hosts = next(df.value for df in at.dataframe if "status" in df.value.columns)
    state = dict(zip(hosts.host, hosts.status, strict=True))
    assert state == {"gpu-a": "ok", "gpu-b": "ok"}
    assert list(hosts.devices) == [4, 4]
    assert list(hosts.host) == ["gpu-a", "gpu-b"]  # heard from latest first
    assert not [w for w in at.warning if "leaves alone" in str(w.value)]


def test_workflow_page_from_query_params(seeded):
    store, _ = seeded
    at = page("workflow", workflow="bert-finetune")
    assert_clean(at)
    assert at.selectbox[0].value == "bert-finetune"
    shown = metrics(at)
    assert shown["Peak memory"] == f"{22 * GIB / 2**30:.1f} GiB"
    window = Window.last(86400)  # the default window: more than 6 h, so the workflow's rollups
    with store.session() as s:
        rolled = s.scalars(select(Rollup.util_mean).where(
            Rollup.scope == "workflow", Rollup.subject == "bert-finetune", Rollup.hour >= window.start,
            Rollup.hour < window.end)).all()
    # the hours after the last rollup (the current one) come from raw samples (tests/ui/test_queries.py checks them)
    series = workflow_series(store, "bert-finetune", window)
    assert sorted(series.loc[series["source"] == "rollup", "util"].dropna()) == pytest.approx(sorted(rolled))
    own = series.own_util if series.own_util.notna().any() else series.util  # its own processes', when reported
    assert shown["Mean utilisation"] == f"{own.mean():.0%}"
    assert shown["Device utilisation"] == f"{series.util.mean():.0%}"  # the context
    # its finding with evidence and fix, and its analysed trace drawn from traces.summary
    md = texts(at.markdown)
    assert "GPU waits 41% of each step for the data loader" in "\n".join(e.label for e in at.expander)
    assert "num_workers" in md
    charts = at.get("plotly_chart")
    assert len(charts) == 4  # telemetry, plus the trace: time per step by kind, idle time by cause, top kernels
    assert metrics(at)["idle share"] == f"{trace_summary()['fractions']['idle']:.0%}"


def test_unknown_workflow_in_the_url_is_a_message(seeded):
    at = page("workflow", workflow="no-such-job")
    assert_clean(at)
    assert "no-such-job" in texts(at.warning)
    assert at.selectbox[0].value in {"resnet50-train", "bert-finetune", "notebook-alice", "llm-eval"}


def test_findings_filters(seeded):
    at = page("findings")
    assert_clean(at)
    assert metrics(at)["Findings shown"] == "3"
    # three workflows, one finding each: nothing overlaps, so the waste function's total is their sum
    assert metrics(at)["GPU-hours per day recoverable"] == f"{22.1 + 8.4 + 1.5:,.1f}"
    at.multiselect(key="fl_f_team").set_value(["nlp"]).run()
    assert metrics(at)["Findings shown"] == "2"
    at.multiselect(key="fl_f_sev").set_value(["high"]).run()
    table = at.dataframe[0].value
    assert list(table.rule) == ["idle_holder"] and list(table.workflow_id) == ["notebook-alice"]


def test_enforcement_page_plans_lanes_and_action_timeline(seeded):
    store, data = seeded
    at = page("enforcement")
    assert_clean(at)
    freed = [m.value for m in at.metric if m.label == "Devices freed"]
    assert freed == ["1", "1"]  # PACK and FAIR side by side, as the seeded plans say
    assert [m.value for m in at.metric if m.label == "Worst slowdown"] == ["1.22×", "1.08×"]
    figures = at.get("plotly_chart")
    assert len(figures) == 2  # lanes and the selected migration's state timeline
    events = at.dataframe[-1].value
    assert list(events.to_state) == ["planned", "checkpoint_requested", "checkpointed", "stopped", "relaunched",
                                     "resumed"]


def test_fleet_waste_ranking_is_the_analyzers(seeded):
    store, _ = seeded
    at = page("fleet")
    assert_clean(at)
    table = next(df.value for df in at.dataframe if "recoverable_gpu_hours_per_day" in df.value.columns)
    window = Window.last(86400)
    expected = rank_workflows(store, now=window.end, period_s=window.seconds)
    assert list(table.workflow_id) == list(expected.workflow_id)
    assert table.recoverable_gpu_hours_per_day.tolist() == expected.recoverable_gpu_hours_per_day.tolist()
    assert table.workflow_id.iloc[0] == "notebook-alice"  # the idle notebook holds the most recoverable hours
    assert {c.proto.id for c in at.get("plotly_chart")}  # team and workflow bars drawn


def test_workflow_hour_reads_raw_samples(seeded):
    store, _ = seeded
    at = page("workflow", workflow="resnet50-train")
    at.selectbox(key="fl_window").set_value("1 hour").run()
    assert_clean(at)
    shown = metrics(at)
    assert shown["Peak memory"] == f"{61 * GIB / 2**30:.1f} GiB"  # its processes' memory from process_samples
    window = Window.last(3600)
    with store.session() as s:
        devices = s.scalars(select(Device.id).where(Device.host_id == "gpu-a", Device.index.in_([0, 1]))).all()
        util = s.scalar(select(func.avg(DeviceSample.gpu_util)).where(
            DeviceSample.device_id.in_(devices), DeviceSample.ts >= window.start))
        own = s.scalar(select(func.avg(ProcessSample.sm_util)).where(
            ProcessSample.workflow_id == "resnet50-train", ProcessSample.ts >= window.start))
    assert abs(float(shown["Device utilisation"].rstrip("%")) - util * 100) <= 1.0  # the context: its devices
    assert abs(float(shown["Mean utilisation"].rstrip("%")) - own * 100) <= 1.0  # its own processes
    assert len(at.get("plotly_chart")) == 2  # utilisation / SM / memory, and step time


def test_enforcement_page_shows_consolidation_cycles_and_each_moves_reason(seeded):
    store, _ = seeded
    now = datetime.now(UTC).timestamp()
    with store.session() as s:
        s.add(Plan(created_at=now - 1800, policy="consolidate", applied=True, devices_freed=1,
                   moves=[{"workflow_id": "notebook-alice", "from_device_id": 1, "to_device_id": 2,
                           "rules": ["free_device"]}],
                   summary={"devices_held": 3, "devices_needed": 2}))
        s.add(Plan(created_at=now - 900, policy="consolidate", applied=True, devices_freed=0,
                   moves=[{"workflow_id": "train-bob", "from_device_id": 2, "to_device_id": 3,
                           "rules": ["guard_memory"]}],
                   summary={"devices_held": 2, "devices_needed": 2}))
    at = page("enforcement")
    assert_clean(at)
    figures = at.get("plotly_chart")
    assert len(figures) == 3  # lanes, consolidation cycles, the selected migration's timeline
    moves = next(d.value for d in at.dataframe if "reason" in d.value.columns)
    assert list(moves.reason) == ["guard_memory", "free_device"]  # newest first
    assert list(moves.workflow_id) == ["train-bob", "notebook-alice"]


def test_workflow_page_says_why_fleetlens_saw_it_fail(seeded):
    from store.models import Workflow
    from store.placements import FAILURE_LABEL

    store, _ = seeded
    with store.session() as s:
        wf = s.get(Workflow, "bert-finetune")
        wf.state, wf.labels = "failed", {**(wf.labels or {}), FAILURE_LABEL: "exceeded its memory share of 123 bytes"}
    at = page("workflow", workflow="bert-finetune")
    assert_clean(at)
    assert [e.value for e in at.error] == ["**bert-finetune** exceeded its memory share of 123 bytes"]


def test_workflow_page_says_where_the_fleet_state_places_it(seeded):
    store, _ = seeded
    with store.session() as s:
        lane_id = s.scalar(select(Placement.lane_id).where(Placement.workflow_id == "notebook-alice"))
        device_id = s.scalar(select(Placement.device_id).where(Placement.workflow_id == "notebook-alice"))
    at = page("workflow", workflow="notebook-alice")
    assert_clean(at)
    where = next(c.value for c in at.caption if c.value.startswith("placed on device"))
    assert f"placed on device {device_id} (gpu-b), lane {lane_id}" in where and "free capacity" in where
    assert {p["lane_id"] for p in workflow_placement(store, "notebook-alice")} == {lane_id}
