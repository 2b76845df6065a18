"""`fleetlens analyze PATH...`: analyse trace files (one rank per file) into a terminal, JSON or HTML report."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from analyzer.report import print_report
from analyzer.report_html import render_html
from analyzer.traces.cache import TraceBounds
from analyzer.traces.claims import ClaimPolicy
from analyzer.traces.jobs import analyze_trace, register_trace
from analyzer.traces.run import AnalysisResult, analyze_paths, expand_paths
from store.errors import InvalidInput
from ui.cli.app import app, console, err_console, open_store, settings

LARGE_TRACE_BYTES = 256 * 1024  # show a progress bar once a file takes more than a blink


def _run_with_progress(paths: list[str], cache_dir: Path | None, quiet: bool, bounds: TraceBounds) -> AnalysisResult:
    try:
        files = expand_paths(paths)
    except InvalidInput:
        files = []
    large = any(f.exists() and f.stat().st_size >= LARGE_TRACE_BYTES for f in files)
    if quiet or not large or not err_console.is_terminal:
        return analyze_paths(paths, cache_dir=cache_dir, bounds=bounds)
    # bytes of the file read, events decoded, time: the read is most of an analysis
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TextColumn("{task.fields[events]:,} events"), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        tasks: dict[str, TaskID] = {}

        def read(path: str, done: int, size: int, events: int) -> None:
            if path not in tasks:
                tasks[path] = progress.add_task(f"reading {Path(path).name}", total=size, events=0)
            progress.update(tasks[path], completed=done, events=events)

        def step(path: str, stage: str) -> None:
            if path in tasks:
                progress.update(tasks[path], description=f"{stage} {Path(path).name}")

        return analyze_paths(paths, cache_dir=cache_dir, progress=step, read_progress=read, bounds=bounds)


@app.command()
def analyze(
    paths: list[str] = typer.Argument(..., help="Trace files (.json, .json.gz) or folders of them, one rank each."),
    as_json: bool = typer.Option(False, "--json", help="Print the analysis as JSON."),
    html: Path | None = typer.Option(None, "--html", help="Write a self-contained HTML report to this file."),
    store: bool = typer.Option(False, "--store", help="Register the traces in the store and record findings."),
    workflow: str | None = typer.Option(None, "--workflow", help="Workflow the traces belong to (with --store)."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="GPUs the job runs on, for GPU-hours per day."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Parse again even if the trace was parsed before."),
) -> int:
    """Find why a training job wastes its GPU, from its PyTorch profiler traces. Exit code 2 if any trace failed."""
    if html is not None and not html.parent.is_dir():  # said before the analysis, not after it
        raise InvalidInput(f"cannot write the HTML report {html}: folder {html.parent} does not exist")
    if html is not None and html.is_dir():
        raise InvalidInput(f"cannot write the HTML report {html}: it is a folder; give a file name")
    s = settings()
    cache_dir = None if no_cache else s.home / "cache" / "traces"
    if store:
        return _analyze_into_store(paths, workflow, as_json, cache_dir)
    result = _run_with_progress(paths, cache_dir, quiet=as_json, bounds=TraceBounds.from_settings(s))
    if as_json:
        console.print_json(json.dumps(result.as_dict(gpus)))
    else:
        print_report(result, console, gpus)
    if html is not None:
        try:
            html.write_text(render_html(result, gpus), encoding="utf-8")
        except OSError as exc:
            raise InvalidInput(f"cannot write the HTML report {html}: {exc.strerror or exc}") from None
        err_console.print(f"wrote {html}")
    for path, problem in result.errors.items():
        err_console.print(f"fleetlens: trace {path}: {problem}", highlight=False, markup=False)
    return 2 if result.failed else 0


def _analyze_into_store(paths: list[str], workflow: str | None, as_json: bool, cache_dir: Path | None) -> int:
    st = open_store()
    s = settings()
    files = expand_paths(paths)
    out, failed = [], False
    for f in files:
        trace_id = register_trace(st, f, workflow_id=workflow)
        res = analyze_trace(st, trace_id, cache_dir=cache_dir or s.home / "cache" / "traces", host_id=s.host_id,
                            bounds=TraceBounds.from_settings(s), claims=ClaimPolicy.from_settings(s))
        failed |= res["status"] == "failed"
        out.append({"trace_id": trace_id, "path": str(f), "status": res["status"], "error": res["error"],
                    "findings": res["findings"]})
        if not as_json:
            console.print(f"trace {trace_id} {f.name}: {res['status']}"
                          + (f" ({res['error']})" if res["error"] else f", {len(res['findings'])} findings"),
                          highlight=False, markup=False)
    if as_json:
        console.print_json(json.dumps(out))
    return 2 if failed else 0
