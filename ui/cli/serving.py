"""`fleetlens serving`: serving workflows judged by latency -- their applications, SLOs, and how many devices
meet the SLOs under the measured load, with which scheduler."""

from __future__ import annotations

import math
import time
from pathlib import Path

import typer
from rich.table import Table

from analyzer.serving.rules import ServingThresholds
from enforcer.sim.readers.alibaba import read_alibaba
from enforcer.sim.serving.experiment import prepare
from enforcer.sim.serving.rightsize import SCHEDULERS, RightSize, prepare_workflow, rightsize
from enforcer.sim.serving.traces import read_alibaba_requests
from store import latency_sketch as ls
from store.errors import InvalidInput
from store.serving import app_windows, set_slo
from store.serving_raw import all_raw_counts
from ui.cli.app import app, console, open_store

serving_app = typer.Typer(help="Serving workflows: latency per application, SLOs, right-sizing.",
                          no_args_is_help=True)
app.add_typer(serving_app, name="serving")


@serving_app.command("slo", context_settings={"ignore_unknown_options": True})  # -1 is a number, refused as one
def slo_cmd(workflow: str, application: str, seconds: float,
            target: float = typer.Option(0.99, "--target", help="share of requests that must meet it")) -> None:
    """Set an application's SLO (latency = queue wait + execution)."""
    store = open_store()
    with store.session() as s:
        set_slo(s, workflow, application, seconds, target=target)
    console.print(f"{workflow}/{application}: SLO {seconds:g} s for {target:.1%} of requests")


@serving_app.command("show")
def show_cmd(window: float = typer.Option(3600.0, "--window", help="seconds back from now")) -> None:
    """Each serving application's requests, latency quantiles (to 1 %), execution-time CV and SLO attainment over
    the window. The execution time is the batch's: its CV within one batch size is the model's own variation; over
    all sizes it includes what batching does."""
    _check_window(window)
    store = open_store()
    now = time.time()
    with store.session() as s:
        windows = app_windows(s, now - window, now)
        raw = all_raw_counts(s)
    table = Table(title=f"serving applications, last {window:g} s")
    for col in ("workflow", "application", "served", "shed", "p50 s", "p99 s", "exec CV in batch size",
                "exec CV all sizes", "mean batch", "SLO s", "attainment"):
        table.add_column(col)
    unsized = []
    min_class = ServingThresholds().min_class_requests
    for w in windows:
        p50, p99 = ls.quantiles(w.latency_hist, (0.5, 0.99))
        att = w.attainment()
        within, covered = w.exec_cv_within_batch(min_class)
        if w.batch_sized < w.n:
            unsized.append(w.app)
        table.add_row(w.workflow_id, w.app, str(w.n), str(w.dropped), f"{p50:.4g}", f"{p99:.4g}",
                      f"{within:.2f}" if covered else "-", f"{w.exec_cv_quartiles:.2f}",
                      f"{w.batch_sum / w.n:.3g}" if w.n else "-", "-" if w.slo_s is None else f"{w.slo_s:g}",
                      "-" if att is None else f"{att:.2%}")
    console.print(table)
    console.print("exec CV: of execution times from the quartiles; a request's is its batch's, so only the CV within "
                  "one batch size is the model's own variation (serving.dynamic_runtime judges it); '-': no batch "
                  f"size with {min_class} requests")
    if unsized:
        console.print(f"{', '.join(sorted(set(unsized)))}: some minutes were stored before revision 0016, without "
                      "batch sizes: their requests are in the CV over all sizes only")
    if raw:
        kept = Table(title="raw requests kept (FLEETLENS_SERVING_RAW_REQUESTS; the rest are in the histograms)")
        for col in ("workflow", "stored", "over the cap"):
            kept.add_column(col)
        for wf, (stored, over) in raw.items():
            kept.add_row(wf, str(stored), str(over))
        console.print(kept)


def _check_window(window: float) -> None:
    if not 0 < window < math.inf:
        raise InvalidInput(f"--window must be a positive number of seconds, not {window}")


def _print(rs: RightSize, held: str) -> None:
    table = Table(title=f"devices that meet every SLO for {rs.target:.0%} of {rs.requests} requests")
    table.add_column("scheduler")
    table.add_column("devices needed", justify="right")
    table.add_column("attainment tried (devices: share)")
    for name, n in rs.needed.items():
        tried = ", ".join(f"{k}: {v:.3f}" for k, v in rs.attainment.get(name, {}).items())
        table.add_row(name, "none" if n is None else str(n), tried)
    console.print(table)
    best = rs.best
    if best is None:
        console.print(rs.shortfall())
    else:
        console.print(f"right size: {best[1]} devices with {best[0]} ({held})")


@serving_app.command("rightsize")
def rightsize_cmd(
    workflow: str = typer.Argument(None, help="a serving workflow in the store"),
    alibaba: Path = typer.Option(None, "--alibaba", help="instead: Alibaba's request trace (file or folder)"),
    fleet: Path = typer.Option(None, "--fleet", help="with --alibaba: the same release's GPU telemetry folder, "
                               "to say what its serving containers hold"),
    k: float = typer.Option(3.0, "--k", help="with --alibaba: SLO = k x the application's median"),
    target: float = typer.Option(0.99, "--target", help="share of requests that must meet the SLO"),
    alpha: float = typer.Option(0.1, "--alpha", help="batch cost g(b) = 1 + alpha log2 b (a store workflow's "
                                "per-request times are recovered from its batch times with it too)"),
    window: float = typer.Option(3600.0, "--window", help="store workflow: seconds back from now"),
    scheduler: list[str] = typer.Option(None, "--scheduler", help=f"one of {', '.join(SCHEDULERS)} (repeat)"),
) -> None:
    """How many devices meet the SLOs under the measured load and distributions, and with which scheduler."""
    _check_window(window)
    if not 0 < k < math.inf:  # NaN too: every SLO would be NaN, met by no request
        raise InvalidInput(f"--k must be a positive number (SLO = k x the application's median), not {k}")
    schedulers = tuple(scheduler or SCHEDULERS)
    bad = [s for s in schedulers if s not in SCHEDULERS]
    if bad:
        raise InvalidInput(f"--scheduler {bad}: one of {', '.join(SCHEDULERS)}")
    if (workflow is None) == (alibaba is None):
        raise InvalidInput("name a serving workflow, or give --alibaba PATH (not both)")
    if alibaba is not None:
        trace = read_alibaba_requests(alibaba)
        fit, score = trace.split()
        prep = prepare(fit, score)
        rs = rightsize(prep, k * prep.dists.median, alpha=alpha, target=target, schedulers=schedulers)
        held = "held: unknown"
        if fleet is not None:
            tele = read_alibaba(fleet)
            span = max(j.arrival + j.work for j in tele.jobs) - min(j.arrival for j in tele.jobs)
            avg = sum(j.work * j.gpus for j in tele.jobs) / span
            held = (f"the release's {len(tele.jobs)} serving containers hold {avg:.1f} devices on average, "
                    f"{avg * 24:.0f} device-hours a day; the release does not say which served these requests")
        console.print(f"Alibaba requests: second half at its real pace ({rs.requests} requests, "
                      f"{len(prep.apps)} applications), SLO = {k:g} x median, {dict(trace.skipped)} rows skipped")
        _print(rs, held)
        return
    store = open_store()
    prep, slo, held_n = prepare_workflow(store, workflow, window_s=window, alpha=alpha)
    rs = rightsize(prep, slo, alpha=alpha, target=target, max_gpus=max(64, 2 * held_n), schedulers=schedulers)
    for name, basis in prep.time_basis.items():
        console.print(f"{name}: {basis}")
    _print(rs, f"it holds {held_n}")
