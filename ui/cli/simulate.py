"""`fleetlens simulate`: replay a trace under several policies and compare them (table + HTML report)."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.table import Table

from enforcer.consolidation_sizing import ConsolidateParams
from enforcer.sim.readers.demand import DemandTrace, read_alibaba_demand, read_openb_demand
from enforcer.sim.readers.openb import DEVICE_MEM as OPENB_MEM
from enforcer.sim.readers.openb import NODE_FILE, read_openb_nodes
from enforcer.sim.replay import ReplayResult, replay
from enforcer.sim.report import COLUMNS, write_html
from enforcer.sim.runner import DEFAULT_POLICIES, KINDS, parse_nodes, read_trace, simulate
from store.errors import InvalidInput
from ui.cli.app import app, console, settings


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
    consolidate: bool = typer.Option(False, "--consolidate", help="alibaba/openb: replay demand over time with "
                                     "the consolidation cycle (no hindsight) instead of the policies"),
    device_gib: float = typer.Option(80.0, "--device-gib", help="--consolidate on alibaba: device memory (GiB)"),
) -> None:
    """Replay a job trace on a cluster under each policy; print the metrics side by side."""
    kind, sep, path = trace.partition(":")
    if not sep and kind.strip().lower() != "store":
        raise InvalidInput(f"--trace {trace!r}: expected KIND:PATH with KIND one of {', '.join(KINDS)}")
    if not path.strip() and kind.strip().lower() != "store":  # only the store has a default (the configured one)
        raise InvalidInput(f"--trace {trace!r}: give the {kind.strip()} file or folder after the colon, as KIND:PATH")
    if html is not None and (not html.parent.is_dir() or html.is_dir()):  # said before the simulation, not after
        raise InvalidInput(f"--html {html}: " + (f"the folder {html.parent} does not exist" if not html.parent.is_dir()
                                                 else "is a folder; give a file name"))
    if consolidate:
        _consolidate(kind.strip().lower(), Path(path), nodes, device_gib)
        return
    options = {"n_jobs": jobs, "seed": seed, "load": load} if kind.strip().lower() == "salus" else {}
    tr = read_trace(kind, path or None, settings=settings(), **options)
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
    for r in results:
        reasons = getattr(r.sim, "unplaceable_reasons", {})
        if reasons:
            _print_reasons(f"{r.policy}: {len(reasons)} jobs never ran", reasons)
    if html:
        write_html(html, tr, results)
        console.print(f"report written to {html}")


def _print_reasons(title: str, reasons: dict[str, str]) -> None:
    table = Table(title=title)
    table.add_column("job")
    table.add_column("why")
    for job, why in sorted(reasons.items()):
        table.add_row(job, why)
    console.print(table)


def _consolidate(kind: str, path: Path, nodes: str | None, device_gib: float) -> None:
    """The demand replay: one table of figures, then every job that was not placed (or was stopped) and why."""
    if not 0 < device_gib < math.inf:
        raise InvalidInput(f"--device-gib must be a positive number of GiB, not {device_gib}")
    if kind == "alibaba":
        tr: DemandTrace = read_alibaba_demand(path)
        devices = [(i, int(device_gib * 2**30)) for i in range(len(tr.jobs))]
    elif kind == "openb":
        tr = read_openb_demand(path, OPENB_MEM)
        node_list = path.with_name(NODE_FILE)
        cluster, _ = read_openb_nodes(node_list) if node_list.is_file() else (None, None)
        devices = [(i, OPENB_MEM) for i in range(sum(n.devices for n in cluster))] if cluster else []
    else:
        raise InvalidInput(f"--consolidate replays alibaba or openb traces, not {kind!r}")
    if nodes:
        devices = [(i, node.mem) for i, node in enumerate(n for n in parse_nodes(nodes) for _ in range(n.devices))]
    if not devices:
        raise InvalidInput(f"the {kind} trace does not say what devices it ran on; give --nodes N[xD[xGIB]]")
    s = settings()
    r: ReplayResult = replay(tr, devices, ConsolidateParams.from_settings(s), interval_s=s.consolidate_interval_s)
    table = Table(title=f"{tr.kind}: {len(tr.jobs)} jobs on {len(devices)} devices, consolidation every "
                        f"{s.consolidate_interval_s:.0f} s (read {tr.report.rows} rows, skipped "
                        f"{dict(tr.report.skipped) or 'none'})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in (("mean devices", f"{r.mean_devices:.1f}"), ("peak devices", str(r.peak_devices)),
                         ("device-hours", f"{r.device_hours:,.1f}"), ("moves", str(len(r.moves))),
                         ("moves per job-day", f"{r.moves_per_job_day:.2f}"),
                         ("overcommit device-minutes", f"{r.overcommit_device_minutes:.1f}"),
                         ("not placed or stopped", str(len(r.reasons)))):
        table.add_row(label, value)
    console.print(table)
    if r.reasons:
        _print_reasons(f"{len(r.reasons)} jobs not placed or stopped", r.reasons)
