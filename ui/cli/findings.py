"""`fleetlens findings`, `detect`, `rollup` and `rank`: telemetry findings, hourly rollups and the fleet ranking."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import typer
from rich.table import Table

from analyzer.period_rows import PER_DAY
from analyzer.ranking import costed, findings_frame, rank_with_waste, teams_of
from analyzer.rollups import apply_retention, rollup
from analyzer.serving.rules import detect_serving
from analyzer.telemetry import detect as detect_findings
from analyzer.telemetry import load_thresholds
from analyzer.waste import held_from_rollups, waste
from store.errors import InvalidInput
from ui.cli.app import app, check_filters, console, finite, not_future, open_store, settings

SEVERITY_STYLE = {"high": "bold red", "medium": "yellow", "low": "dim"}


def _echo_json(payload) -> None:
    typer.echo(json.dumps(payload, indent=2, default=str))


def _records(frame: pd.DataFrame) -> list[dict]:
    return json.loads(frame.to_json(orient="records"))


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None or pd.isna(x) else f"{x:,.{digits}f}"


def _trend(x) -> str:
    if x is None or pd.isna(x) or abs(x) < 0.05:
        return "="
    return f"[red]+{x:,.1f}[/red]" if x > 0 else f"[green]{x:,.1f}[/green]"


def _why(evidence) -> str:
    """': reason' of a finding the analyzer resolved (its evidence's `resolution`), else ''."""
    reason = evidence.get("resolution", {}).get("reason") if isinstance(evidence, dict) else None
    return f": {reason}" if reason else ""


@app.command()
def findings(
    workflow: str | None = typer.Option(None, "--workflow", "-w", help="Only this workflow."),
    rule: str | None = typer.Option(None, "--rule", "-r", help="Only this rule, e.g. idle_holder."),
    team: str | None = typer.Option(None, "--team", "-t", help="Only workflows of this team."),
    include_resolved: bool = typer.Option(False, "--all", help="Include resolved findings."),
    limit: int = typer.Option(50, "--limit", "-n", min=1, help="At most this many rows in the table."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (every matching finding) instead of a table."),
) -> None:
    """List findings (trace and telemetry), the costliest first; costs and the total from the one waste function."""
    store = open_store()
    check_filters(store, workflow=workflow, team=team, rule=rule)
    frame = findings_frame(store, workflow_id=workflow, rule=rule, team=team, include_resolved=include_resolved)
    # the GPU-hours held are those of the workflows listed (of the team, or the one workflow), as `rank` counts them
    w = waste(frame, held_from_rollups(store, team=team, workflow=workflow))
    frame = costed(frame, w)
    if as_json:
        _echo_json(_records(frame))
        return
    if frame.empty:
        console.print("no findings match" if (workflow or rule or team) else
                      "no findings yet: run `fleetlens detect` (telemetry) or `fleetlens analyze` (traces)")
        return
    table = Table(title=f"findings ({len(frame)}): {w.recoverable_gpu_hours_per_day:,.1f} of "
                        f"{w.held_gpu_hours_per_day:,.1f} GPU-hours held per day recoverable (overlaps counted once)")
    table.add_column("id", justify="right")
    table.add_column("finding", ratio=3)
    table.add_column("GPU-h/day", justify="right", no_wrap=True)
    table.add_column("fix", ratio=2)
    for r in frame.head(limit).itertuples():
        status = "" if r.status == "open" else f" ({r.status}{_why(r.evidence) if r.status == 'resolved' else ''})"
        head = (f"[{SEVERITY_STYLE.get(r.severity, '')}]{r.severity}[/] [bold]{r.rule}[/bold]{status} "
                f"{r.workflow_id}" + (f" [dim]({r.team})[/dim]" if r.team else ""))
        cost = _fmt(r.gpu_hours_per_day, 2) + ("" if r.basis in ("rollups", "none") else f"\n[dim]{r.basis}[/dim]")
        table.add_row(str(r.id), f"{head}\n{r.title}\n[dim]{r.location or ''}[/dim]", cost, r.fix)
    console.print(table)
    for line in [*w.assumptions, *w.problems]:
        console.print(f"[dim]{line}[/dim]")
    if len(frame) > limit:
        console.print(f"[dim]{len(frame) - limit} more; use --limit or --json[/dim]")


@app.command()
def detect(
    window_hours: float | None = typer.Option(None, "--window-hours", help="Look back this many hours "
                                              "(default: the thresholds file's window)."),
    now: float | None = typer.Option(None, "--now", help="End of the window, epoch seconds (default: now)."),
    thresholds: Path | None = typer.Option(None, "--thresholds", help="Another thresholds TOML file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Run the telemetry detectors over the store's samples, and the serving rules over serving workflows'
    requests; record their findings."""
    now, window_hours = not_future("--now", now), finite("--window-hours", window_hours)
    if window_hours is not None and window_hours <= 0:
        raise InvalidInput(f"--window-hours must be positive, got {window_hours}")
    th = load_thresholds(thresholds)
    found = detect_findings(open_store(), now=now, window_s=None if window_hours is None else window_hours * 3600,
                            thresholds=th, silent_limit_s=settings().silent_device_limit_s)
    store = open_store()
    serving = detect_serving(store, now=now)  # serving workflows: judged by latency (analyzer/serving)
    frame = findings_frame(store)
    serving_keys = {(f.rule, f.workflow_id) for f in serving}
    frame = frame[frame["id"].isin([f.id for f in found])
                  | pd.Series(list(zip(frame["rule"], frame["workflow_id"], strict=True)), index=frame.index,
                              dtype=object).isin(serving_keys)]
    found = [*found, *serving]
    held = held_from_rollups(store, now)
    summary = {
        rule: {"findings": len(fs), "workflows": int(fs["workflow_id"].nunique()),
               "gpu_hours_per_day": round(waste(fs, held).recoverable_gpu_hours_per_day, 3)}
        for rule, fs in sorted(frame.groupby("rule"), key=lambda kv: kv[0])
    }
    total = waste(frame, held)
    if as_json:
        _echo_json({"findings": len(found), "workflows": len({f.workflow_id for f in found}), "rules": summary,
                    "recoverable_gpu_hours_per_day": round(total.recoverable_gpu_hours_per_day, 3),
                    "held_gpu_hours_per_day": round(total.held_gpu_hours_per_day, 3), "problems": total.problems})
        return
    table = Table(title=f"telemetry findings: {len(found)} in {len({f.workflow_id for f in found})} workflows")
    table.add_column("rule")
    table.add_column("findings", justify="right")
    table.add_column("workflows", justify="right")
    table.add_column("GPU-h/day", justify="right")
    for rule, s in summary.items():
        table.add_row(rule, str(s["findings"]), str(s["workflows"]), _fmt(s["gpu_hours_per_day"]))
    table.add_row("all (overlaps once)", str(len(found)), str(len({f.workflow_id for f in found})),
                  _fmt(total.recoverable_gpu_hours_per_day))
    console.print(table)
    console.print("[dim]`fleetlens findings` lists them; `fleetlens rank` ranks workflows and teams[/dim]")


@app.command("rollup")
def rollup_cmd(
    since: float | None = typer.Option(None, "--since", help="Roll up from this epoch second (default: the hour "
                                       "after the last rolled-up one; earlier hours of the retention's days that "
                                       "samples reached since they were rolled up are rolled up again)."),
    now: float | None = typer.Option(None, "--now", help="Roll up hours closed by then (default: now)."),
    retention_days: float | None = typer.Option(None, "--retention-days", help="Delete raw samples older "
                                                "than this once rolled up (default: FLEETLENS_RETENTION_DAYS)."),
    keep_raw: bool = typer.Option(False, "--keep-raw", help="Do not apply the retention."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Roll raw samples up into hourly rows per workflow and device, then drop raw samples past the retention."""
    since, now = finite("--since", since), not_future("--now", now)
    days = settings().retention_days if retention_days is None else finite("--retention-days", retention_days)
    if not keep_raw and not 0 < days < math.inf:
        raise InvalidInput(f"retention_days must be a positive, finite number of days, got {days}")
    store = open_store()
    # late samples are looked for over the retention's days (the store's own with --keep-raw)
    result = rollup(store, now=now, since=since, recheck_days=settings().retention_days if keep_raw else days)
    out = {"hours": result.hours, "device_rows": result.device_rows, "workflow_rows": result.workflow_rows,
           "first_hour": result.first_hour, "last_hour": result.last_hour,
           "rerolled_hours": list(result.rerolled_hours)}
    if not keep_raw:
        kept = apply_retention(store, days, now=now)
        out.update(retention_days=days, cutoff=kept.cutoff, device_samples_deleted=kept.device_samples_deleted,
                   process_samples_deleted=kept.process_samples_deleted, hours_kept_not_rolled_up=kept.hours_kept,
                   late_samples_deleted=kept.late_samples_deleted,
                   detector_hours_deleted=kept.summaries_deleted,
                   serving_requests_deleted=kept.serving_requests_deleted)
    if as_json:
        _echo_json(out)
        return
    table = Table(title="rollup", show_header=False)
    for key, value in out.items():
        table.add_row(key.replace("_", " "), str(value))
    console.print(table)


@app.command()
def rank(
    teams: bool = typer.Option(False, "--teams", help="Rank teams instead of workflows."),
    team: str | None = typer.Option(None, "--team", "-t", help="Only workflows of this team."),
    period_hours: float = typer.Option(24.0, "--period-hours", min=1.0, help="Period of the trend, in hours."),
    now: float | None = typer.Option(None, "--now", help="End of the period, epoch seconds (default: now)."),
    limit: int = typer.Option(20, "--limit", "-n", min=1, help="At most this many rows."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Rank workflows (or teams) by recoverable GPU-hours per day, with the trend of their wasted GPU-hours."""
    now, period_hours = not_future("--now", now), finite("--period-hours", period_hours)
    store = open_store()
    check_filters(store, team=team)
    period_s = period_hours * 3600
    ranked, w = rank_with_waste(store, now, period_s, team=None if teams else team)
    frame = (teams_of(ranked) if teams else ranked).head(limit)
    if as_json:
        _echo_json({"recoverable_gpu_hours_per_day": round(w.recoverable_gpu_hours_per_day, 3),
                    "held_gpu_hours_per_day": round(w.held_gpu_hours_per_day, 3),
                    "per_day": f"{PER_DAY}, the last {period_hours:g} h",
                    "teams" if teams else "workflows": _records(frame),
                    "problems": w.problems, "assumptions": w.assumptions})
        return
    if frame.empty:
        console.print("nothing to rank yet: no samples in the period and no open findings (import or run agents, "
                      "then `fleetlens detect`)")
        return
    first = "team" if teams else "workflow"
    table = Table(title=f"{first}s by recoverable GPU-hours per day ({PER_DAY}, the last {period_hours:g} h): "
                        f"{_fmt(w.recoverable_gpu_hours_per_day)} of {_fmt(w.held_gpu_hours_per_day)} held; "
                        f"GPU-hours of the last {period_hours:g} h, trend of the wasted ones vs the period before")
    table.add_column(first, overflow="fold")
    table.add_column("wfs" if teams else "team", justify="right" if teams else "left")
    for col in ("GPU-h/d", "held", "active", "waste", "trend"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in frame.itertuples():
        table.add_row(
            str(r.team if teams else r.workflow_id), str(r.workflows) if teams else (r.team or "-"),
            _fmt(r.recoverable_gpu_hours_per_day), _fmt(r.gpu_hours_held), _fmt(r.gpu_hours_active),
            _fmt(r.waste_gpu_hours), _trend(r.trend_gpu_hours),
        )
    console.print(table)
