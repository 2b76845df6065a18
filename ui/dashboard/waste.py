"""The Fleet page's waste ranking: shows what analyzer.ranking computes."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analyzer.ranking import rank_workflows, teams_of
from store.errors import FleetlensError
from ui.dashboard import charts
from ui.dashboard.common import Context, report, store_for


def show(ctx: Context) -> None:
    try:
        teams, workflows = _ranked(ctx.url, ctx.window.start, ctx.window.end)
    except FleetlensError as exc:
        report(exc)
        return
    teams = teams[teams.recoverable_gpu_hours_per_day > 0]
    if workflows.empty or not (workflows.recoverable_gpu_hours_per_day > 0).any():
        st.caption("No recoverable GPU-hours ranked in this window.")
        return
    left, right = st.columns(2)
    value = "recoverable_gpu_hours_per_day"
    with left:
        st.plotly_chart(charts.ranking_bar(teams, "team", value, "By team (GPU-hours per day)"), key="rank-teams")
    with right:
        st.plotly_chart(charts.ranking_bar(workflows, "workflow_id", value, "By workflow (GPU-hours per day)"),
                        key="rank-workflows")
    st.dataframe(
        workflows.fillna({"top_rule": "—"})[
            ["workflow_id", "team", "open_findings", "top_rule", value, "gpu_hours_held", "waste_gpu_hours",
             "trend_gpu_hours"]],
        hide_index=True,
        column_config={
            value: st.column_config.NumberColumn("recoverable GPU-h/day", format="%.1f"),
            "gpu_hours_held": st.column_config.NumberColumn("held GPU-h", format="%.1f"),
            "waste_gpu_hours": st.column_config.NumberColumn("wasted GPU-h", format="%.1f"),
            "trend_gpu_hours": st.column_config.NumberColumn("trend GPU-h", format="%+.1f"),
        },
    )


@st.cache_data(ttl=60, show_spinner=False)
def _ranked(url: str, start: float, end: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """analyzer.ranking over the window: (teams, workflows), keyed on the store and the time window."""
    workflows = rank_workflows(store_for(url), now=end, period_s=end - start)
    return teams_of(workflows), workflows
