"""The serving rules, over each serving application's minutes in a window (store.serving):

- serving.slo_misses: an application with an SLO meets it for less than its target share of requests (shed
  requests count as misses). Evidence says whether queueing or execution is to blame.
- serving.dynamic_runtime: an application's execution-time CV within one batch size is at least `cv_threshold`
  (0.3): a scheduler that plans with a point estimate batches the wrong requests together; use the
  distribution-aware one (enforcer.serving, our reconstruction of Orloj's). A request's execution time is its
  batch's, which grows with the batch's size, so a model with fixed times served at varied batch sizes spreads
  over all sizes; the CV judged is the request-weighted mean of the CVs of the batch-size classes
  (store.batch_sizes) with at least `min_class_requests` requests. Each CV is estimated from the quartiles (equal
  to the CV for a normal distribution; a few stalls of a shared host do not inflate it as they do the moment CV).
  The evidence also gives the CV over all sizes and the moment CV. Minutes stored before revision 0016 keep no
  batch sizes: when the window's classes hold too few requests to judge and some of its minutes have none, the
  rule judges the CV over all sizes, as before, and its evidence says so.
- serving.over_provisioned: replaying the workflow's measured arrivals and execution times on fewer devices
  (analyzer.serving.replay, a conservative FIFO replay) still meets every SLO. The freed devices' share of what
  the workflow holds is its cost: evidence `cost_fraction` and `gpus`, so the one waste function (analyzer.waste)
  counts it once, with the workflow's other claims, as a share of the time its devices are held.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from analyzer.serving.replay import fewest_devices
from store import batch_sizes as bs
from store import latency_sketch as ls
from store.db import Store
from store.findings import FindingSpec, upsert_findings
from store.serving import AppWindow, app_windows

SLO_MISSES = "serving.slo_misses"
DYNAMIC_RUNTIME = "serving.dynamic_runtime"
OVER_PROVISIONED = "serving.over_provisioned"
RULES = (SLO_MISSES, DYNAMIC_RUNTIME, OVER_PROVISIONED)
SOURCE = "telemetry"  # measured while running, like the telemetry rules (not from a trace)


@dataclass(frozen=True)
class ServingThresholds:
    window_s: float = 3600.0
    min_requests: int = 50  # fewer requests in the window say nothing either way
    cv_threshold: float = 0.3
    min_class_requests: int = 20  # a batch-size class with fewer requests has no quartiles worth judging


def _latency_quantiles(w: AppWindow) -> dict[str, object]:
    """Latency quantiles, and execution-time ones: the execution time is the request's batch's, so over all batch
    sizes (`exec_p50_s`, `exec_p99_s`) and per batch-size class (`exec_p50_by_batch_s`, when recorded)."""
    p50, p95, p99 = ls.quantiles(w.latency_hist, (0.5, 0.95, 0.99))
    e50, e99 = ls.quantiles(w.exec_hist, (0.5, 0.99))
    by_batch = {bs.class_label(c): ls.quantiles(sc.hist, (0.5,))[0] for c, sc in sorted(w.exec_by_batch.items())
                if sc.n}
    return {"latency_p50_s": p50, "latency_p95_s": p95, "latency_p99_s": p99, "exec_p50_s": e50, "exec_p99_s": e99,
            "exec_p50_by_batch_s": by_batch or None}


def slo_misses(w: AppWindow, th: ServingThresholds) -> FindingSpec | None:
    att = w.attainment()
    if att is None or w.n + w.dropped < th.min_requests or att >= w.target:
        return None
    exec_over = w.n - ls.count_at_most(w.exec_hist, w.slo_s) if w.slo_s else 0
    wait_share = w.wait_sum / w.latency_sum if w.latency_sum > 0 else 0.0
    miss = 1.0 - att
    severity = "high" if miss >= 0.1 else "medium" if miss >= 0.03 else "low"
    if exec_over > 0.5 * (w.n + w.dropped) * miss:
        # a request's execution time is its batch's: alone only in batches of one
        alone = w.exec_by_batch.get(1)
        alone_over = alone.n - ls.count_at_most(alone.hist, w.slo_s) if alone is not None and w.slo_s else 0
        if w.batch_sized == w.n and alone_over == exec_over:
            why = (f"{exec_over} requests ran longer than the SLO alone (in batches of one): no queue can save "
                   "them; the SLO or the model (fewer steps, early exit) must change")
        else:
            alone_part = f" ({alone_over} of them in batches of one)" if w.batch_sized else ""
            why = (f"{exec_over} requests' batches ran longer than the SLO{alone_part}: no queue can save them at the "
                   "batch sizes they ran in; smaller batches, or the SLO or the model (fewer steps, early exit), "
                   "must change")
    else:
        why = (f"queueing is {wait_share:.0%} of latency: more capacity at peaks, or the distribution-aware "
               "scheduler (drops hopeless requests, batches by deadline)")
    return FindingSpec(
        rule=SLO_MISSES, workflow_id=w.workflow_id, source=SOURCE, severity=severity, subject=w.app,
        title=f"{w.app}: {att:.1%} of requests met the {w.slo_s:g} s SLO (target {w.target:.0%})",
        fix=why,
        evidence={"app": w.app, "attainment": att, "target": w.target, "slo_s": w.slo_s, "requests": w.n,
                  "dropped": w.dropped, "met": w.met(), "exec_over_slo": exec_over, "wait_share": wait_share,
                  **_latency_quantiles(w)},
        location=f"{w.app} {w.first:.0f}-{w.last:.0f}",
    )


def dynamic_runtime(w: AppWindow, th: ServingThresholds) -> FindingSpec | None:
    if w.n < th.min_requests:
        return None
    cv_all = w.exec_cv_quartiles
    cv, covered = w.exec_cv_within_batch(th.min_class_requests)
    if covered >= th.min_requests:
        basis = "within batch sizes"
        what = f"within one batch size (CV {cv:.2f})"
    elif w.batch_sized < w.n:  # minutes stored before revision 0016: today's CV over all batch sizes
        cv, covered = cv_all, w.n
        basis = ("all batch sizes: minutes stored before revision 0016 keep no batch sizes, so batching may account "
                 "for part of this spread")
        what = f"(CV {cv:.2f} over all batch sizes)"
    else:
        return None  # batch sizes recorded, but too few requests at any one size to tell the model from batching
    if math.isnan(cv) or cv < th.cv_threshold:
        return None
    return FindingSpec(
        rule=DYNAMIC_RUNTIME, workflow_id=w.workflow_id, source=SOURCE, severity="medium" if cv >= 0.6 else "low",
        subject=w.app,
        title=f"{w.app}: execution time varies {what}: a point-estimate batch scheduler will miss deadlines",
        fix=("schedule with the application's execution-time distribution (enforcer.serving.live.RequestQueue, "
             "our reconstruction of Orloj): it scores batches by their expected on-time requests and drops "
             "requests that can no longer make it"),
        evidence={"app": w.app, "exec_cv": cv, "cv_basis": basis, "cv_requests": covered,
                  "exec_cv_all_sizes": cv_all, "exec_cv_moments": w.exec_cv,
                  "exec_cv_by_batch": {bs.class_label(c): {"requests": n, "cv": c_cv} for c, (n, c_cv)
                                       in w.exec_cv_by_batch(th.min_class_requests).items()} or None,
                  "cv_threshold": th.cv_threshold, "requests": w.n,
                  "mean_batch_size": w.batch_sum / w.n, "exec_mean_s": w.exec_mean, **_latency_quantiles(w)},
        location=f"{w.app} {w.first:.0f}-{w.last:.0f}",
    )


def over_provisioned(apps: list[AppWindow], th: ServingThresholds) -> FindingSpec | None:
    judged = [w for w in apps if w.slo_s is not None]
    held = max((w.devices for w in apps), default=1)
    if not judged or held < 2 or sum(w.n + w.dropped for w in apps) < th.min_requests:
        return None
    if any((w.attainment() or 0.0) < w.target for w in judged):
        return None  # missing its SLO already: not a place to take devices from
    need, att = fewest_devices(apps, held)
    if need >= held:
        return None
    wf = apps[0].workflow_id
    window_h = max(w.last for w in apps) - min(w.first for w in apps)
    window_h = window_h / 3600.0 if window_h > 0 else th.window_s / 3600.0
    share = (held - need) / held
    return FindingSpec(
        rule=OVER_PROVISIONED, workflow_id=wf, source=SOURCE, severity="high" if held - need >= 2 else "medium",
        subject="serving",
        title=f"{wf}: {need} of its {held} devices meet every SLO under the measured load",
        fix=(f"give back {held - need} device(s): `fleetlens serving rightsize {wf}` replays the load with the "
             "distribution-aware scheduler and the baselines and says which needs fewest"),
        evidence={"held_devices": held, "needed_devices": need, "cost_fraction": share, "gpus": held,
                  "subject": "serving", "attainment_on_needed": att, "window_hours": window_h,
                  "replay": ("FIFO per application in measured mean batch sizes, each batch's time drawn from its "
                             "size's measured times where recorded, no drops (conservative)")},
        gpu_hours_per_day=(held - need) * 24.0,
    )


def detect_serving(store: Store, *, now: float | None = None, th: ServingThresholds | None = None,
                   record: bool = True) -> list[FindingSpec]:
    """All three rules over the window ending now; recorded idempotently (one per rule and application)."""
    th = th or ServingThresholds()
    now = time.time() if now is None else now
    with store.session() as session:
        windows = app_windows(session, now - th.window_s, now)
    specs: list[FindingSpec] = []
    by_wf: dict[str, list[AppWindow]] = {}
    for w in windows:
        by_wf.setdefault(w.workflow_id, []).append(w)
        for rule in (slo_misses, dynamic_runtime):
            spec = rule(w, th)
            if spec is not None:
                specs.append(spec)
    for apps in by_wf.values():
        spec = over_provisioned(apps, th)
        if spec is not None:
            specs.append(spec)
    if record and specs:
        with store.session() as session:
            upsert_findings(session, specs, now)
    return specs
