"""Analyse registered traces (traces table): status registered -> analyzing -> analyzed | failed, findings upserted.

A run claims a trace before the work (status 'analyzing', committed) and writes the final state in its own
transaction, so an exception in between is caught and recorded as failed. A run killed outright (OOM, SIGKILL, its
host down) stops renewing its claim; once the claim has lapsed the next run takes the trace up again, and after
FLEETLENS_TRACE_MAX_ATTEMPTS such claims it is marked failed (analyzer.traces.claims).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from analyzer.rules import load_thresholds, run_set_rules
from analyzer.traces.cache import TraceBounds
from analyzer.traces.claims import Claim, ClaimPolicy, Refusal, claim, claim_when_lapsed, takeable
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
                  bounds: TraceBounds = TraceBounds(), claims: ClaimPolicy = ClaimPolicy()) -> dict[str, Any]:
    """Analyse one trace now, whatever its status (again if it was analysed); returns {"status", "error",
    "findings", "summary"}.

    A bad file marks the trace failed with the reason (the error is returned, not raised); an unknown trace id raises
    NotFound. A trace another live run is analysing is left to it ("skipped", the error says whose it is).
    `cache_dir` holds parsed traces (FLEETLENS_HOME/cache/traces); `host_id` is the host analysing, named when a
    trace another host wrote cannot be read here.
    """
    got = claim(store, trace_id, claims, statuses=("registered", "analyzed", "failed"), host_id=host_id)
    if got == "missing":
        raise NotFound(f"no trace {trace_id} in the store; `fleetlens analyze PATH --store` registers one")
    if not isinstance(got, Claim):
        return _not_analysed(store, trace_id, got)
    return _analyze_claimed(got, cache_dir=cache_dir, host_id=host_id, thresholds=thresholds or load_thresholds(),
                            memory_budget=memory_budget, bounds=bounds)


def _not_analysed(store: Store, trace_id: int, refusal: Refusal) -> dict[str, Any]:
    """The result for a trace this run did not take: failed if it was given up, else skipped (another run has it)."""
    with store.session() as session:
        status, error, attempts, claimed_at = session.execute(
            select(Trace.status, Trace.error, Trace.attempts, Trace.claimed_at).where(Trace.id == trace_id)).one()
    if refusal == "gave_up":
        return {"status": "failed", "error": error, "findings": [], "summary": None}
    why = (f"is being analysed by another run (attempt {attempts}, its claim renewed {time.time() - claimed_at:.0f} s "
           "ago)" if status == "analyzing" and claimed_at is not None else f"is {status}")
    return {"status": "skipped", "error": f"trace {trace_id} {why}", "findings": [], "summary": None}


def _analyze_claimed(claimed: Claim, *, cache_dir: Path, host_id: str | None, thresholds: dict,
                     memory_budget: int | None = None, bounds: TraceBounds = TraceBounds()) -> dict[str, Any]:
    """The analysis of a trace this run holds the claim on, renewed while it runs; the outcome is written only if
    the claim is still this run's."""
    store, trace_id, path, written_on = claimed.store, claimed.trace_id, claimed.path, claimed.written_on
    try:
        with claimed.kept():
            summary, found = analyze_one(path, thresholds=thresholds, cache_dir=cache_dir,
                                         memory_budget=memory_budget, bounds=bounds)
    except Exception as exc:  # every failure is recorded; only InvalidTrace is the file's fault
        reason = exc.problem if isinstance(exc, InvalidTrace) else f"analysis failed: {type(exc).__name__}: {exc}"
        here = host_id
        if isinstance(exc, InvalidTrace) and not Path(path).exists() and written_on and here and written_on != here:
            reason += (f" here on {here}; host {written_on} wrote it: the analyzer must see the same traces folder "
                       "(mount FLEETLENS_HOME/traces on shared storage, see docs/airflow.md)")
        if not isinstance(exc, InvalidTrace):
            log.exception("trace %s (%s) failed", trace_id, path)
        with store.session() as session:
            if not claimed.finish(session, status="failed", error=f"{path}: {reason}", analyzed_at=time.time()):
                return _lost(trace_id)
        return {"status": "failed", "error": f"{path}: {reason}", "findings": [], "summary": None}
    except BaseException:  # Ctrl-C, SIGTERM (SystemExit), a task runner's stop: not the trace's fault, no attempt
        claimed.release()
        raise

    with store.session() as session:
        if not claimed.finish(session, status="analyzed", error=None, analyzed_at=time.time()):
            return _lost(trace_id)
        trace = session.get(Trace, trace_id)
        wf = _workflow_for(session, trace)
        gpus = wf.gpus or 1
        specs = [f.to_spec(wf.id, gpus, trace.id) for f in found]
        for spec in specs:
            upsert_finding(session, spec)
        # what an earlier trace of this rank found and this one does not is gone: resolved, no longer counted
        resolve_superseded(session, wf.id, f"rank{summary['rank']}", trace.id, {spec.fingerprint for spec in specs})
        trace.summary = summary
        trace.steps = summary["n_steps"]
        trace.rank = summary["rank"]
        set_findings = _set_rules(session, trace, thresholds, gpus)
    return {"status": "analyzed", "error": None, "findings": [f.as_dict(gpus) for f in [*found, *set_findings]],
            "summary": summary}


def _lost(trace_id: int) -> dict[str, Any]:
    return {"status": "skipped", "error": (f"trace {trace_id}: another run took it over while this one analysed it "
                                           "(this run's claim had lapsed); this run's result was dropped"),
            "findings": [], "summary": None}


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
                    thresholds: dict | None = None, bounds: TraceBounds = TraceBounds(),
                    claims: ClaimPolicy = ClaimPolicy()) -> dict[str, int]:
    """Analyse every trace still 'registered', and every one a dead run left 'analyzing' (its claim lapsed), oldest
    first; returns {"analyzed": n, "failed": m}. Each trace is claimed before its analysis, so two runs at once
    (serve's analyze and trace jobs, workers on other hosts) never analyse one together: a trace a live run holds is
    left to it."""
    with store.session() as session:
        query = select(Trace.id).where(takeable(["registered"], claims)).order_by(Trace.created_at, Trace.id)
        if limit:
            query = query.limit(limit)
        ids = list(session.scalars(query))
    counts = {"analyzed": 0, "failed": 0}
    th = thresholds or load_thresholds()
    for trace_id in ids:
        got = claim(store, trace_id, claims, host_id=host_id)
        if got == "gave_up":
            counts["failed"] += 1
        if not isinstance(got, Claim):  # another run took it since the list was read, or it was given up
            continue
        res = _analyze_claimed(got, thresholds=th, cache_dir=cache_dir, host_id=host_id, bounds=bounds)
        if res["status"] in counts:
            counts[res["status"]] += 1
    return counts


def pending_batches(store: Store, batch_size: int, claims: ClaimPolicy = ClaimPolicy()) -> list[list[int]]:
    """Ids of the traces still to analyse ('registered', or left 'analyzing' by a dead run), oldest first, in batches
    of at most `batch_size`: one batch is one unit of work a worker takes (the analyze DAG maps one task over each)."""
    if batch_size < 1:
        raise InvalidInput(f"a trace batch must hold at least one trace, not {batch_size}; "
                           "set FLEETLENS_ANALYZE_BATCH_SIZE to 1 or more")
    with store.session() as session:
        ids = list(session.scalars(select(Trace.id).where(takeable(["registered"], claims))
                                   .order_by(Trace.created_at, Trace.id)))
    return [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]


def analyze_batch(store: Store, trace_ids: list[int], *, cache_dir: Path, host_id: str | None = None,
                  thresholds: dict | None = None, bounds: TraceBounds = TraceBounds(),
                  claims: ClaimPolicy = ClaimPolicy()) -> dict[str, list[int]]:
    """Analyse the traces of one batch that are still to do: 'registered', or 'analyzing' when the worker that
    claimed one died in the middle of it (the batch's retry lands here; findings are upserted, so nothing is counted
    twice). A claim not lapsed yet is watched for at most one lease (FLEETLENS_TRACE_CLAIM_TIMEOUT_S): retaken once
    it lapses, left to its run if it is renewed. Traces another run finished or holds are skipped, and an id no
    longer in the store too. Returns the ids by outcome."""
    th = thresholds or load_thresholds()
    out: dict[str, list[int]] = {"analyzed": [], "failed": [], "skipped": []}
    for trace_id in trace_ids:
        got = claim_when_lapsed(store, trace_id, claims, host_id=host_id)
        if not isinstance(got, Claim):
            out["failed" if got == "gave_up" else "skipped"].append(trace_id)
            continue
        res = _analyze_claimed(got, thresholds=th, cache_dir=cache_dir, host_id=host_id, bounds=bounds)
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
