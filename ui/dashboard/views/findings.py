"""Findings page: every finding in the fleet, filtered by rule, severity, team and status; acknowledge and resolve."""

from __future__ import annotations

import streamlit as st

from store.errors import FleetlensError
from ui.dashboard.common import context, fresh, report
from ui.dashboard.findings_view import finding_cards

ctx = context()
st.title("Findings")

try:
    facets = fresh(ctx, "finding_facets")
except FleetlensError as exc:
    report(exc)
    st.stop()
if not facets["rules"]:
    st.info("No findings yet. The analyzer writes them from telemetry (`fleetlens detect`) and from traces "
            "(press **Profile now** on a workflow, or `fleetlens analyze TRACE`).", icon=":material/search:")
    st.stop()

f1, f2, f3, f4 = st.columns(4)
rules = f1.multiselect("Rule", facets["rules"], key="fl_f_rule")
severities = f2.multiselect("Severity", facets["severities"], key="fl_f_sev")
teams = f3.multiselect("Team", facets["teams"], key="fl_f_team")
statuses = f4.multiselect("Status", ["open", "acknowledged", "resolved"], default=["open", "acknowledged"],
                          key="fl_f_status")

df, waste = fresh(ctx, "findings_with_waste", rules=tuple(rules), severities=tuple(severities), teams=tuple(teams),
                  statuses=tuple(statuses))
m = st.columns(3)
m[0].metric("Findings shown", len(df))
m[1].metric("High severity", int((df.severity == "high").sum()) if not df.empty else 0)
# the one waste function: overlapping findings counted once, never more than the GPU-hours held
m[2].metric("GPU-hours per day recoverable", f"{waste.recoverable_gpu_hours_per_day:,.1f}",
            help=f"of {waste.held_gpu_hours_per_day:,.1f} GPU-hours held per day by these workflows; "
                 "overlapping findings on one device are counted once")
for line in [*waste.assumptions[1:], *waste.problems]:
    st.caption(line)
if df.empty:
    st.caption("No finding matches these filters.")
else:
    st.dataframe(
        df[["id", "severity", "rule", "workflow_id", "team", "status", "gpu_hours_per_day", "basis", "title"]],
        hide_index=True,
        column_config={"gpu_hours_per_day": st.column_config.NumberColumn("GPU-h/day", format="%.1f")},
    )
    finding_cards(ctx, df, key="all")
