"""The simulator's HTML report: the metrics side by side and plotly figures (devices in use, JCT, queue)."""

from __future__ import annotations

import html
import os
import tempfile
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from enforcer.sim.metrics import SimResult
from enforcer.sim.model import Trace
from store.errors import InvalidInput

COLUMNS = [
    ("devices_needed", "devices needed", "{:.0f}"), ("device_hours", "device-hours", "{:,.1f}"),
    ("jct_mean_s", "mean JCT (s)", "{:,.0f}"), ("jct_p95_s", "p95 JCT (s)", "{:,.0f}"),
    ("makespan_s", "makespan (s)", "{:,.0f}"), ("util_mean", "mean util", "{:.1%}"),
    ("queue_delay_mean_s", "mean queueing (s)", "{:,.0f}"), ("fragmentation", "fragmentation", "{:.1%}"),
    ("stretch_mean", "mean stretch", "{:.2f}"), ("preemptions", "preemptions", "{:.0f}"),
    ("finished", "finished", "{:.0f}"), ("wall_s", "sim time (s)", "{:.2f}"),
]


def figures(results: list[SimResult]) -> go.Figure:
    fig = make_subplots(rows=2, cols=2, subplot_titles=(
        "devices holding a job", "jobs waiting", "job completion time (CDF)", "device-hours and devices needed"))
    for r in results:
        t, n = zip(*r.busy, strict=True) if r.busy else ((), ())
        fig.add_trace(go.Scatter(x=np.array(t) / 3600, y=n, mode="lines", line_shape="hv", name=r.policy,
                                 legendgroup=r.policy), row=1, col=1)
        t, q = zip(*r.queue, strict=True) if r.queue else ((), ())
        fig.add_trace(go.Scatter(x=np.array(t) / 3600, y=q, mode="lines", line_shape="hv", name=r.policy,
                                 legendgroup=r.policy, showlegend=False), row=1, col=2)
        jct = np.sort(r.jobs["jct"].dropna().to_numpy())
        fig.add_trace(go.Scatter(x=jct, y=np.arange(1, len(jct) + 1) / max(len(jct), 1), mode="lines",
                                 name=r.policy, legendgroup=r.policy, showlegend=False), row=2, col=1)
    names = [r.policy for r in results]
    fig.add_trace(go.Bar(x=names, y=[r.metrics["device_hours"] for r in results], name="device-hours",
                         showlegend=False), row=2, col=2)
    fig.update_xaxes(title_text="hours", row=1, col=1)
    fig.update_xaxes(title_text="hours", row=1, col=2)
    fig.update_xaxes(title_text="seconds", type="log", row=2, col=1)
    fig.update_layout(height=800, title="fleetlens simulate")
    return fig


def write_html(path: Path, trace: Trace, results: list[SimResult], notes: dict | None = None) -> Path:
    """Write the report atomically (a temporary file renamed over `path`): nothing half-written on failure."""
    path = Path(path)
    if not path.parent.is_dir():
        raise InvalidInput(f"--html {path}: the folder {path.parent} does not exist")
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in COLUMNS)
    rows = "".join(
        "<tr><td>" + html.escape(r.policy) + "</td>"
        + "".join(f"<td>{fmt.format(r.metrics.get(key, 0) or 0)}</td>" for key, _, fmt in COLUMNS) + "</tr>"
        for r in results
    )
    info = {"trace": trace.kind, **trace.report.as_dict(), **trace.notes, **(notes or {})}
    body = (
        "<html><head><meta charset='utf-8'><title>fleetlens simulate</title></head><body>"
        f"<h1>fleetlens simulate: {html.escape(trace.kind)}</h1>"
        f"<pre>{html.escape(repr(info))}</pre>"
        f"<table border='1' cellpadding='4'><tr><th>policy</th>{head}</tr>{rows}</table>"
        + figures(results).to_html(full_html=False, include_plotlyjs=True)
        + "</body></html>"
    )
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(body)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
