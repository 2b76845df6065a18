"""One self-contained HTML page of a trace analysis: plotly figures (plotly.js inline), findings, errors."""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go

from analyzer.traces.names import kernel_label
from analyzer.traces.run import AnalysisResult

PARTS = [("computation_us", "computation"), ("communication_us", "communication"), ("memory_us", "memory copies"),
         ("host_wait_us", "idle: host wait"), ("kernel_wait_us", "idle: kernel wait"), ("other_idle_us", "idle: other")]


def _figures(result: AnalysisResult) -> list[go.Figure]:
    figs = []
    for s in result.summaries:
        label = f"rank {s['rank']} ({Path(s['path']).name})"
        if s["has_gpu"]:
            fig = go.Figure()
            steps = [str(r["step"]) for r in s["breakdown"]]
            for key, name in PARTS:
                fig.add_bar(name=name, x=steps, y=[(r[key] or 0) / 1e3 for r in s["breakdown"]])
            fig.update_layout(barmode="stack", title=f"{label}: time per step (ms)", xaxis_title="step",
                              yaxis_title="ms")
            figs.append(fig)
        if s["top_kernels"]:
            k = s["top_kernels"][::-1]
            names = [_short(kernel_label(r["name"])) for r in k]
            figs.append(go.Figure(go.Bar(x=[r["total_us"] / 1e3 for r in k], y=names,
                                         orientation="h"),
                                  layout={"title": f"{label}: top kernels (ms)", "height": 420,
                                          "margin": {"l": 420}}))
        if s["memcpy"]:
            figs.append(go.Figure(go.Bar(x=[f"{r['direction']} {r['host_memory']}" for r in s["memcpy"]],
                                         y=[r["total_us"] / 1e3 for r in s["memcpy"]],
                                         text=[f"{r['count']} copies" for r in s["memcpy"]]),
                                  layout={"title": f"{label}: memory copies (ms)"}))
    if result.straggler:
        v = result.straggler
        figs.append(go.Figure(go.Bar(x=[f"rank {r}" for r in v["per_rank_us"]],
                                     y=[us / 1e3 for us in v["per_rank_us"].values()]),
                              layout={"title": f"time per step to reach the collectives by rank (ms): "
                                               f"{'straggler' if v['is_straggler'] else 'no straggler'}"}))
    return figs


def render_html(result: AnalysisResult, gpus: int = 1) -> str:
    parts = []
    for i, fig in enumerate(_figures(result)):
        # plotly.js goes inline once, so the page works offline
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    rows = "".join(
        f"<tr><td>{html.escape(f.severity)}</td><td>{html.escape(f.rule)}</td><td>{html.escape(f.subject)}</td>"
        f"<td>{html.escape(f.title)}<br><small>where: {html.escape(f.location)}</small><br>"
        f"<small>fix: {html.escape(f.fix)}</small></td><td>{f.cost_s_per_step * 1e3:.2f}</td>"
        f"<td>{f.gpu_hours_per_day(gpus):.2f}</td></tr>"
        for f in sorted(result.findings, key=lambda f: -f.gpu_hours_per_day(gpus)))
    errors = "".join(f"<li>{html.escape(p)}: {html.escape(e)}</li>" for p, e in result.errors.items())
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>fleetlens trace analysis</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px;vertical-align:top}</style></head><body>"
        "<h1>fleetlens trace analysis</h1>"
        f"<p>{len(result.summaries)} trace(s) analysed, {len(result.errors)} failed.</p>"
        f"<h2>Findings</h2><table><tr><th>severity</th><th>rule</th><th>rank</th><th>finding</th>"
        f"<th>ms/step</th><th>GPU-h/day (projected: 24 h a day on {gpus} GPU)</th></tr>{rows}</table>"
        + (f"<h2>Failed</h2><ul>{errors}</ul>" if errors else "")
        + "<h2>Charts</h2>" + "".join(parts) + "</body></html>"
    )


def _short(label: str, width: int = 60) -> str:
    return label if len(label) <= width else label[:width - 1] + "…"
