"""`fleetlens import-prometheus` and `fleetlens metrics-serve`: read a fleet's dcgm-exporter telemetry from its
Prometheus, and publish fleetlens's findings and plans for Prometheus to scrape."""

from __future__ import annotations

import logging
import math
import re

import typer

from collector.importers.prometheus import import_prometheus
from store.errors import InvalidInput
from ui.cli.app import app, console, open_store, settings
from ui.cli.export import parse_time
from ui.serve.metrics import serve_fleet_metrics

_STEP = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_LISTEN = re.compile(r"^(?:\[([0-9A-Fa-f:.]+)\]|([^:\[\]]*)):(\d{1,5})$")
LISTEN_HELP = ("[HOST]:PORT to serve /metrics on, as dcgm-exporter's --address (its default :9400: every interface); "
               "e.g. 127.0.0.1:{port} for this host only")


def parse_listen_address(text: str) -> tuple[str, int]:
    """(host, port) of a listen address like :9400, 0.0.0.0:9400, 127.0.0.1:9108 or [::1]:9108 (host "": every
    interface)."""
    match = _LISTEN.match(text.strip())
    port = int(match.group(3)) if match else -1
    if not match or not 0 <= port <= 65535:
        raise InvalidInput(f"listen address {text!r} is not [HOST]:PORT, e.g. :9400 or 127.0.0.1:9400")
    return match.group(1) or match.group(2) or "", port


def parse_step(text: str) -> float:
    """A step like 60s, 5m, 1h or plain seconds."""
    match = _STEP.match(text)
    if not match or float(match.group(1)) <= 0:
        raise InvalidInput(f"step {text!r} is not a positive duration like 30s, 60s or 5m")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


@app.command("import-prometheus")
def import_prometheus_command(
    url: str = typer.Argument(..., help="The Prometheus server's base URL, e.g. http://prometheus:9090."),
    since: str = typer.Option(None, "--since", help="Start: epoch seconds or a duration ago (6h, 2d); "
                                                    "default: where the last import stopped."),
    until: str = typer.Option(None, "--until", help="End: epoch seconds or a duration ago (default: now)."),
    step: str = typer.Option(None, "--step", help="One sample per device per step (default 60s, "
                                                  "FLEETLENS_PROMETHEUS_STEP_S)."),
) -> None:
    """Import dcgm-exporter GPU telemetry from an existing Prometheus into the store (resumes; never duplicates)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    s = settings()
    summary = import_prometheus(open_store(), url, since=parse_time(since), until=parse_time(until),
                                step=parse_step(step) if step else s.prometheus_step_s, settings=s)
    console.print(f"imported {summary.describe()} in {summary.seconds:.1f} s", highlight=False)


@app.command("metrics-serve")
def metrics_serve(
    port: int = typer.Option(None, "--port", help="Port to serve /metrics on (FLEETLENS_METRICS_SERVE_PORT)."),
    listen_address: str = typer.Option(None, "--listen-address", help=LISTEN_HELP.format(port=9108) +
                                       " (FLEETLENS_METRICS_SERVE_HOST and _PORT; default :9108)"),
    duration: float = typer.Option(None, "--duration", help="Stop after this many seconds (default: until Ctrl-C)."),
) -> None:
    """Serve the fleet's recoverable GPUs, open findings and plans as Prometheus metrics until Ctrl-C."""
    s = settings()
    host, port = s.metrics_serve_host, s.metrics_serve_port if port is None else port
    if listen_address is not None:
        host, port = parse_listen_address(listen_address)
    if not 0 <= port <= 65535:
        raise InvalidInput(f"--port {port} is not a TCP port; use 0..65535")
    if duration is not None and not 0 < duration < math.inf:  # NaN or 0 would stop at once, having served nothing
        raise InvalidInput(f"--duration must be a positive number of seconds, not {duration}")
    console.print(f"fleet metrics at http://{host or '0.0.0.0'}:{port}/metrics")
    serve_fleet_metrics(open_store(), s, port=port, duration=duration, addr=host)
