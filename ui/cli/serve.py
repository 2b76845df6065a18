"""`fleetlens serve`: one real host's agent, the embedded scheduler of the DAGs' periodic work, and the dashboard."""

from __future__ import annotations

import time

import typer

from store.db import Store
from store.migrations import upgrade
from ui.cli.app import app, console, settings
from ui.serve.processes import Children, fleetlens_command, sigterm_as_interrupt
from ui.serve.scheduler import Scheduler, periodic_jobs


@app.command()
def serve(
    no_ui: bool = typer.Option(False, "--no-ui", help="Do not start the dashboard."),
    no_agent: bool = typer.Option(False, "--no-agent", help="Do not start this host's agent (one runs already)."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="Do not start the fleet's /metrics exporter."),
    duration: float = typer.Option(None, help="Stop after this many seconds (default: until Ctrl-C)."),
) -> None:
    """Run this host's agent, the periodic rollups/analysis/enforcement/profiling/Prometheus import, the fleet's
    /metrics exporter, and the dashboard until Ctrl-C.

    The scheduler calls the same functions as the Airflow DAGs, on the same cadences; enforcement stays a dry
    run unless FLEETLENS_ENFORCE=true. Jobs the agent launched keep running when serve stops.
    """
    s = settings()
    s.ensure_home()
    store = Store.from_settings(s)
    upgrade(store)
    children = Children(s.home)
    scheduler = Scheduler(periodic_jobs(store, s))
    with sigterm_as_interrupt():
        try:
            if not no_agent:
                children.spawn(fleetlens_command("agent"), "agent.log")
                console.print(f"agent for host {s.host_id} (log {s.home / 'agent.log'})")
            if not no_metrics:
                children.spawn(fleetlens_command("metrics-serve"), "metrics.log")
                console.print(f"fleet metrics at http://127.0.0.1:{s.metrics_serve_port}/metrics "
                              f"(log {s.home / 'metrics.log'})")
            if not no_ui:
                children.spawn(fleetlens_command("ui"), "dashboard.log")
                console.print(f"dashboard at http://127.0.0.1:{s.ui_port} (log {s.home / 'dashboard.log'})")
            scheduler.start()
            console.print(f"scheduler: {', '.join(j.name for j in scheduler.jobs)}; "
                          f"enforcement {'ON' if s.enforce else 'dry run'}; Ctrl-C stops")
            deadline = None if duration is None else time.monotonic() + duration
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic())))
        except KeyboardInterrupt:
            console.print("stopping")
        finally:
            scheduler.stop()
            children.stop()
