"""The serving rules, over each serving application's minutes in a window (store.serving):

- serving.slo_misses: an application with an SLO meets it for less than its target share of requests (shed
  requests count as misses). Evidence says whether queueing or execution is to blame.
- serving.dynamic_runtime: an application's execution-time CV is at least `cv_threshold` (0.3): a scheduler that
  plans with a point estimate batches the wrong requests together; use the distribution-aware one
  (enforcer.serving, our reconstruction of Orloj's). The CV is estimated from the quartiles (equal to the CV for a
  normal distribution; a few stalls of a shared host do not inflate it as they do the moment CV, which the
  evidence also gives).
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


def _latency_quantiles(w: AppWindow) -> dict[str, float]:
    p50, p95, p99 = ls.quantiles(w.latency_hist, (0.5, 0.95, 0.99))
    e50, e99 = ls.quantiles(w.exec_hist, (0.5, 0.99))
    return {"latency_p50_s": p50, "latency_p95_s": p95, "latency_p99_s": p99, "exec_p50_s": e50, "exec_p99_s": e99}


def slo_misses(w: AppWindow, th: ServingThresholds) -> FindingSpec | None:
    att = w.attainment()
    if att is None or w.n + w.dropped < th.min_requests or att >= w.target:
        return None
    exec_over = w.n - ls.count_at_most(w.exec_hist, w.slo_s) if w.slo_s else 0
    wait_share = w.wait_sum / w.latency_sum if w.latency_sum > 0 else 0.0
    miss = 1.0 - att
    severity = "high" if miss >= 0.1 else "medium" if miss >= 0.03 else "low"
    if exec_over > 0.5 * (w.n + w.dropped) * miss:
        why = (f"{exec_over} requests ran longer than the SLO on their own: no queue can save them; the SLO or "
               "the model (fewer steps, early exit) must change")
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
    cv = w.exec_cv_quartiles
    if w.n < th.min_requests or math.isnan(cv) or cv < th.cv_threshold:
        return None
    return FindingSpec(
        rule=DYNAMIC_RUNTIME, workflow_id=w.workflow_id, source=SOURCE, severity="medium" if cv >= 0.6 else "low",
        subject=w.app,
        title=f"{w.app}: execution time varies (CV {cv:.2f}): a point-estimate batch scheduler will miss deadlines",
        fix=("schedule with the application's execution-time distribution (enforcer.serving.live.RequestQueue, "
             "our reconstruction of Orloj): it scores batches by their expected on-time requests and drops "
             "requests that can no longer make it"),
        evidence={"app": w.app, "exec_cv": cv, "exec_cv_moments": w.exec_cv, "cv_threshold": th.cv_threshold,
                  "requests": w.n,
                  "exec_mean_s": w.exec_mean, **_latency_quantiles(w)},
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
                  "replay": "FIFO per application in measured mean batch sizes, no drops (conservative)"},
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
