"""Analyse registered traces (traces table): status registered -> analyzing -> analyzed | failed, findings upserted.

The status change to 'analyzing' is committed before the work starts and the final state in its own
transaction, so an exception in between is caught and recorded as failed. A worker killed outright leaves the trace
'analyzing'; the retry of its batch (`analyze_batch`) takes it up again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from analyzer.rules import load_thresholds, run_set_rules
from analyzer.traces.cache import TraceBounds
from analyzer.traces.errors import InvalidTrace
from analyzer.traces.run import analyze_one
from store import profiling
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.findings import resolve_superseded, upsert_finding
from store.models import Trace, Workflow
from store.workflows import upsert_workflow

log = logging.getLogger(__name__)


def _workflow_for(session, trace: Trace) -> Workflow:
    """The trace's workflow; a trace registered without one gets a workflow of its own to hang findings on."""
    if trace.workflow_id is not None:
        wf = session.get(Workflow, trace.workflow_id)
        if wf is not None:
            return wf
    wf = upsert_workflow(session, f"trace:{trace.id}", id_source="cmdline", name=Path(trace.path).name)
    trace.workflow_id = wf.id
    return wf


def analyze_trace(store: Store, trace_id: int, *, cache_dir: Path, host_id: str | None = None,
                  thresholds: dict | None = None, memory_budget: int | None = None,
                  bounds: TraceBounds = TraceBounds()) -> dict[str, Any]:
    """Analyse one registered trace; returns {"status", "error", "findings", "summary"}.

    A bad file marks the trace failed with the reason (the error is returned, not raised); an unknown
    trace id raises NotFound. `cache_dir` holds parsed traces (FLEETLENS_HOME/cache/traces); `host_id` is the host
    analysing, named when a trace another host wrote cannot be read here.
    """
    th = thresholds or load_thresholds()
    with store.session() as session:
        trace = session.get(Trace, trace_id)
        if trace is None:
            raise NotFound(f"no trace {trace_id} in the store; `fleetlens analyze PATH --store` registers one")
        trace.status, trace.error = "analyzing", None
        path, written_on = trace.path, trace.host_id
    try:
        summary, found = analyze_one(path, thresholds=th, cache_dir=cache_dir, memory_budget=memory_budget,
                                     bounds=bounds)
    except Exception as exc:  # every failure is recorded; only InvalidTrace is the file's fault
        reason = exc.problem if isinstance(exc, InvalidTrace) else f"analysis failed: {type(exc).__name__}: {exc}"
        here = host_id
        if isinstance(exc, InvalidTrace) and not Path(path).exists() and written_on and here and written_on != here:
            reason += (f" here on {here}; host {written_on} wrote it: the analyzer must see the same traces folder "
                       "(mount FLEETLENS_HOME/traces on shared storage, see docs/airflow.md)")
        if not isinstance(exc, InvalidTrace):
            log.exception("trace %s (%s) failed", trace_id, path)
        with store.session() as session:
            trace = session.get(Trace, trace_id)
            trace.status, trace.error, trace.analyzed_at = "failed", f"{path}: {reason}", time.time()
        return {"status": "failed", "error": f"{path}: {reason}", "findings": [], "summary": None}

    with store.session() as session:
        trace = session.get(Trace, trace_id)
        wf = _workflow_for(session, trace)
        gpus = wf.gpus or 1
        specs = [f.to_spec(wf.id, gpus, trace.id) for f in found]
        for spec in specs:
            upsert_finding(session, spec)
        # what an earlier trace of this rank found and this one does not is gone: resolved, no longer counted
        resolve_superseded(session, wf.id, f"rank{summary['rank']}", trace.id, {spec.fingerprint for spec in specs})
        trace.status, trace.error, trace.analyzed_at = "analyzed", None, time.time()
        trace.summary = summary
        trace.steps = summary["n_steps"]
        trace.rank = summary["rank"]
        set_findings = _set_rules(session, trace, th, gpus)
    return {"status": "analyzed", "error": None, "findings": [f.as_dict(gpus) for f in [*found, *set_findings]],
            "summary": summary}


def _set_rules(session, trace: Trace, th: dict, gpus: int) -> list:
    """Once all ranks of one profile request are analysed, compare them (straggler)."""
    if trace.profile_request_id is None:
        return []
    siblings = list(session.scalars(select(Trace).where(Trace.profile_request_id == trace.profile_request_id)))
    if len(siblings) < 2 or any(t.status != "analyzed" or not t.summary for t in siblings):
        return []
    found = run_set_rules([t.summary for t in siblings], th)
    for f in found:
        f.subject = f"ranks:{trace.profile_request_id}"
        upsert_finding(session, f.to_spec(trace.workflow_id, gpus, trace.id))
    return found


def analyze_pending(store: Store, *, cache_dir: Path, host_id: str | None = None, limit: int | None = None,
                    thresholds: dict | None = None, bounds: TraceBounds = TraceBounds()) -> dict[str, int]:
    """Analyse every trace still 'registered' (oldest first); returns {"analyzed": n, "failed": m}. Each trace is
    claimed before its analysis, so two runs at once (serve's analyze and trace jobs) never analyse one twice."""
    with store.session() as session:
        query = select(Trace.id).where(Trace.status == "registered").order_by(Trace.created_at, Trace.id)
        if limit:
            query = query.limit(limit)
        ids = list(session.scalars(query))
    counts = {"analyzed": 0, "failed": 0}
    th = thresholds or load_thresholds()
    for trace_id in ids:
        if not _claim(store, trace_id):  # another run took it since the list was read (serve's two trace jobs)
            continue
        res = analyze_trace(store, trace_id, thresholds=th, cache_dir=cache_dir, host_id=host_id, bounds=bounds)
        counts[res["status"]] += 1
    return counts


def _claim(store: Store, trace_id: int) -> bool:
    """Mark a 'registered' trace 'analyzing' in one statement; False when it is no longer 'registered'."""
    with store.session() as session:
        return session.execute(update(Trace).where(Trace.id == trace_id, Trace.status == "registered")
                               .values(status="analyzing", error=None)).rowcount == 1


def pending_batches(store: Store, batch_size: int) -> list[list[int]]:
    """Ids of the traces still 'registered', oldest first, in batches of at most `batch_size`: one batch is one
    unit of work a worker takes (the analyze DAG maps one task over each)."""
    if batch_size < 1:
        raise InvalidInput(f"a trace batch must hold at least one trace, not {batch_size}; "
                           "set FLEETLENS_ANALYZE_BATCH_SIZE to 1 or more")
    with store.session() as session:
        ids = list(session.scalars(select(Trace.id).where(Trace.status == "registered")
                                   .order_by(Trace.created_at, Trace.id)))
    return [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]


def analyze_batch(store: Store, trace_ids: list[int], *, cache_dir: Path, host_id: str | None = None,
                  thresholds: dict | None = None, bounds: TraceBounds = TraceBounds()) -> dict[str, list[int]]:
    """Analyse the traces of one batch that are still to do: 'registered', or 'analyzing' when a worker died in the
    middle of one (its retry lands here; findings are upserted, so nothing is counted twice). Traces another try
    already finished are skipped, and an id no longer in the store too. Returns the ids by outcome."""
    th = thresholds or load_thresholds()
    out: dict[str, list[int]] = {"analyzed": [], "failed": [], "skipped": []}
    for trace_id in trace_ids:
        with store.session() as session:
            status = session.scalar(select(Trace.status).where(Trace.id == trace_id))
        if status not in ("registered", "analyzing"):
            out["skipped"].append(trace_id)
            continue
        res = analyze_trace(store, trace_id, thresholds=th, cache_dir=cache_dir, host_id=host_id, bounds=bounds)
        out[res["status"]].append(trace_id)
    return out


def register_trace(store: Store, path: str | Path, *, workflow_id: str | None = None, rank: int = 0,
                   host_id: str | None = None, profile_request_id: int | None = None) -> int:
    """Record a trace file given by hand in the store (status 'registered'), creating its workflow if it is new;
    returns its id. Traces the job SDK captures are registered by the agent through store.profiling."""
    with store.session() as session:
        if workflow_id is not None:
            upsert_workflow(session, workflow_id)
        return profiling.register_trace(session, workflow_id, Path(path).resolve(), rank, profile_request_id,
                                        host_id=host_id).id
