"""Enforcement page: the hosts the enforcer leaves alone (not heard from, taking no new job), lanes per device, the
latest PACK and FAIR plans side by side (applied, with each move's outcome, or proposed, to apply with confirmation),
consolidation cycles (devices held, needed, freed, each move's reason), actions log. Columns carry human names; the
tables keep the store's column names underneath."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from store.errors import FleetlensError
from ui.dashboard import actions, charts
from ui.dashboard.common import ago, device_page, fresh, report
from ui.dashboard.hosts_view import host_table, left_alone_notice

POLICIES = ("pack", "fair")
MOVE_COLUMNS = ["workflow_id", "from_device_id", "to_device_id", "to_lane_id", "new_lane", "lane_size",
                "expected_slowdown", "rules"]
# human names for the store's columns (st.column_config labels: the data keeps its names)
LABELS = {
    "id": st.column_config.NumberColumn("Action"),
    "plan_id": st.column_config.NumberColumn("Plan"),
    "plan": st.column_config.NumberColumn("Plan"),
    "workflow_id": st.column_config.TextColumn("Workflow"),
    "policy": st.column_config.TextColumn("Policy"),
    "engine": st.column_config.TextColumn("Carried out by"),
    "from_device_id": st.column_config.NumberColumn("From device"),
    "to_device_id": st.column_config.NumberColumn("To device"),
    "lane": st.column_config.TextColumn("Lane"),
    "lane_size": st.column_config.NumberColumn("Lane size (GiB)", format="%.0f"),
    "expected_slowdown": st.column_config.NumberColumn("Expected slowdown", format="%.2f×"),
    "rules": st.column_config.ListColumn("Why (findings)"),
    "reason": st.column_config.TextColumn("Why"),
    "outcome": st.column_config.TextColumn("Outcome"),
    "state": st.column_config.TextColumn("State"),
    "attempts": st.column_config.NumberColumn("Commands sent"),
    "error": st.column_config.TextColumn("Error"),
    "time": st.column_config.DatetimeColumn("Time"),
    "applied": st.column_config.CheckboxColumn("Applied"),
    "ts": st.column_config.DatetimeColumn("Time"),
    "from_state": st.column_config.TextColumn("From"),
    "to_state": st.column_config.TextColumn("To"),
    "message": st.column_config.TextColumn("What happened"),
}


def _outcome(state: object, error: object) -> str:
    return f"{state}: {error}" if isinstance(error, str) and error else str(state)

ctx = device_page("Enforcement")

try:
    lane_rows = fresh(ctx, "lanes")
    plan_rows = fresh(ctx, "plans", limit=200)
    action_rows = fresh(ctx, "actions")
    cycles = fresh(ctx, "consolidation_cycles")
    hosts = host_table(ctx)
except FleetlensError as exc:
    report(exc)
    st.stop()

left_alone_notice(hosts)  # what the planner and consolidation plan around now

st.subheader("Lanes")
if lane_rows.empty:
    st.caption("No open lanes: every job has its devices to itself. Lanes appear when a plan packs jobs together.")
else:
    st.plotly_chart(charts.lanes(lane_rows))

st.subheader("Plans")
st.caption("The latest plan of each policy, as the enforcer recorded it: applied (with what became of each move) "
           "or proposed; applying a plan starts exactly the moves shown (checkpoint, stop, relaunch in the target "
           "lane).")
if st.button("Re-plan now", help="Operators only: record a fresh PACK and FAIR plan"):
    try:
        made = [actions.make_plan(ctx.store, ctx.principal, policy, settings=ctx.settings) for policy in POLICIES]
        st.session_state["fl_flash"] = "New plans recorded: " + ", ".join(
            f"{p.policy.upper()} (plan {p.plan_id}, {len(p.moves)} moves)" for p in made)
        st.rerun()
    except FleetlensError as exc:
        report(exc)
cols = st.columns(len(POLICIES))
for policy, col in zip(POLICIES, cols, strict=True):
    with col, st.container(border=True):
        st.markdown(f"##### {policy.upper()}")
        latest = plan_rows[plan_rows.policy == policy]
        if latest.empty:
            st.caption(f"No {policy.upper()} plan yet (the enforcer plans every cycle, in dry-run unless "
                       "enforcement is on).")
            continue
        plan = latest.iloc[0]
        applied = bool(plan.applied)
        moves = pd.DataFrame(plan.moves or [])
        slow = moves.expected_slowdown.dropna() if "expected_slowdown" in moves else pd.Series(dtype=float)
        m = st.columns(3)
        m[0].metric("Devices freed", int(plan.devices_freed))
        m[1].metric("Moves", len(moves))
        m[2].metric("Worst slowdown", f"{slow.max():.2f}×" if not slow.empty else "–")
        st.caption(f"plan {int(plan.id)} · {'applied' if applied else 'proposed'} {ago(plan.created_at)}")
        if not moves.empty:
            shown = moves.reindex(columns=MOVE_COLUMNS)
            shown["lane_size"] = shown.lane_size / 2**30
            shown["lane"] = moves.get("to_lane_id", pd.Series(dtype=object)).fillna(
                moves.get("new_lane", pd.Series(dtype=object)).map(lambda x: "new" if x else None))
            if applied:  # what became of each move: its action's state (and why it failed, if it did)
                done = action_rows[action_rows.plan_id == plan.id] if not action_rows.empty else action_rows
                outcome = {a.workflow_id: _outcome(a.state, a.error) for a in done.itertuples()}
                shown["outcome"] = shown.workflow_id.map(outcome).fillna("no action recorded")
            st.dataframe(shown.drop(columns=["to_lane_id", "new_lane"]).astype({"lane": str}), hide_index=True,
                         column_config=LABELS)
        if applied:
            continue
        confirm = st.checkbox(f"I understand applying plan {int(plan.id)} checkpoints and moves these jobs",
                              key=f"fl_confirm_{policy}")
        if st.button(f"Apply {policy.upper()} plan", type="primary", key=f"fl_apply_{policy}"):
            try:
                actions.apply_plan(ctx.store, ctx.principal, int(plan.id), settings=ctx.settings, confirmed=confirm)
                st.session_state["fl_flash"] = f"Plan {int(plan.id)} ({policy.upper()}) applied."
                st.rerun()
            except FleetlensError as exc:
                report(exc)

st.subheader("Consolidation")
if cycles.empty:
    st.caption("No consolidation cycle yet: the enforce cycle re-packs jobs by their observed demand every "
               "FLEETLENS_CONSOLIDATE_INTERVAL_S.")
else:
    st.plotly_chart(charts.consolidation(cycles), key="consolidation")
    moved = pd.DataFrame([{"time": pd.to_datetime(c.t, unit="s", utc=True), "plan": c.plan_id,
                           "applied": c.applied, **m} for c in cycles.itertuples() for m in c.moves],
                         columns=["time", "plan", "applied", "workflow_id", "from_device_id", "to_device_id",
                                  "reason"])
    if moved.empty:
        st.caption("No cycle has moved a job yet.")
    else:
        st.dataframe(moved.iloc[::-1], hide_index=True, column_config=LABELS)

st.subheader("Actions")
if action_rows.empty:
    st.caption("No enforcement action yet.")
else:
    st.dataframe(
        action_rows[["id", "plan_id", "workflow_id", "policy", "engine", "from_device_id", "to_device_id", "state",
                     "expected_slowdown", "attempts", "error"]],
        hide_index=True, column_config=LABELS,
    )
    picked = st.selectbox("Migration", list(action_rows.id), key="fl_action",
                          format_func=lambda i: f"action {i} · "
                          f"{action_rows.set_index('id').workflow_id[i]} · {action_rows.set_index('id').state[i]}")
    events = fresh(ctx, "action_events", int(picked))
    if events.empty:
        st.caption("No state change recorded for this action yet.")
    else:
        st.plotly_chart(charts.action_timeline(events), key=f"timeline-{picked}")
        st.dataframe(events[["ts", "from_state", "to_state", "message"]].assign(
            ts=pd.to_datetime(events.ts, unit="s", utc=True)), hide_index=True, column_config=LABELS)
