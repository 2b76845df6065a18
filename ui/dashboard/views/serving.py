"""Serving page: each application's latency CDF against its SLO, attainment over time, requests shed, what the
distribution-aware scheduler (our reconstruction of Orloj's) would change, and the right-sizing answer."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analyzer.serving.rules import ServingThresholds
from enforcer.sim.serving.rightsize import SCHEDULERS, prepare_workflow, rightsize
from store.errors import FleetlensError
from store.serving import AppWindow
from ui.dashboard import serving_charts
from ui.dashboard.common import context, fresh, report

MAX_REPLAY_REQUESTS = 100_000  # beyond this the page points at `fleetlens serving rightsize`
RIGHTSIZE_ALPHA = 0.1  # batch cost g(b) = 1 + alpha log2 b, as `fleetlens serving rightsize` defaults to

ctx = context()
st.title("Serving")
try:
    apps = fresh(ctx, "serving_windows", ctx.window)
except FleetlensError as exc:
    report(exc)
    st.stop()
if not apps:
    st.info("No serving workflow recorded requests in this window. A serving loop records them with the SDK's "
            "serving mode (`collector.serving`); set SLOs with `fleetlens serving slo WORKFLOW APP SECONDS`.")
    st.stop()

workflows = sorted({w.workflow_id for w in apps})
wf = st.selectbox("Serving workflow", workflows, key="fl_serving_wf")
mine = [w for w in apps if w.workflow_id == wf]
served, shed = sum(w.n for w in mine), sum(w.dropped for w in mine)
held = max(w.devices for w in mine)
judged = [w for w in mine if w.slo_s is not None]
met = sum(w.met() or 0 for w in judged)
total = sum(w.n + w.dropped for w in judged)
m = st.columns(4)
m[0].metric("Requests served", f"{served:,}")
m[1].metric("Requests shed", f"{shed:,}", help="dropped by the scheduler: counted as misses, never lost")
m[2].metric("SLO attainment", f"{met / total:.2%}" if total else "no SLO set")
m[3].metric("Devices held", held)
raw = fresh(ctx, "serving_raw_counts").get(wf)
if raw is not None:
    st.caption(f"Raw requests kept: {raw[0]:,} stored, {raw[1]:,} counted over the cap "
               "(`FLEETLENS_SERVING_RAW_REQUESTS`; every request is in the histograms).")

st.subheader("Latency against the SLO")
st.plotly_chart(serving_charts.latency_cdf(mine))

def _cv_within(w: AppWindow) -> float | None:
    cv, covered = w.exec_cv_within_batch(ServingThresholds().min_class_requests)
    return round(cv, 3) if covered else None


table = pd.DataFrame([{
    "application": w.app, "served": w.n, "shed": w.dropped, "SLO s": w.slo_s,
    "attainment": w.attainment(), "target": w.target, "exec CV in batch size": _cv_within(w),
    "exec CV all sizes": round(w.exec_cv_quartiles, 3),
    "mean batch": round(w.batch_sum / w.n, 2) if w.n else None} for w in mine])
st.dataframe(table, hide_index=True)
st.caption("Execution times are batch times, which grow with the batch's size: the CV within one batch size is the "
           "model's own variation (what `serving.dynamic_runtime` judges); the CV over all sizes includes batching. "
           f"Empty: no batch size with {ServingThresholds().min_class_requests} requests.")
unsized = [w.app for w in mine if w.batch_sized < w.n]
if unsized:
    st.caption(f"{', '.join(unsized)}: minutes stored before revision 0016 keep no batch sizes; their requests are in "
               "the CV over all sizes only.")

st.subheader("Attainment over time")
st.plotly_chart(serving_charts.attainment_over_time(mine))

st.subheader("What the scheduler would change, and the right size")
if not judged or len(judged) < len(mine):
    st.caption("Every application needs an SLO to replay it: `fleetlens serving slo WORKFLOW APP SECONDS`.")
elif served + shed > MAX_REPLAY_REQUESTS:
    st.caption(f"{served + shed:,} requests: replay them with `fleetlens serving rightsize {wf}`.")
else:
    try:
        prep, slo, held_n = prepare_workflow(ctx.store, wf, now=ctx.window.end,
                                             window_s=ctx.window.end - ctx.window.start, alpha=RIGHTSIZE_ALPHA)
        rs = rightsize(prep, slo, alpha=RIGHTSIZE_ALPHA, target=min(w.target for w in judged),
                       max_gpus=max(8, 2 * held_n))
    except FleetlensError as exc:
        report(exc)
        st.stop()
    rows = []
    for name in SCHEDULERS:
        att = rs.attainment.get(name, {})
        rows.append({"scheduler": name, "devices needed": rs.needed.get(name),
                     "attainment tried (devices: share)": ", ".join(f"{k}: {v:.3f}" for k, v in att.items())})
    st.dataframe(pd.DataFrame(rows), hide_index=True)
    best = rs.best
    if best is None:
        why = rs.shortfall()
        st.warning(why[0].upper() + why[1:] + ".")
    else:
        st.success(f"Right size: **{best[1]} devices** with {best[0]} (holds {held_n}); replayed "
                   f"{rs.requests:,} requests with the measured arrivals and execution times.")
    for name, basis in prep.time_basis.items():
        st.caption(f"{name}: {basis}.")
