"""Fleet ranking: workflows and teams by recoverable GPU-hours, with the trend of their waste; plain DataFrames.

- recoverable_gpu_hours_per_day: from the open (not resolved) findings, by the one waste function
  (analyzer.waste): overlapping findings counted once, never more than the GPU-hours the workflow held;
  held_gpu_hours_per_day and basis (rollups | detector window | projected) say what bounds it.
- held / active / waste (= held - active) GPU-hours: from the hourly workflow rollups of this period
  [now - period_s, now) and of the previous one; trend = waste now - waste before (negative: better).

The dashboard calls these functions; they return DataFrames with the columns listed in their docs.
"""

from __future__ import annotations

import time

import pandas as pd
from sqlalchemy import select

from analyzer.period_rows import period_rows
from analyzer.waste import Waste, held_from_rollups, waste
from store.db import Store
from store.models import Finding, Workflow

NO_TEAM = "(no team)"
WORKFLOW_COLUMNS = [
    "workflow_id", "team", "open_findings", "top_rule", "recoverable_gpu_hours_per_day",
    "held_gpu_hours_per_day", "basis", "gpu_hours_held", "gpu_hours_active", "waste_gpu_hours",
    "waste_gpu_hours_prev", "trend_gpu_hours",
    "trend_pct", "util_mean",
]
TEAM_COLUMNS = [
    "team", "workflows", "open_findings", "recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "gpu_hours_held",
    "gpu_hours_active",
    "waste_gpu_hours", "waste_gpu_hours_prev", "trend_gpu_hours", "trend_pct",
]
FINDING_COLUMNS = [
    "id", "rule", "source", "severity", "status", "workflow_id", "team", "device_id", "gpu_hours_per_day",
    "title", "location", "fix", "evidence", "updated_at", "fingerprint",
]


def _read(store: Store, query) -> pd.DataFrame:
    with store.engine.connect() as conn:
        return pd.read_sql_query(query, conn)


def findings_frame(
    store: Store,
    *,
    workflow_id: str | None = None,
    rule: str | None = None,
    team: str | None = None,
    include_resolved: bool = False,
) -> pd.DataFrame:
    """Findings (open and acknowledged unless include_resolved) with their workflow's team, largest cost first.

    Columns: FINDING_COLUMNS.
    """
    query = select(
        Finding.id, Finding.rule, Finding.source, Finding.severity, Finding.status, Finding.workflow_id,
        Workflow.team, Finding.device_id, Finding.gpu_hours_per_day, Finding.title, Finding.location, Finding.fix,
        Finding.evidence, Finding.updated_at, Finding.fingerprint,
    ).join(Workflow, Workflow.id == Finding.workflow_id, isouter=True)
    if not include_resolved:
        query = query.where(Finding.status != "resolved")
    if workflow_id is not None:
        query = query.where(Finding.workflow_id == workflow_id)
    if rule is not None:
        query = query.where(Finding.rule == rule)
    if team is not None:
        query = query.where(Workflow.team == team)
    with store.session() as session:
        rows = session.execute(query.order_by(Finding.gpu_hours_per_day.desc(), Finding.id)).all()
    return pd.DataFrame([tuple(r) for r in rows], columns=FINDING_COLUMNS)


def costed(findings: pd.DataFrame, w: Waste) -> pd.DataFrame:
    """The findings with gpu_hours_per_day replaced by the waste function's cost of each (basis and note added)."""
    if findings.empty:
        return findings.assign(basis=pd.Series(dtype=object), counted=pd.Series(dtype=bool),
                               note=pd.Series(dtype=object))
    cost = w.findings.set_index(findings.index)
    out = findings.assign(gpu_hours_per_day=cost["gpu_hours_per_day"].astype("float64"), basis=cost["basis"],
                          counted=cost["counted"], note=cost["note"])
    return out.sort_values(["gpu_hours_per_day", "id"], ascending=[False, True])


def recoverable_by_workflow(findings: pd.DataFrame, w: Waste) -> pd.DataFrame:
    """Per workflow: open_findings, top_rule, recoverable_gpu_hours_per_day, held_gpu_hours_per_day, basis."""
    cols = ["open_findings", "top_rule", "recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "basis"]
    per_wf = w.workflows.set_index("workflow_id")
    if findings.empty:
        return per_wf.reindex(columns=cols).rename_axis("workflow_id")
    f = costed(findings, w)
    top = f.drop_duplicates("workflow_id").set_index("workflow_id")
    out = pd.DataFrame({"open_findings": f.groupby("workflow_id").size(), "top_rule": top["rule"]})
    out = out.reindex(out.index.union(per_wf.index))
    out = out.join(per_wf[["recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "basis"]])
    return out.rename_axis("workflow_id")[cols]


def _rollup_sums(store: Store, start: float, end: float, rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per workflow: held and active GPU-hours and mean utilisation of [start, end), from its rollups or, for hours
    not rolled up yet, the rollup of its raw samples (analyzer.period_rows, or `rows` read from it already), so
    `rank` says the same either way."""
    rows = period_rows(store, start, end) if rows is None else rows
    frame = rows[rows["scope"] == "workflow"].rename(columns={"subject": "workflow_id"})[
        ["workflow_id", "team", "gpu_hours_held", "gpu_hours_active", "util_mean", "samples"]]
    frame = frame.astype({"gpu_hours_held": "float64", "gpu_hours_active": "float64", "util_mean": "float64"})
    if frame.empty:
        return pd.DataFrame(columns=["gpu_hours_held", "gpu_hours_active", "util_mean"],
                            index=pd.Index([], name="workflow_id"))
    # utilisation averaged over the hours, weighted by how much of each hour was held
    frame["util_w"] = frame["util_mean"].fillna(0.0) * frame["gpu_hours_held"]
    sums = frame.groupby("workflow_id")[["gpu_hours_held", "gpu_hours_active", "util_w"]].sum()
    sums["util_mean"] = (sums["util_w"] / sums["gpu_hours_held"]).where(sums["gpu_hours_held"] > 0)
    return sums.drop(columns="util_w")


def _trend_pct(now: pd.Series, before: pd.Series) -> pd.Series:
    return ((now - before) / before * 100.0).where(before > 0)


def rank_workflows(
    store: Store,
    now: float | None = None,
    period_s: float = 86400.0,
    *,
    team: str | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """Workflows ranked by recoverable GPU-hours per day, then by wasted GPU-hours this period.

    Columns: WORKFLOW_COLUMNS (one row per workflow with an open finding or a rollup in either period).
    """
    return rank_with_waste(store, now, period_s, team=team, limit=limit)[0]


def rank_with_waste(
    store: Store,
    now: float | None = None,
    period_s: float = 86400.0,
    *,
    team: str | None = None,
    limit: int | None = None,
) -> tuple[pd.DataFrame, Waste]:
    """rank_workflows, and the waste function's result its figures come from (fleet totals, problems)."""
    now = time.time() if now is None else float(now)
    findings = findings_frame(store, team=team)
    rows = period_rows(store, now - period_s, now)  # read once for the waste function's held hours and the sums
    w = waste(findings, held_from_rollups(store, now, period_s, team=team, rows=rows))
    rec = recoverable_by_workflow(findings, w)
    cur = _rollup_sums(store, now - period_s, now, rows)
    prev = _rollup_sums(store, now - 2 * period_s, now - period_s)
    ids = rec.index.union(cur.index).union(prev.index)
    teams = _read(store, select(Workflow.id.label("workflow_id"), Workflow.team)).set_index("workflow_id")["team"]
    out = pd.DataFrame(index=pd.Index(ids, name="workflow_id"))
    out["team"] = teams.reindex(out.index)
    if team is not None:
        out = out[out["team"] == team]
    out = out.join(rec).join(cur).join(prev[["gpu_hours_held", "gpu_hours_active"]], rsuffix="_prev")
    out["open_findings"] = pd.to_numeric(out["open_findings"]).fillna(0).astype("int64")
    for col in ("recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "gpu_hours_held", "gpu_hours_active",
                "gpu_hours_held_prev", "gpu_hours_active_prev"):
        out[col] = out[col].astype("float64").fillna(0.0)
    out["waste_gpu_hours"] = (out["gpu_hours_held"] - out["gpu_hours_active"]).clip(lower=0.0)
    out["waste_gpu_hours_prev"] = (out["gpu_hours_held_prev"] - out["gpu_hours_active_prev"]).clip(lower=0.0)
    out["trend_gpu_hours"] = out["waste_gpu_hours"] - out["waste_gpu_hours_prev"]
    out["trend_pct"] = _trend_pct(out["waste_gpu_hours"], out["waste_gpu_hours_prev"])
    out = out.reset_index().sort_values(
        ["recoverable_gpu_hours_per_day", "waste_gpu_hours", "workflow_id"], ascending=[False, False, True]
    )
    out["basis"] = out["basis"].fillna("none")
    out = out[WORKFLOW_COLUMNS].reset_index(drop=True)
    return (out.head(limit) if limit is not None else out), w


def rank_teams(store: Store, now: float | None = None, period_s: float = 86400.0) -> pd.DataFrame:
    """Teams ranked by recoverable GPU-hours per day (sum of their workflows'). Columns: TEAM_COLUMNS."""
    return teams_of(rank_workflows(store, now, period_s))


def teams_of(workflows: pd.DataFrame) -> pd.DataFrame:
    """rank_teams from a rank_workflows frame already at hand (of the whole fleet); the frame is not changed."""
    if workflows.empty:
        return pd.DataFrame(columns=TEAM_COLUMNS)
    wf = workflows.assign(team=workflows["team"].fillna(NO_TEAM))
    g = wf.groupby("team")
    out = g[["open_findings", "recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "gpu_hours_held",
             "gpu_hours_active", "waste_gpu_hours", "waste_gpu_hours_prev", "trend_gpu_hours"]].sum()
    out["workflows"] = g.size()
    out["trend_pct"] = _trend_pct(out["waste_gpu_hours"], out["waste_gpu_hours_prev"])
    out = out.reset_index().sort_values(["recoverable_gpu_hours_per_day", "waste_gpu_hours", "team"],
                                        ascending=[False, False, True])
    return out[TEAM_COLUMNS].reset_index(drop=True)
