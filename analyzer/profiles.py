"""Profiling the schedulers drive: periodic requests for the workflows that use the most GPU-hours (the Meta
system's whole-fleet profiling), and the on-demand cycle request -> wait for the trace -> analyse it.

The request lifecycle itself lives in store.profiling; the agents and the job SDK capture the trace. These
functions are what an Airflow task or the embedded scheduler calls; each returns a small JSON-able summary.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from analyzer.ranking import rank_workflows
from analyzer.traces import analyze_trace
from analyzer.traces.claims import ClaimPolicy
from store import profiling
from store.db import Store
from store.errors import FleetlensError, InvalidInput
from store.models import Finding, Workflow
from store.settings import Settings

DAY = 86400.0


class ProfileNotCaptured(FleetlensError):
    """A profile request failed or expired, so there is no trace to analyse."""


class ProfileAnalysisFailed(FleetlensError):
    """The trace of a profile request arrived but could not be analysed."""


def profile_top_workflows(
    store: Store,
    settings: Settings,
    *,
    n: int | None = None,
    steps: int | None = None,
    period_s: float = DAY,
    now: float | None = None,
) -> dict[str, Any]:
    """Request a profile of each of the `n` running workflows with the most GPU-hours held in the last period.

    A workflow that already has an open request is left alone (a job traces one request at a time). Defaults:
    settings.profile_top_n workflows, settings.profile_steps steps, requests living settings.profile_ttl_s.
    """
    n = settings.profile_top_n if n is None else n
    steps = settings.profile_steps if steps is None else steps
    if n < 0:
        raise InvalidInput(f"the number of workflows to profile must be 0 or more, not {n}")
    now = time.time() if now is None else float(now)
    ranked = rank_workflows(store, now, period_s)
    ranked = ranked[ranked["gpu_hours_held"] > 0].sort_values(
        ["gpu_hours_held", "workflow_id"], ascending=[False, True])
    held = dict(zip(ranked["workflow_id"], ranked["gpu_hours_held"], strict=True))
    requested: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with store.session() as session:
        running = set(session.scalars(
            select(Workflow.id).where(Workflow.id.in_(list(held)), Workflow.state == "running")))
        for workflow_id in held:
            if len(requested) >= n:
                break
            if workflow_id not in running:
                skipped[workflow_id] = "not running"
                continue
            if profiling.open_requests(session, workflow_id, now=now):
                skipped[workflow_id] = "a profile request is already open"
                continue
            request = profiling.request_profile(session, workflow_id, steps, reason="periodic",
                                                requested_by="periodic", ttl_s=settings.profile_ttl_s, now=now)
            requested.append({"request_id": request.id, "workflow_id": workflow_id,
                              "gpu_hours_held": round(float(held[workflow_id]), 4)})
    return {"requested": requested, "skipped": skipped, "steps": steps}


def request_on_demand(
    store: Store, settings: Settings, workflow_id: str, steps: int, *, requested_by: str | None = None
) -> dict[str, Any]:
    """Ask the jobs of `workflow_id` to trace their next `steps` steps. NotFound names an unknown workflow."""
    with store.session() as session:
        request = profiling.request_profile(session, workflow_id, steps, reason="on_demand",
                                            requested_by=requested_by, ttl_s=settings.profile_ttl_s)
        return {"request_id": request.id, "workflow_id": workflow_id, "steps": steps,
                "expires_at": request.expires_at}


def request_status(store: Store, settings: Settings, request_id: int) -> dict[str, Any]:
    """Where a profile request stands; `done` once its trace is in. A failed or expired request raises."""
    with store.session() as session:
        profiling.expire_stale(session, capture_timeout_s=settings.profile_capture_timeout_s)
        request = profiling.get_request(session, request_id)
        if request.status in (profiling.FAILED, profiling.EXPIRED):
            raise ProfileNotCaptured(f"profile request #{request_id} of workflow {request.workflow_id!r} "
                                     f"{request.status}: {request.error}")
        traces = profiling.traces_for_request(session, request_id)
        return {"request_id": request_id, "workflow_id": request.workflow_id, "status": request.status,
                "done": request.status == profiling.DONE, "traces": len(traces)}


def analyze_request(store: Store, settings: Settings, request_id: int) -> dict[str, Any]:
    """Analyse the traces of a finished profile request (those not analysed yet) and list the findings they gave.

    Findings are recorded by the trace analysis itself; a trace that cannot be analysed is marked failed and
    raises ProfileAnalysisFailed after the others were analysed.
    """
    with store.session() as session:
        request = profiling.get_request(session, request_id)
        if request.status != profiling.DONE:
            raise ProfileNotCaptured(f"profile request #{request_id} is {request.status}, not done: there is no "
                                     "trace to analyse yet")
        workflow_id = request.workflow_id
        pending = [t.id for t in profiling.traces_for_request(session, request_id) if t.status == "registered"]
    for trace_id in pending:
        analyze_trace(store, trace_id, cache_dir=settings.home / "cache" / "traces", host_id=settings.host_id,
                      claims=ClaimPolicy.from_settings(settings))
    with store.session() as session:
        traces = profiling.traces_for_request(session, request_id)
        ids = [t.id for t in traces]
        findings = session.scalars(
            select(Finding).where(Finding.trace_id.in_(ids)).order_by(Finding.gpu_hours_per_day.desc(), Finding.id)
        ).all() if ids else []
        summary = {
            "request_id": request_id, "workflow_id": workflow_id,
            "traces": [{"id": t.id, "rank": t.rank, "status": t.status, "path": t.path, "error": t.error}
                       for t in traces],
            "findings": [{"id": f.id, "rule": f.rule, "severity": f.severity, "title": f.title} for f in findings],
        }
    failed = [t for t in summary["traces"] if t["status"] == "failed"]
    if failed:
        raise ProfileAnalysisFailed(f"profile request #{request_id}: {len(failed)} of {len(traces)} traces could "
                                    f"not be analysed: {failed[0]['error']}")
    return summary

