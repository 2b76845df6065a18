"""Findings as cards with evidence and fix, and the acknowledge / resolve controls (Workflow, Findings pages)."""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from store.errors import FleetlensError
from ui.dashboard import actions
from ui.dashboard.common import Context, ago, report

SEVERITY_BADGE = {"high": ":red-badge[high]", "medium": ":orange-badge[medium]", "low": ":blue-badge[low]"}


def finding_cards(ctx: Context, df: pd.DataFrame, key: str) -> None:
    if df.empty:
        st.caption("No findings.")
        return
    for row in df.itertuples():
        badge = SEVERITY_BADGE.get(row.severity, row.severity)
        head = (f"{badge} **{row.title}** · `{row.rule}` · {row.status} · "
                f"{row.gpu_hours_per_day:.1f} GPU-h/day"
                + (f" ({row.basis})" if getattr(row, "basis", "rollups") not in ("rollups", "none") else ""))
        with st.expander(head, expanded=False):
            st.markdown(f"**Workflow** `{row.workflow_id}` · team {row.team or '—'} · source {row.source} · "
                        f"updated {ago(row.updated_at)}" + (f" · by {row.acted_by}" if row.acted_by else ""))
            if row.location:
                st.caption(f"where: {row.location}")
            if pd.notna(row.cost_s_per_step):
                st.caption(f"cost: {row.cost_s_per_step * 1000:.1f} ms per step")
            st.markdown("**Fix.** " + (row.fix or "—"))
            evidence = row.evidence if isinstance(row.evidence, dict) else json.loads(row.evidence or "{}")
            if evidence:
                st.json(evidence, expanded=False)
            status_controls(ctx, int(row.id), row.status, key=f"{key}-{row.id}")


def status_controls(ctx: Context, finding_id: int, status: str, key: str) -> None:
    b1, b2, _ = st.columns([1, 1, 4])
    target = None
    if status == "open" and b1.button("Acknowledge", key=f"ack-{key}"):
        target = "acknowledged"
    if status != "resolved" and b2.button("Resolve", key=f"res-{key}"):
        target = "resolved"
    if status == "resolved" and b1.button("Reopen", key=f"reo-{key}"):
        target = "open"
    if target is None:
        return
    try:
        actions.set_finding_status(ctx.store, ctx.principal, finding_id, target)
    except FleetlensError as exc:
        report(exc)
        return
    st.session_state["fl_flash"] = f"Finding {finding_id} is now {target}."
    st.rerun()
