"""`fleetlens serve`: one real host's agent, the embedded scheduler of the DAGs' periodic work, and the dashboard."""

from __future__ import annotations

import time

import typer

from analyzer.traces.claims import release_held
from store.db import Store
from store.migrations import upgrade
from ui.cli.app import app, console, settings
from ui.serve.processes import TERM_GRACE_S, Children, Stopped, describe, fleetlens_command, stop_on_signals
from ui.serve.scheduler import Scheduler, periodic_jobs
from ui.serve.supervision import Supervisor

SCHEDULER_STOP_S = 3.0  # a periodic job still running after this is left to its daemon thread (the budget is 15 s)


@app.command()
def serve(
    no_ui: bool = typer.Option(False, "--no-ui", help="Do not start the dashboard."),
    no_agent: bool = typer.Option(False, "--no-agent", help="Do not start this host's agent (one runs already)."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="Do not start the fleet's /metrics exporter."),
    duration: float = typer.Option(None, help="Stop after this many seconds (default: until Ctrl-C)."),
) -> None:
    """Run this host's agent, the periodic work, the /metrics exporter and the dashboard until Ctrl-C.

    The periodic work is the rollups, analysis, enforcement, profiling and Prometheus import. A child that exits is
    said and started again, after a back-off that doubles from 1 s to a minute while it keeps failing.

    The scheduler calls the same functions as the Airflow DAGs, on the same cadences; enforcement stays a dry
    run unless FLEETLENS_ENFORCE=true. SIGINT or SIGTERM stops the scheduler, the agent, the exporter and the
    dashboard (exit 130 or 143), and so does the terminal hanging up (SIGHUP, 129; not under nohup); jobs the agent
    launched keep running, and the next agent on this host takes them up.
    """
    s = settings()
    s.ensure_home()
    store = Store.from_settings(s)
    upgrade(store)
    children = Children(s.home)
    supervisor = Supervisor(children, lambda line: console.print(line, highlight=False, soft_wrap=True))
    scheduler = Scheduler(periodic_jobs(store, s))
    with stop_on_signals() as signals:  # SIGINT stops serve even if it was started ignoring it
        try:
            with signals.deferred():  # each child is recorded before a stop can come: the stop finds it
                if not no_agent:
                    supervisor.start("agent", fleetlens_command("agent"), "agent.log")
                    console.print(f"agent for host {s.host_id} (log {s.home / 'agent.log'})")
                if not no_metrics:
                    supervisor.start("metrics exporter", fleetlens_command("metrics-serve"), "metrics.log")
                    console.print(f"fleet metrics at http://127.0.0.1:{s.metrics_serve_port}/metrics "
                                  f"(log {s.home / 'metrics.log'})")
                if not no_ui:
                    supervisor.start("dashboard", fleetlens_command("ui"), "dashboard.log")
                    console.print(f"dashboard at http://127.0.0.1:{s.ui_port} (log {s.home / 'dashboard.log'})")
            scheduler.start()
            console.print(f"scheduler: {', '.join(j.name for j in scheduler.jobs)}; "
                          f"enforcement {'ON' if s.enforce else 'dry run'}; Ctrl-C stops")
            deadline = None if duration is None else time.monotonic() + duration
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic())))
                with signals.deferred():
                    supervisor.check()  # a child that exited is said and started again
        except Stopped as stop:
            console.print(f"stopping ({stop}); the jobs the agent launched go on")
        finally:
            with signals.shielded():
                children.terminate()  # first: the children's grace runs beside the scheduler's
                if not scheduler.stop(timeout=SCHEDULER_STOP_S):
                    release_held()  # a trace still analysed goes back as it was: this stop is no attempt of it
                survivors = children.stop(grace_s=TERM_GRACE_S - SCHEDULER_STOP_S)
    for proc in survivors:
        console.print(f"[red]still running after the stop:[/] {describe(proc)}")
    if signals.exit_code is not None:
        raise typer.Exit(signals.exit_code)
    if survivors:
        raise typer.Exit(1)
