"""Fleet ranking by recoverable GPU-hours with trends, and the `fleetlens findings / detect / rollup / rank` CLI."""

from __future__ import annotations

import json
import re
import time

import pandas as pd
import pytest

from analyzer.ranking import (
    FINDING_COLUMNS,
    TEAM_COLUMNS,
    WORKFLOW_COLUMNS,
    findings_frame,
    rank_teams,
    rank_workflows,
    teams_of,
)
from analyzer.rollups import rollup
from analyzer.telemetry import detect
from store.db import Store
from store.findings import FindingSpec, upsert_finding
from store.migrations import upgrade
from tests.analyzer.telemetry_fleet import T0, Fleet
from ui.cli import run

HOUR = 3600.0
DAY = 6 * HOUR  # a short "period" keeps the data small: two periods of six hours


def _two_periods(store: Store) -> None:
    """Workflow idle (team llm) idles in both periods; better (team vision) wasted the first period, not now."""
    fleet = Fleet(store)
    d1, d2, d3 = fleet.device(), fleet.device(), fleet.device()
    fleet.workflow("idle", team="llm")
    fleet.workflow("better", team="vision")
    fleet.workflow("small", team="vision")
    fleet.run(d1, "idle", 0, 720, util=0.0, mem_gib=60)
    fleet.run(d2, "better", 0, 360, util=0.1, mem_gib=70)
    fleet.run(d2, "better", 360, 720, util=0.9, mem_gib=70)
    fleet.run(d3, "small", 0, 720, util=0.9, mem_gib=8)
    fleet.flush()


@pytest.fixture
def ranked(any_store):
    _two_periods(any_store)
    now = T0 + 12 * HOUR
    rollup(any_store, now=now)
    detect(any_store, now=now, window_s=DAY)
    return any_store, now


def test_workflows_ranked_by_recoverable_with_trend(ranked):
    store, now = ranked
    wf = rank_workflows(store, now=now, period_s=DAY)
    assert list(wf.columns) == WORKFLOW_COLUMNS
    assert list(wf["workflow_id"]) == ["idle", "small", "better"]
    idle = wf.iloc[0]
    # idle all day on one GPU: an idle holder and under-utilised; the overlap counts once (24 GPU-h/day)
    assert idle.open_findings == 2 and idle.top_rule in ("idle_holder", "low_utilization")
    assert idle.recoverable_gpu_hours_per_day == pytest.approx(24.0)
    assert idle.gpu_hours_held == pytest.approx(6.0) and idle.waste_gpu_hours == pytest.approx(6.0)
    assert idle.trend_gpu_hours == pytest.approx(0.0)
    better = wf.set_index("workflow_id").loc["better"]
    assert better.open_findings == 0 and better.recoverable_gpu_hours_per_day == 0.0
    assert better.waste_gpu_hours == pytest.approx(0.6) and better.waste_gpu_hours_prev == pytest.approx(5.4)
    assert better.trend_gpu_hours == pytest.approx(-4.8) and better.trend_pct == pytest.approx(-88.9, abs=0.1)
    assert list(rank_workflows(store, now=now, period_s=DAY, team="vision")["workflow_id"]) == ["small", "better"]
    assert len(rank_workflows(store, now=now, period_s=DAY, limit=1)) == 1


def test_teams_ranked(ranked):
    store, now = ranked
    teams = rank_teams(store, now=now, period_s=DAY)
    assert list(teams.columns) == TEAM_COLUMNS
    assert list(teams["team"]) == ["llm", "vision"]
    vision = teams.set_index("team").loc["vision"]
    assert vision.workflows == 2
    # the dashboard derives the teams from the workflows it already ranked: same table, workflows untouched
    workflows = rank_workflows(store, now=now, period_s=DAY)
    before = workflows.copy()
    pd.testing.assert_frame_equal(teams_of(workflows), teams)
    pd.testing.assert_frame_equal(workflows, before)
    assert vision.waste_gpu_hours == pytest.approx(0.6 + 0.6)  # better and small each waste 10 % of 6 h


def test_overlapping_findings_count_once_per_device(sqlite_store):
    """Two claims on d1 unite (not add), d2 adds, trace findings take their share of the unclaimed held time."""
    fleet = Fleet(sqlite_store)
    fleet.workflow("w", gpus=2)
    d1, d2 = fleet.device(), fleet.device()
    window = {"held_hours": 24.0, "window_hours": 24.0}
    with sqlite_store.session() as s:
        for rule, dev, cost, ev in (("idle_holder", d1, 10.0, window), ("low_utilization", d1, 6.0, window),
                                    ("idle_holder", d2, 3.0, window),
                                    ("trace_rule_a", None, 4.8, {"cost_fraction": 0.1, "gpus": 2}),
                                    ("trace_rule_b", None, 2.4, {"cost_fraction": 0.05, "gpus": 2})):
            upsert_finding(s, FindingSpec(rule=rule, workflow_id="w", source="trace" if dev is None else "telemetry",
                                          severity="low", title=rule, fix="x", gpu_hours_per_day=cost, device_id=dev,
                                          evidence=ev, subject=f"device:{dev}" if dev else "rank0"))
    wf = rank_workflows(sqlite_store, now=T0)
    d1_union = 24.0 * (1 - (1 - 10 / 24) * (1 - 6 / 24))
    telemetry = d1_union + 3.0
    held = 48.0  # no rollup yet: the detector windows say each device was held the whole day
    trace_share = 1 - 0.9 * 0.95
    assert wf.iloc[0].recoverable_gpu_hours_per_day == pytest.approx(telemetry + trace_share * (held - telemetry))
    assert wf.iloc[0].held_gpu_hours_per_day == pytest.approx(held) and wf.iloc[0].basis == "detector window"
    assert wf.iloc[0].open_findings == 5 and wf.iloc[0].top_rule == "idle_holder"


def test_findings_frame_filters(ranked):
    store, _ = ranked
    frame = findings_frame(store)
    assert list(frame.columns) == FINDING_COLUMNS
    assert set(frame["rule"]) == {"idle_holder", "low_utilization", "memory_overprovisioned"}
    assert list(frame["gpu_hours_per_day"]) == sorted(frame["gpu_hours_per_day"], reverse=True)
    assert set(findings_frame(store, team="vision")["workflow_id"]) == {"small"}
    assert set(findings_frame(store, rule="idle_holder")["workflow_id"]) == {"idle"}
    assert findings_frame(store, workflow_id="better").empty


def test_empty_store_ranks_nothing(sqlite_store):
    assert rank_workflows(sqlite_store, now=T0).empty
    assert rank_teams(sqlite_store, now=T0).empty
    assert findings_frame(sqlite_store).empty


@pytest.fixture
def cli_store(fleet_home):
    assert run(["init"]) == 0
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    upgrade(store)
    _two_periods(store)
    yield store
    store.dispose()


def test_cli_detect_rollup_findings_rank(cli_store, capsys):
    now = str(T0 + 12 * HOUR)
    capsys.readouterr()
    assert run(["detect", "--now", now, "--window-hours", "6", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["findings"] == 3 and summary["rules"]["idle_holder"]["workflows"] == 1

    assert run(["rollup", "--now", now, "--retention-days", "0.25", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["hours"] == 12 and result["device_samples_deleted"] == 3 * 360

    assert run(["findings", "--json", "--team", "vision"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["rule"], r["workflow_id"]) for r in rows] == [("memory_overprovisioned", "small")]
    assert "lane of 10 GiB" in rows[0]["fix"]

    assert run(["findings", "--rule", "idle_holder"]) == 0
    out = capsys.readouterr().out
    assert "idle_holder" in out and "idle" in out and "release the GPU" in out

    assert run(["rank", "--now", now, "--period-hours", "6"]) == 0
    out = capsys.readouterr().out
    assert out.index("idle") < out.index("small") < out.index("better")

    assert run(["rank", "--teams", "--now", now, "--period-hours", "6", "--json"]) == 0
    teams = json.loads(capsys.readouterr().out)["teams"]
    assert [t["team"] for t in teams] == ["llm", "vision"]


def test_cli_errors_are_one_line(cli_store, capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml [")
    assert run(["detect", "--thresholds", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "Traceback" not in err
    assert run(["detect", "--window-hours", "-1"]) == 2
    assert "window-hours" in capsys.readouterr().err
    assert run(["rollup", "--retention-days", "0"]) == 2
    assert "retention_days" in capsys.readouterr().err
    assert run(["findings", "--workflow", "nobody"]) == 2  # a typo is not a workflow without findings
    assert "no workflow 'nobody' in the store" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["rank", "--now", "nan"], ["rank", "--period-hours", "inf"], ["detect", "--now", "nan"],
    ["detect", "--window-hours", "nan"], ["rollup", "--since", "nan"], ["rollup", "--now", "inf"],
    ["rollup", "--retention-days", "inf"],
])
def test_cli_refuses_a_number_that_is_not_finite(cli_store, capsys, args):
    # Typer reads "nan" and "inf" as floats; they used to end in a traceback (or, for --window-hours, in no findings)
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "finite" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _held_in_title(out: str) -> float:
    found = re.search(r"of ([\d,.]+) GPU-hours held per day", " ".join(out.split()))
    assert found, out
    return float(found.group(1).replace(",", ""))


def test_cli_findings_filtered_counts_the_held_time_of_what_it_lists(fleet_home, capsys):
    # two workflows of two teams, each holding one GPU the last 6 h: `findings --team` / `--workflow` say what that
    # team or workflow held, as `rank --team` does, not the whole fleet's held time
    assert run(["init"]) == 0
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    now = time.time()
    fleet = Fleet(store, t0=now - now % HOUR - 6 * HOUR)
    d1, d2 = fleet.device(), fleet.device()
    fleet.workflow("idle", team="llm")
    fleet.workflow("small", team="vision")
    fleet.run(d1, "idle", 0, 360, util=0.0, mem_gib=60)
    fleet.run(d2, "small", 0, 360, util=0.9, mem_gib=8)
    fleet.flush()
    detect(store, now=now, window_s=6 * HOUR)
    capsys.readouterr()
    assert run(["findings"]) == 0
    fleet_held = _held_in_title(capsys.readouterr().out)
    assert run(["findings", "--team", "vision"]) == 0
    assert _held_in_title(capsys.readouterr().out) == pytest.approx(fleet_held / 2, abs=0.1)
    assert run(["findings", "--workflow", "small"]) == 0
    assert _held_in_title(capsys.readouterr().out) == pytest.approx(fleet_held / 2, abs=0.1)
    # the dashboard's Findings page counts them alike
    from ui.dashboard.queries import findings_with_waste

    assert findings_with_waste(store)[1].held_gpu_hours_per_day == pytest.approx(fleet_held, abs=0.1)
    for filtered in ({"teams": ("vision",)}, {"workflow_id": "small"}):
        held = findings_with_waste(store, **filtered)[1].held_gpu_hours_per_day
        assert held == pytest.approx(fleet_held / 2, abs=0.1), filtered
    store.dispose()
