"""analyze_trace on a registered trace: status, summary, findings with GPU-hours at the workflow's GPU count."""

from __future__ import annotations

import pickle

from sqlalchemy import select

from analyzer.traces import analyze_trace, register_trace
from analyzer.traces.cache import cache_key
from store.models import Finding, Trace
from store.workflows import upsert_workflow
from tests.analyzer.conftest import every_cost_thresholds
from tests.conftest import TRACES

ALEXNET = TRACES / "a100_alexnet_microbench.json.gz"


def test_analyze_trace_writes_summary_and_findings(any_store, tmp_path):
    with any_store.session() as s:
        upsert_workflow(s, "wf-alex", gpus=4)
    trace_id = register_trace(any_store, ALEXNET, workflow_id="wf-alex")
    every = every_cost_thresholds()  # AlexNet's copies and syncs cost under 1 % of its span: reported only so
    res = analyze_trace(any_store, trace_id, cache_dir=tmp_path, thresholds=every)
    assert res["status"] == "analyzed"
    with any_store.session() as s:
        trace = s.get(Trace, trace_id)
        assert trace.status == "analyzed" and trace.error is None and trace.analyzed_at
        assert trace.summary["memcpy"][0]["count"] == 16
        findings = {f.rule: f for f in s.scalars(select(Finding).where(Finding.workflow_id == "wf-alex"))}
    page = findings["trace.pageable_memcpy"]
    assert page.evidence["pageable_htod_copies"] == 16 and page.evidence["gpus"] == 4
    assert page.trace_id == trace_id and page.source == "trace" and page.location and page.fix
    frac = page.cost_s_per_step / (trace.summary["step_us_mean"] / 1e6)
    assert abs(page.gpu_hours_per_day - frac * 4 * 24) < 1e-9
    assert findings["trace.sync_heavy"].evidence["stream_syncs"] == 16
    # analysing again updates the same findings instead of adding rows
    analyze_trace(any_store, trace_id, cache_dir=tmp_path, thresholds=every)
    with any_store.session() as s:
        assert len(s.scalars(select(Finding).where(Finding.workflow_id == "wf-alex")).all()) == len(findings)


def test_trace_without_workflow_gets_one_for_its_findings(sqlite_store, tmp_path):
    trace_id = register_trace(sqlite_store, ALEXNET)
    assert analyze_trace(sqlite_store, trace_id, cache_dir=tmp_path)["status"] == "analyzed"
    with sqlite_store.session() as s:
        assert s.get(Trace, trace_id).workflow_id == f"trace:{trace_id}"
        assert s.scalars(select(Finding).where(Finding.workflow_id == f"trace:{trace_id}")).all()


def test_parsed_trace_is_cached_by_path_size_mtime(tmp_path):
    from analyzer.traces.run import analyze_one

    first, _ = analyze_one(ALEXNET, cache_dir=tmp_path)
    entry = tmp_path / f"{cache_key(ALEXNET)}.pkl"
    assert entry.exists()
    with entry.open("rb") as fh:
        assert pickle.load(fh).rank == 0
    second, _ = analyze_one(ALEXNET, cache_dir=tmp_path)
    assert second == first



def test_a_later_trace_of_the_rank_resolves_what_it_no_longer_shows(sqlite_store, tmp_path):
    # rank 0 of a workflow profiled twice: the later trace shows tiny_steps (which explains all of its idle time), not
    # the earlier trace's host_bound, which is then resolved (no longer open, no longer counted); analysed the other
    # way round, the earlier trace resolves nothing of the later one's
    def status(wf: str) -> dict[str, str]:
        with sqlite_store.session() as s:
            return {f.rule: f.status for f in s.scalars(select(Finding).where(Finding.workflow_id == wf))}

    for wf, order in (("in-order", (0, 1)), ("reversed", (1, 0))):
        with sqlite_store.session() as s:
            upsert_workflow(s, wf)
        ids = [register_trace(sqlite_store, path, workflow_id=wf)
               for path in (ALEXNET, TRACES / "amd_mi250_minitoy.json.gz")]
        for i in order:
            assert analyze_trace(sqlite_store, ids[i], cache_dir=tmp_path)["status"] == "analyzed"
    assert status("in-order") == {"trace.tiny_steps": "open", "trace.host_bound": "resolved"}
    assert set(status("reversed").values()) == {"open"} and len(status("reversed")) == 2
