"""Fleet page: hosts the enforcer leaves alone, device-hours held vs active, utilisation distribution, waste ranking,
enforcement, hosts (each with its status: heard from, not heard from, taking no new job)."""

from __future__ import annotations

import streamlit as st

from store.errors import FleetlensError
from ui.dashboard import charts, waste
from ui.dashboard.common import ago, cached, device_page, fmt_hours, fresh, report
from ui.dashboard.hosts_view import host_table, left_alone_notice

ctx = device_page("Fleet")

try:
    hours = cached(ctx, "fleet_hours", ctx.window)
    timeline = cached(ctx, "fleet_timeline", ctx.window)
    util = cached(ctx, "device_utilisation", ctx.window)
    freed = cached(ctx, "freed_over_time", ctx.window)
    hosts = host_table(ctx)
    host_event_table = fresh(ctx, "host_events")
    slurm_table = fresh(ctx, "slurm_jobs")
except FleetlensError as exc:
    report(exc)
    st.stop()

left_alone_notice(hosts)  # the hosts the enforcer plans around, named at the top with why

held, active = hours["held"], hours["active"]
c = st.columns(5)
c[0].metric("Hosts", f"{ctx.state['hosts']:,}")
c[1].metric("Devices", f"{ctx.state['devices']:,}")
c[2].metric("Device-hours held", fmt_hours(held), help=f"last {ctx.window_label}")
c[3].metric("Device-hours active", fmt_hours(active), help="utilisation-weighted")
c[4].metric("Active / held", f"{active / held:.0%}" if held else "–")

left, right = st.columns([3, 2])
with left:
    if timeline.empty:
        st.info(f"No device samples or rollups in the last {ctx.window_label}.")
    else:
        st.plotly_chart(charts.held_vs_active(timeline))
with right:
    if util.util_mean.notna().any():
        st.plotly_chart(charts.utilisation_histogram(util))
    else:
        st.info("No utilisation readings in this window.")

st.subheader("Waste: recoverable GPU-hours")
waste.show(ctx)

st.subheader("Enforcement")
e1, e2 = st.columns([3, 2])
with e1:
    if freed.empty:
        st.caption("No plan has been applied in this window.")
    else:
        st.plotly_chart(charts.freed_over_time(freed))
with e2:
    plan_rows = fresh(ctx, "plans", ctx.window, limit=20)
    if not plan_rows.empty:
        st.metric("Devices freed (applied plans)", int(plan_rows.loc[plan_rows.applied, "devices_freed"].sum()))
        st.dataframe(plan_rows[["id", "policy", "applied", "devices_freed"]], hide_index=True)
    acts = fresh(ctx, "actions", limit=1000)
    if not acts.empty:
        st.dataframe(acts.groupby("state").size().rename("actions").reset_index(), hide_index=True)

st.subheader("Hosts")
if hosts.empty:
    st.info("No host has registered an agent yet: run `fleetlens agent` on each host.")
else:
    # last contact: its agent's heartbeat, or for a node an importer keeps (Slurm) its last record; status: whether
    # the enforcer leaves it alone, and why (the store's rule, as `fleetlens enforce` prints it)
    shown = hosts.assign(last_contact=[ago(t) for t in hosts.last_seen])
    st.dataframe(
        shown[["host", "status", "why", "hostname", "source", "agent_version", "devices", "last_contact"]],
        hide_index=True,
    )
if not host_event_table.empty:
    # what agents did or met outside any one job: an MPS daemon that died and was restarted, a missing binary
    st.caption("Host events")
    st.dataframe(host_event_table.assign(when=[ago(t) for t in host_event_table.ts])
                 [["when", "host", "kind", "level", "message"]], hide_index=True)

if not slurm_table.empty:
    # what the Slurm import last read (squeue/sinfo): each job's request, the GPUs it holds, and whether fleetlens may
    # move it (only jobs that opted in; the others are observed and advised)
    st.subheader("Slurm jobs")
    s = st.columns(4)
    running = slurm_table[slurm_table.state == "RUNNING"]
    s[0].metric("Slurm jobs running", f"{len(running):,}")
    # every node's GPUs of a job on several nodes; a GPU two shard jobs share counts once
    gpus = {(n, i) for by_node in running.gpus_by_node for n, ix in (by_node or []) for i in ix}
    s[1].metric("GPUs held by Slurm jobs", f"{len(gpus):,}")
    s[2].metric("Shards held", f"{int(running.shards.sum()):,}")
    s[3].metric("Opted in to moves", f"{int(running.opted_in.sum()):,}", help="of the running jobs")
    shown = slurm_table.assign(
        time_limit=[f"{t / 60:.0f} min" if t == t and t else "none" for t in slurm_table.time_limit_s],
        movable=["yes" if o else (r or "no") for o, r in zip(slurm_table.opted_in, slurm_table.not_movable_reason,
                                                              strict=True)])
    st.dataframe(shown[["workflow_id", "name", "user", "team", "partition", "state", "nodes", "gres", "gpus_held",
                        "time_limit", "restart_count", "movable"]], hide_index=True)
