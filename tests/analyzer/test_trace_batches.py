"""Traces in batches, the unit the analyze DAG maps over: batching, and a batch retried after a worker died."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from analyzer.traces import analyze_batch, pending_batches, register_trace
from analyzer.traces.claims import Claim, ClaimPolicy, claim
from store.errors import InvalidInput
from store.models import Finding, Trace
from tests.conftest import TRACES

SMALL = ["a100_alexnet_microbench.json.gz", "a100_triton_kernel.json.gz", "amd_mi250_minitoy.json.gz",
         "cpu_ops_no_gpu.json.gz", "sampled_128rank_rank0.json.gz"]


def test_pending_traces_come_in_batches_oldest_first(any_store, tmp_path) -> None:
    ids = [register_trace(any_store, TRACES / name, workflow_id=f"wf-{i}") for i, name in enumerate(SMALL)]
    assert pending_batches(any_store, 2) == [ids[0:2], ids[2:4], ids[4:5]]
    assert pending_batches(any_store, 10) == [ids]
    with pytest.raises(InvalidInput, match="FLEETLENS_ANALYZE_BATCH_SIZE"):
        pending_batches(any_store, 0)


def test_a_retried_batch_redoes_the_trace_a_dead_worker_left_and_skips_the_finished(any_store, tmp_path) -> None:
    # one workflow each: findings are one per (rule, workflow), so each trace keeps its own
    ids = [register_trace(any_store, TRACES / name, workflow_id=f"wf-{i}") for i, name in enumerate(SMALL[:3])]
    first = analyze_batch(any_store, ids[:1], cache_dir=tmp_path)
    assert first == {"analyzed": ids[:1], "failed": [], "skipped": []}
    with any_store.session() as s:
        findings_before = s.scalar(select(func.count()).select_from(Finding))
    # what a worker killed in the middle of the second trace leaves behind: its claim, renewed no more
    assert isinstance(claim(any_store, ids[1], ClaimPolicy(), host_id="worker-1"), Claim)
    assert pending_batches(any_store, 4) == [ids[2:]]  # a claim within its lease is its run's to finish
    # the retry watches the claim until it lapses (a lease without renewal), then retakes the trace
    retried = analyze_batch(any_store, [*ids, 999_999], cache_dir=tmp_path, claims=ClaimPolicy(lease_s=0.4))
    assert retried == {"analyzed": ids[1:], "failed": [], "skipped": [ids[0], 999_999]}
    with any_store.session() as s:
        assert {t.status for t in s.scalars(select(Trace))} == {"analyzed"}
        per_trace = dict(s.execute(select(Finding.trace_id, func.count()).group_by(Finding.trace_id)).all())
    assert set(per_trace) == set(ids) and all(n > 0 for n in per_trace.values())
    assert sum(per_trace.values()) > findings_before
    # the same batch once more changes nothing: findings are upserted, never doubled
    assert analyze_batch(any_store, ids, cache_dir=tmp_path)["skipped"] == ids
    with any_store.session() as s:
        assert dict(s.execute(select(Finding.trace_id, func.count()).group_by(Finding.trace_id)).all()) == per_trace
