"""`fleetlens export` and `fleetlens load-replay`: write a time range of telemetry to a file, load a recording back."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import typer

from collector.recordings.export_writer import write_export
from collector.recordings.load import load_into_store
from store.errors import InvalidInput
from ui.cli.app import app, console, open_store, settings

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str | None, *, now: float | None = None) -> float | None:
    """Epoch seconds, or a duration before now ("90m", "6h", "2d")."""
    if text is None:
        return None
    now = time.time() if now is None else now
    match = _DURATION.match(text)
    if match:
        return now - float(match.group(1)) * _UNIT[match.group(2)]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # float() takes "nan" and "inf", which no time is
        raise InvalidInput(f"time {text!r} is neither epoch seconds nor a duration like 30m, 6h, 2d")
    return value


@app.command()
def export(
    path: Path = typer.Argument(..., help="Output file: .jsonl.gz (default format) or .csv.gz; plain if no .gz."),
    since: str | None = typer.Option(None, "--since", help="Start: epoch seconds or a duration ago (6h, 2d)."),
    until: str | None = typer.Option(None, "--until", help="End: epoch seconds or a duration ago."),
    host: list[str] = typer.Option([], "--host", help="Only this host (repeatable); default every host."),
) -> None:
    """Export hosts, devices, workflows, processes and samples of a time range; `load-replay` reads it back."""
    now = time.time()
    summary = write_export(open_store(), path, start=parse_time(since, now=now), end=parse_time(until, now=now),
                           hosts=host or None)
    console.print(
        f"wrote {summary.path} ({summary.format}): {summary.hosts} hosts, {summary.devices} devices, "
        f"{summary.workflows} workflows, {summary.device_samples} device samples, "
        f"{summary.process_samples} process samples"
    )


@app.command("load-replay")
def load_replay(
    source: str = typer.Argument("alibaba", help="'alibaba', the Alibaba trace folder, or a `fleetlens export` file."),
    speedup: float = typer.Option(1.0, "--speedup", help="Compress the recording's time by this factor."),
    end_at: str | None = typer.Option(None, "--end-at", help="When the recording ends (default now)."),
    host_prefix: str = typer.Option("", "--host-prefix", help="Prefix for the recording's host ids."),
) -> None:
    """Load a whole recording into the store at once, shifted so it ends now (replacing an earlier load)."""
    summary = load_into_store(open_store(), source, speedup=speedup, end_at=parse_time(end_at),
                              host_prefix=host_prefix, fleet_data_dir=settings().fleet_data_dir)
    skipped = f"; skipped {summary.skipped_rows} malformed rows" if summary.skipped_rows else ""
    console.print(
        f"loaded {summary.kind}: {summary.hosts} hosts, {summary.devices} devices, {summary.workflows} workflows, "
        f"{summary.device_samples} device samples, {summary.process_samples} process samples "
        f"in {summary.seconds:.1f} s{skipped}"
    )
