"""`fleetlens slurm-import`: read a Slurm cluster's jobs and nodes (squeue/sinfo JSON) into the store, once."""

from __future__ import annotations

import typer

from collector.importers.slurm import import_slurm
from ui.cli.app import app, console, open_store, settings


@app.command("slurm-import")
def slurm_import(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="List the jobs left out or read in part."),
) -> None:
    """Record Slurm's jobs as workflows `slurm-ID` (request, GPUs held, team, time limit, opt-in) and its nodes."""
    result = import_slurm(open_store(), settings())
    console.print(f"Slurm {result.version}: {result.nodes} node(s), {result.jobs} job(s), {result.opted_in} opted in "
                  f"to moves; {len(result.errors)} left out or read in part", highlight=False)
    for error in result.errors if verbose else result.errors[:5]:
        console.print(f"  {error}", highlight=False, markup=False)
