"""Workflow page: one workflow's telemetry, step time, findings, traces, and the "Profile now" control."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from store.errors import FleetlensError
from store.placements import FAILURE_LABEL
from ui.dashboard import actions, charts
from ui.dashboard.common import ago, cached, device_page, fresh, report
from ui.dashboard.findings_view import finding_cards
from ui.dashboard.state_queries import workflow_placement

PROGRESS_REFRESH_S = 3.0
PROGRESS = {"pending": (0.15, "waiting for the agent"), "capturing": (0.6, "capturing"),
            "done": (1.0, "trace captured"), "failed": (1.0, "failed"), "expired": (1.0, "expired")}

ctx = device_page("Workflow")

try:
    listed = fresh(ctx, "workflows")
except FleetlensError as exc:
    report(exc)
    st.stop()
if listed.empty:
    st.info("No workflow has been seen yet. Jobs appear here once an agent sees their processes; name one with "
            "`FLEETLENS_WORKFLOW=my-job` in its environment, or start it with `fleetlens run -- CMD`.")
    st.stop()

ids = list(listed.id)
asked = st.query_params.get("workflow")
if asked is not None and asked not in ids:
    st.warning(f"There is no workflow **{asked}** in the store. Pick one of the {len(ids)} recorded below.",
               icon=":material/help:")
    asked = None
choice = st.selectbox("Workflow", ids, index=ids.index(asked) if asked else 0,
                      format_func=lambda i: f"{i}  ·  {listed.set_index('id').team.get(i) or 'no team'}")
if choice != st.query_params.get("workflow"):
    st.query_params["workflow"] = choice
info = fresh(ctx, "workflow", choice)
if info is None:  # deleted between the list and now
    st.warning(f"Workflow **{choice}** is no longer in the store.")
    st.stop()

st.caption(
    f"team **{info['team'] or '—'}** · owner {info['owner'] or '—'} · {info['state']} · "
    f"{'managed' if info['managed'] else 'unmanaged'} · last seen {ago(info['last_seen'])}"
)
slurm_job = fresh(ctx, "slurm_job", choice)
if slurm_job is not None:  # a Slurm job: what it asked for, what it holds, and whether fleetlens may move it
    held = slurm_job["gpus_held"] or "none"
    limit = f"{slurm_job['time_limit_s'] / 60:.0f} min" if slurm_job["time_limit_s"] else "no time limit"
    why = f" ({slurm_job['reason']})" if slurm_job["reason"] else ""
    st.markdown(
        f"Slurm job **{slurm_job['job_id']}** · {slurm_job['state']}{why} · node {slurm_job['nodes'] or '—'} · "
        f"asked for **{slurm_job['gres'] or 'no GPU'}** · holds GPU {held} · {limit} · "
        f"partition {slurm_job['partition'] or '—'} · restarts {slurm_job['restart_count']}")
    if slurm_job["opted_in"]:
        st.caption("Opted in: fleetlens may requeue it into fewer shards (it checkpoints on SIGUSR1 first).")
    else:
        st.caption(f"Observed and advised only: {slurm_job['not_movable_reason']}.")
if (info.get("labels") or {}).get(FAILURE_LABEL):  # why fleetlens saw it fail, e.g. over its memory share
    st.error(f"**{choice}** {info['labels'][FAILURE_LABEL]}")

tab_telemetry, tab_findings, tab_traces = st.tabs(["Telemetry", "Findings", "Traces & profiling"])

with tab_telemetry:
    for where in workflow_placement(ctx.store, choice):  # from the enforcer's fleet state, as the planner sees it
        lane = f"lane {where['lane_id']}" if where["lane_id"] is not None else "the whole device"
        shared = (f"; shares its lane with {', '.join(where['lane_mates'])}" if where["lane_mates"] else "") + (
            f"; beside {', '.join(where['beside'])}" if where["beside"] else "")
        st.caption(f"placed on device {where['device_id']} ({where['host']}), {lane}{shared}; the device's free "
                   f"capacity {int(where['free_capacity']) / 2**30:.1f} GiB")
    try:
        series = cached(ctx, "workflow_series", choice, ctx.window)
        steps = cached(ctx, "workflow_steps", choice, ctx.window)
    except FleetlensError as exc:
        report(exc)
        series, steps = pd.DataFrame(), pd.DataFrame()
    if series.empty:
        if ctx.window.uses_rollups:
            st.info(f"No samples of this workflow in the last {ctx.window_label}: no hourly rollups, and no raw "
                    "samples since the last rolled-up hour.")
        else:
            st.info(f"No samples of this workflow in the last {ctx.window_label}.")
    else:
        m = st.columns(4)
        own = series["own_util"] if "own_util" in series else pd.Series(dtype=float)
        util = own if own.notna().any() else series.util  # its own when its processes report one
        m[0].metric("Mean utilisation", f"{util.mean():.0%}" if util.notna().any() else "–",
                    help="its own processes' utilisation, what the detectors judge it by" if own.notna().any()
                    else "its devices' utilisation (its processes report none of their own)")
        m[1].metric("Device utilisation", f"{series.util.mean():.0%}" if series.util.notna().any() else "–",
                    help="its devices' utilisation, lane-mates included: the context")
        m[2].metric("Mean SM active", f"{series.sm_active.mean():.0%}" if series.sm_active.notna().any() else "–")
        peak, total = series.mem_used.max(), series.mem_total.max()
        m[3].metric("Peak memory", f"{peak / 2**30:.1f} GiB" if pd.notna(peak) else "–",
                    help=f"of {total / 2**30:.0f} GiB device memory" if pd.notna(total) else None)
        st.plotly_chart(charts.workflow_series(series))
        if ctx.window.uses_rollups and (series["source"] == "raw").any():
            st.caption("Closed hours from the hourly rollups; the hours after the last rollup (the current, "
                       "unfinished one) from raw samples.")
    if not steps.empty:
        st.plotly_chart(charts.step_time(steps))
    else:
        st.caption("No step times reported (jobs report them through the `collector.job` SDK).")

with tab_findings:
    finding_cards(ctx, fresh(ctx, "findings", workflow_id=choice), key="wf")

with tab_traces:
    st.markdown("#### Profile now")
    col_steps, col_button = st.columns([1, 3], vertical_alignment="bottom")
    n_steps = col_steps.number_input("Steps to capture", min_value=1, max_value=actions.MAX_PROFILE_STEPS,
                                     value=10, step=1, key="fl_profile_steps")
    if col_button.button("Profile now", type="primary", key="fl_profile_now",
                           help="Operators only: asks the workflow's agent to capture a trace"):
        try:
            rid = actions.request_profile(ctx.store, ctx.principal, choice, int(n_steps))
            st.success(f"Profile request {rid} created: the agent captures {int(n_steps)} steps.",
                       icon=":material/check_circle:")
        except FleetlensError as exc:
            report(exc)
    requests = fresh(ctx, "profile_requests", choice)
    waiting = bool(requests.status.isin(["pending", "capturing"]).any()) if not requests.empty else False

    # While a request is open its progress redraws itself every few seconds (only this part of the page).
    @st.fragment(run_every=PROGRESS_REFRESH_S if waiting else None)
    def progress() -> None:
        rows = fresh(ctx, "profile_requests", choice)
        if rows.empty:
            st.caption("No profile has been requested for this workflow.")
            return
        for row in rows.head(3).itertuples():
            fraction, text = PROGRESS.get(row.status, (0.0, row.status))
            detail = f" — {row.error}" if row.error else ""
            st.progress(fraction, text=f"request {row.id} · {row.steps} steps · {row.status} ({text}) · "
                                       f"by {row.requested_by or '—'} · {ago(row.requested_at)}{detail}")

    progress()

    st.markdown("#### Traces")
    traces = fresh(ctx, "workflow_traces", choice)
    if traces.empty:
        st.caption("No traces yet. Press **Profile now** (or run `fleetlens profile WORKFLOW`).")
    for row in traces.itertuples():
        title = f"trace {row.id} · rank {row.rank} · {row.status} · {ago(row.created_at)}"
        with st.expander(title, expanded=row.Index == 0):
            st.caption(f"{row.path} · {row.steps or '?'} steps · host {row.host_id or '—'}")
            if row.status == "failed":
                st.error(row.error or "analysis failed")
            summary = row.summary if isinstance(row.summary, dict) else None
            figures = charts.trace_figures(summary)
            if summary and summary.get("fractions"):
                parts = {k: v for k, v in summary["fractions"].items() if k in charts.MAIN_PARTS and v is not None}
                if parts:
                    cols = st.columns(len(parts))
                    for col, (name, value) in zip(cols, parts.items(), strict=True):
                        col.metric(f"{name} share", f"{value:.0%}")
            if not figures:
                st.caption("No breakdown yet: the analyzer writes one when it has analysed this trace.")
            for name, fig in figures:
                st.plotly_chart(fig, key=f"trace-{row.id}-{name}")
