"""The one waste function: unions of overlapping claims, bounded by what was held, trace costs from held time."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.ranking import FINDING_COLUMNS, findings_frame, rank_with_waste
from analyzer.rollups import rollup
from analyzer.telemetry import detect
from analyzer.waste import Held, waste
from store.db import Store
from store.findings import FindingSpec, upsert_finding
from store.migrations import upgrade
from tests.analyzer.telemetry_fleet import T0, Fleet
from ui.cli import run

HOUR = 3600.0
EPS = 1e-9


def _frame(rows: list[dict]) -> pd.DataFrame:
    full = [{**{c: None for c in FINDING_COLUMNS}, "id": i + 1, **r} for i, r in enumerate(rows)]
    return pd.DataFrame(full, columns=FINDING_COLUMNS)


def tele(wf: str, dev: int, claim, rule: str = "idle_holder", **evidence) -> dict:
    return {"workflow_id": wf, "device_id": dev, "rule": rule, "source": "telemetry", "gpu_hours_per_day": claim,
            "evidence": evidence}


def trace(wf: str, fraction, subject: str = "rank0", rule: str = "trace.host_bound", gpus: int | None = 1) -> dict:
    ev = {"subject": subject} | ({} if fraction is None else {"cost_fraction": fraction})
    ev |= {} if gpus is None else {"gpus": gpus}
    return {"workflow_id": wf, "device_id": None, "rule": rule, "source": "trace",
            "gpu_hours_per_day": 24.0 * (gpus or 1), "evidence": ev}


def test_overlapping_claims_on_one_device_are_united_not_added():
    # the shape of a replayed Alibaba device: 23.9 + 18.3 + 17.4 = 59.6 claimed on a device held 24 h a day
    f = _frame([tele("a", 1, 23.9, held_hours=24.0, window_hours=24.0),
                tele("a", 1, 18.3, "low_utilization", held_hours=24.0, window_hours=24.0),
                tele("a", 1, 17.4, "memory_overprovisioned", held_hours=24.0, window_hours=24.0)])
    w = waste(f, Held(workflows={"a": 24.0}, devices={1: 24.0}))
    shares = [23.9 / 24, 18.3 / 24, 17.4 / 24]
    expected = 24.0 * (1 - (1 - shares[0]) * (1 - shares[1]) * (1 - shares[2]))
    assert w.recoverable_gpu_hours_per_day == pytest.approx(expected)
    assert 23.9 < w.recoverable_gpu_hours_per_day <= 24.0
    assert w.devices.set_index("device_id").loc[1, "recoverable_gpu_hours_per_day"] == pytest.approx(expected)
    # each finding keeps its own claim (bounded by held), the total is their union
    assert list(w.findings["gpu_hours_per_day"]) == pytest.approx([23.9, 18.3, 17.4])


def test_claims_over_the_detector_window_scale_to_what_was_really_held():
    # a job that held its device 6 h of the period: its 'per day' rate claim counts for 6 h at most
    f = _frame([tele("a", 1, 12.0, held_hours=6.0, window_hours=6.0)])
    w = waste(f, Held(workflows={"a": 6.0}, devices={1: 6.0}))
    assert w.recoverable_gpu_hours_per_day == pytest.approx(6.0 * (12.0 / 24.0))
    assert w.workflows.iloc[0]["basis"] == "rollups"


def test_trace_cost_is_its_share_of_the_held_gpu_hours():
    f = _frame([trace("t", 0.25, gpus=8), trace("t", 0.10, rule="trace.sync_heavy", gpus=8)])
    w = waste(f, Held(workflows={"t": 5.0}))
    assert list(w.findings["gpu_hours_per_day"]) == pytest.approx([1.25, 0.5])
    assert w.recoverable_gpu_hours_per_day == pytest.approx(5.0 * (1 - 0.75 * 0.9))
    assert not w.assumptions[1:]  # measured, nothing projected


def test_trace_cost_without_telemetry_is_projected_and_says_so():
    w = waste(_frame([trace("t", 0.25, gpus=8)]), Held())
    row = w.workflows.iloc[0]
    assert row["basis"] == "projected" and row["held_gpu_hours_per_day"] == 8 * 24.0
    assert row["recoverable_gpu_hours_per_day"] == pytest.approx(0.25 * 8 * 24.0)
    assert any("projected" in a and "24 h a day" in a for a in w.assumptions)


def test_ranks_of_one_job_count_once_and_trace_waste_adds_to_unclaimed_time_only():
    f = _frame([trace("j", 0.4, "rank0"), trace("j", 0.3, "rank1"), tele("j", 7, 12.0, held_hours=24.0,
                                                                          window_hours=24.0)])
    w = waste(f, Held(workflows={"j": 24.0}, devices={7: 24.0}))
    t = 12.0
    assert w.recoverable_gpu_hours_per_day == pytest.approx(t + 0.4 * (24.0 - t))


def test_workflows_sharing_a_device_never_claim_more_than_it_held():
    f = _frame([tele("a", 3, 20.0, held_hours=20.0, window_hours=24.0),
                tele("b", 3, 20.0, held_hours=20.0, window_hours=24.0)])
    w = waste(f, Held(workflows={"a": 10.0, "b": 10.0}, devices={3: 12.0}))
    assert w.devices.set_index("device_id").loc[3, "recoverable_gpu_hours_per_day"] == pytest.approx(12.0)
    assert w.recoverable_gpu_hours_per_day == pytest.approx(12.0)


def test_bad_evidence_and_no_samples_are_stated_never_counted():
    f = _frame([
        trace("t", None),  # no cost_fraction
        trace("u", 1.7),  # not a share
        tele("v", 4, None),  # no claim
        tele("w", 5, 3.0),  # no rollup and no held_hours in the evidence: nothing bounds it
        trace("x", 0.5, gpus=None),  # no telemetry and no GPU count: cannot be projected
    ])
    w = waste(f, Held())
    assert w.recoverable_gpu_hours_per_day == 0.0 and w.held_gpu_hours_per_day == 0.0
    assert not w.findings["counted"].any()
    text = "\n".join(w.problems)
    assert "cost_fraction" in text and "gpu_hours_per_day is missing" in text and "fleetlens rollup" in text
    assert "workflow x: no telemetry and no GPU count" in text
    assert len(w.problems) >= 5


claims = st.one_of(st.none(), st.floats(min_value=-5, max_value=1e6), st.just(float("nan")), st.just(float("inf")),
                   st.just("12"), st.just(True))
fractions = st.one_of(st.none(), st.floats(min_value=-1, max_value=3), st.just(float("nan")), st.just("x"))
wfs = st.sampled_from(["a", "b", "c", "d"])
devs = st.integers(min_value=1, max_value=4)
finding = st.one_of(
    st.builds(lambda wf, d, c, h, win: tele(wf, d, c, held_hours=h, window_hours=win), wfs, devs, claims,
              st.one_of(st.none(), st.floats(min_value=0, max_value=48)),
              st.one_of(st.none(), st.floats(min_value=0, max_value=48))),
    st.builds(lambda wf, f, subj, g: trace(wf, f, subj, gpus=g), wfs, fractions, st.sampled_from(["rank0", "rank1"]),
              st.one_of(st.none(), st.integers(min_value=1, max_value=16))),
)
# samples: (workflow, device, held seconds) over one day; rollups are their sums, per workflow and per device
samples = st.lists(st.tuples(wfs, devs, st.floats(min_value=0, max_value=3 * HOUR)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.lists(finding, max_size=25), samples)
def test_no_total_ever_exceeds_the_gpu_hours_held(found, sampled):
    per_wf: dict[str, float] = {}
    per_dev: dict[int, float] = {}
    for wf, dev, secs in sampled:
        per_wf[wf] = per_wf.get(wf, 0.0) + secs / HOUR
        per_dev[dev] = min(per_dev.get(dev, 0.0) + secs / HOUR, 24.0)
    w = waste(_frame(found), Held(workflows=per_wf, devices=per_dev))
    for r in w.workflows.itertuples():
        assert 0.0 <= r.recoverable_gpu_hours_per_day <= r.held_gpu_hours_per_day + EPS
        if r.workflow_id in per_wf:
            assert r.held_gpu_hours_per_day == pytest.approx(per_wf[r.workflow_id])
    for r in w.devices.itertuples():
        if pd.notna(r.held_gpu_hours_per_day):
            assert r.recoverable_gpu_hours_per_day <= r.held_gpu_hours_per_day + EPS
    assert 0.0 <= w.recoverable_gpu_hours_per_day <= w.held_gpu_hours_per_day + EPS
    assert w.findings["gpu_hours_per_day"].ge(0).all()
    # what was not counted says why
    if not w.findings["counted"].all():
        assert w.problems


def _store_with_trace_and_idle(store) -> float:
    fleet = Fleet(store)
    d1 = fleet.device()
    fleet.workflow("idle", team="llm")
    fleet.workflow("traced", team="llm", gpus=8)
    fleet.run(d1, "idle", 0, 360, util=0.0, mem_gib=60)
    fleet.flush()
    now = T0 + 6 * HOUR
    rollup(store, now=now)
    with store.session() as s:
        upsert_finding(s, FindingSpec(rule="trace.host_bound", workflow_id="traced", source="trace", severity="high",
                                      title="idle", fix="x", evidence={"cost_fraction": 0.5, "gpus": 8},
                                      gpu_hours_per_day=96.0, subject="rank0"), now)
    return now


@pytest.fixture
def cli_store(fleet_home):
    assert run(["init"]) == 0
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    upgrade(store)
    yield store
    store.dispose()


def test_rank_json_prints_the_waste_functions_totals(cli_store, capsys):
    store = cli_store
    now = _store_with_trace_and_idle(store)
    detect(store, now=now, window_s=6 * HOUR)
    ranked, w = rank_with_waste(store, now=now, period_s=6 * HOUR)
    assert run(["rank", "--now", str(now), "--period-hours", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "workflows"}
    assert out["recoverable_gpu_hours_per_day"] == pytest.approx(w.recoverable_gpu_hours_per_day, abs=1e-3)
    by_id = {r["workflow_id"]: r for r in out["workflows"]}
    # the idle job held its device 6 h of the 6 h period: 24 GPU-h a day, all of it idle
    assert by_id["idle"]["held_gpu_hours_per_day"] == pytest.approx(24.0)
    assert by_id["idle"]["recoverable_gpu_hours_per_day"] == pytest.approx(24.0, abs=0.5)
    # the traced job has no telemetry: projected on its 8 GPUs, and the output says so
    assert by_id["traced"]["basis"] == "projected"
    assert by_id["traced"]["recoverable_gpu_hours_per_day"] == pytest.approx(0.5 * 8 * 24.0)
    assert any("projected" in a for a in out["assumptions"])
    assert out["recoverable_gpu_hours_per_day"] <= out["held_gpu_hours_per_day"]
    assert out["recoverable_gpu_hours_per_day"] == pytest.approx(
        sum(r["recoverable_gpu_hours_per_day"] for r in out["workflows"]), abs=1e-3)


def test_findings_cli_total_comes_from_the_waste_function(cli_store, capsys):
    store = cli_store
    _store_with_trace_and_idle(store)
    frame = findings_frame(store)
    assert run(["findings", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(frame) == 1
    # the stored 96 GPU-h/day (24 h x 8 GPUs x 0.5) is a projection; the listing says so
    assert rows[0]["basis"] == "projected" and rows[0]["gpu_hours_per_day"] == pytest.approx(96.0)
