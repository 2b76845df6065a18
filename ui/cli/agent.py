"""`fleetlens agent`: run this host's collector (sample, write, spool, run commands, serve the job SDK)."""

from __future__ import annotations

import logging
import math

import typer

from collector.agent import Agent
from collector.sources import open_source
from store.errors import ConfigError
from ui.cli.app import app, console, open_store, settings
from ui.cli.prometheus import LISTEN_HELP, parse_listen_address


@app.command()
def agent(
    interval: float = typer.Option(None, "--interval", help="Seconds between samples (FLEETLENS_SAMPLE_INTERVAL_S)."),
    flush_interval: float = typer.Option(
        None, "--flush-interval", help="Seconds between writes to the database (FLEETLENS_FLUSH_INTERVAL_S)."
    ),
    source: str = typer.Option(None, "--source", help="auto | nvml | cpu | replay (FLEETLENS_SOURCE)."),
    host_id: str = typer.Option(None, "--host-id", help="This host's id in the store (FLEETLENS_HOST_ID)."),
    once: bool = typer.Option(False, "--once", help="Take one sample, write it, run pending commands, exit."),
    duration: float = typer.Option(None, "--duration", help="Stop cleanly after this many seconds."),
    no_socket: bool = typer.Option(False, "--no-socket", help="Do not serve the job SDK socket."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every flush and command."),
    listen_address: str = typer.Option(None, "--listen-address", help=LISTEN_HELP.format(port=9400) +
                                       " (FLEETLENS_METRICS_HOST and _PORT; default: /metrics not served)"),
) -> None:
    """Run the per-host agent until SIGTERM or Ctrl-C; the last batch is written (or spooled) on the way out."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for name, value in (("--interval", interval), ("--flush-interval", flush_interval), ("--duration", duration)):
        if value is not None and not 0 < value < math.inf:  # NaN too: an interval of NaN sampled without a pause
            raise ConfigError(f"{name} must be a positive number of seconds, not {value}")
    if host_id is not None and not host_id.strip():  # the store would record the samples of a host named ''
        raise ConfigError(f"--host-id {host_id!r} is blank; give this host's name, or leave it out for the hostname")
    overrides = {
        k: v
        for k, v in {
            "sample_interval_s": interval, "flush_interval_s": flush_interval, "source": source, "host_id": host_id,
        }.items()
        if v is not None
    }
    if listen_address is not None:
        overrides["metrics_host"], overrides["metrics_port"] = parse_listen_address(listen_address)
    s = settings().model_copy(update=overrides)
    s.ensure_home()
    store = open_store()
    dev_source = open_source(s)
    the_agent = Agent(store, s, dev_source, serve_socket=not no_socket and not once)
    if once:
        stats = the_agent.run_once()
        console.print(
            f"host {the_agent.host_id}: {stats.device_rows} device and {stats.process_rows} process samples "
            f"{'written' if stats.batches_written else 'spooled'}; {len(stats.commands)} commands handled"
        )
        return
    stats = the_agent.run(duration=duration)
    console.print(
        f"agent {the_agent.host_id} stopped after {stats.rounds} rounds: {stats.batches_written} batches written, "
        f"{stats.batches_spooled} spooled, {stats.batches_resent} resent, {len(the_agent.spool)} still spooled; "
        "the jobs it launched go on (the next agent here takes them up)"
        + (f"; {stats.nonfinite_values} metric values read as NaN or infinite were stored as not reported"
           if stats.nonfinite_values else "")
        + (f"; the database refused {stats.sdk_rows_refused} step summaries and {stats.sdk_memory_refused} memory "
           "figures of the jobs (given up, each alone; the log names their workflows)"
           if stats.sdk_rows_refused or stats.sdk_memory_refused else "")
        + (f"; {stats.sdk_rows_over_cap} step summaries were dropped, the oldest, while the database was away past "
           "the queue's cap" if stats.sdk_rows_over_cap else "")
    )
    if the_agent.stop_signal is not None:
        raise typer.Exit(128 + the_agent.stop_signal)  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them
