"""`fleetlens demo`: the whole loop on this machine, from a replayed real fleet to a job moved and resumed."""

from __future__ import annotations

from pathlib import Path

import typer

from ui.cli.app import app, console, settings
from ui.serve.demo import Demo, DemoOptions
from ui.serve.processes import Stopped, stop_on_signals


@app.command()
def demo(
    duration: float = typer.Option(None, help="Stop after this many seconds (default: Ctrl-C; 120 with --no-ui)."),
    no_ui: bool = typer.Option(False, "--no-ui", help="Do not start the dashboard."),
    speedup: float = typer.Option(
        120.0, help="Demo time for the local jobs: detector durations shrink this much (30 min idle: 15 s)."
    ),
    steps: int = typer.Option(1_000_000, help="Declared steps of each demo job (they train until the demo ends)."),
    port: int = typer.Option(None, help="Dashboard port (default FLEETLENS_UI_PORT, 8501)."),
    home: Path = typer.Option(None, help="The demo's own folder (default FLEETLENS_HOME/demo); wiped at start."),
) -> None:
    """Replay a real fleet, run four PyTorch jobs here, profile, analyse, consolidate with PACK, show it all."""
    s = settings()
    if duration is None and no_ui:
        duration = 120.0
    options = DemoOptions(home=home or s.home / "demo", duration=duration, ui=not no_ui, speedup=speedup,
                          steps=steps, port=port or s.ui_port, console=console)
    with stop_on_signals() as signals:  # first: SIGINT stops the demo even if it was started ignoring it
        demo_run = Demo(options, signals)
        try:
            report = demo_run.run()
        except Stopped as stop:
            report = demo_run.report
            console.print(f"stopped by {stop}; " + (
                f"{len(report.survivors)} process(es) the demo started could not be stopped"
                if report.survivors else "nothing the demo started is still running"))
    if signals.exit_code is not None:  # also a signal that came while the demo stopped at its end
        raise typer.Exit(signals.exit_code)
    if report.steps_failed or report.survivors:
        raise typer.Exit(1)
