"""`fleetlens simulate`: replay a trace under several policies and compare them (table + HTML report)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from enforcer.sim.report import COLUMNS, write_html
from enforcer.sim.runner import DEFAULT_POLICIES, KINDS, parse_nodes, read_trace, simulate
from store.errors import InvalidInput
from ui.cli.app import app, console


@app.command("simulate")
def simulate_cmd(
    trace: str = typer.Option(..., "--trace", help=f"KIND:PATH, KIND one of {', '.join(KINDS)} (store:DB_URL)"),
    policy: list[str] = typer.Option(None, "--policy", help="policy to run (repeat); default all"),
    nodes: str = typer.Option(None, "--nodes", help="cluster N[xD[xGIB]] instead of the trace's own"),
    html: Path = typer.Option(None, "--html", help="write an HTML report with plotly figures here"),
    migration_cost: float = typer.Option(30.0, "--migration-cost", help="seconds a preempted job loses"),
    one_lane: bool = typer.Option(False, "--one-lane", help="each device is one lane (Salus single-GPU runs)"),
    jobs: int = typer.Option(100, "--jobs", help="salus: jobs in the workload"),
    seed: int = typer.Option(0, "--seed", help="salus: random seed of the workload"),
    load: float = typer.Option(1.0, "--load", help="salus: offered load on one device"),
) -> None:
    """Replay a job trace on a cluster under each policy; print the metrics side by side."""
    kind, sep, path = trace.partition(":")
    if not sep and kind.strip().lower() != "store":
        raise InvalidInput(f"--trace {trace!r}: expected KIND:PATH with KIND one of {', '.join(KINDS)}")
    options = {"n_jobs": jobs, "seed": seed, "load": load} if kind.strip().lower() == "salus" else {}
    tr = read_trace(kind, path or None, **options)
    cluster = parse_nodes(nodes) if nodes else None
    results = simulate(tr, policy or list(DEFAULT_POLICIES), cluster=cluster, migration_cost_s=migration_cost,
                       one_lane=one_lane)
    table = Table(title=f"{tr.kind}: {len(tr.jobs)} jobs ({tr.report.rows} rows read, skipped "
                        f"{dict(tr.report.skipped) or 'none'})")
    # one column per policy, so several policies sit side by side in a terminal of any width
    table.add_column("metric")
    for r in results:
        table.add_column(r.policy, justify="right")
    for key, label, fmt in COLUMNS:
        table.add_row(label, *(fmt.format(r.metrics.get(key, 0) or 0) for r in results))
    console.print(table)
    if html:
        write_html(html, tr, results)
        console.print(f"report written to {html}")
