"""Plotly figures for the dashboard: each takes a query's DataFrame and returns a figure, nothing else."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from analyzer.traces.names import kernel_label

# The dashboard's one look, as plotly's default: a template named in update_layout is validated (deep-copied) on
# every figure, 25 ms each; the default is applied once, when the figure is serialised, to the same JSON.
pio.templates.default = "plotly_white"

HELD = "#9aa5b1"
ACTIVE = "#2a9d8f"
ACCENT = "#e76f51"
BLUE = "#264653"
PALETTE = ["#2a9d8f", "#e9c46a", "#f4a261", "#e76f51", "#264653", "#8ab17d", "#b56576", "#6d597a"]
GIB = 1024**3


def _layout(fig: go.Figure, height: int = 320, title: str | None = None, **kw: Any) -> go.Figure:
    legend = kw.pop("legend", dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1))
    below = legend.get("y", 1.0) < 0  # a legend under the plot needs room there
    fig.update_layout(
        height=height, margin=dict(l=10, r=10, t=64, b=90 if below else 10),
        title=dict(text=title, x=0, xanchor="left", y=0.98, yanchor="top", font=dict(size=15)),
        legend=legend, **kw,
    )
    return fig


def _time(series: pd.Series) -> pd.Series:
    return pd.to_datetime(series.astype(float), unit="s", utc=True)


def held_vs_active(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    t = _time(df.t)
    fig.add_scatter(x=t, y=df.held, name="devices held", mode="lines", line=dict(color=HELD), fill="tozeroy")
    fig.add_scatter(x=t, y=df.active, name="devices active", mode="lines", line=dict(color=ACTIVE),
                    fill="tozeroy")
    return _layout(fig, title="Devices held vs active", yaxis_title="devices")


def utilisation_histogram(df: pd.DataFrame) -> go.Figure:
    values = (df.util_mean.dropna() * 100.0).clip(0, 100)
    fig = go.Figure(go.Histogram(x=values, xbins=dict(start=0, end=100, size=5), marker_color=ACTIVE))
    return _layout(fig, title="Utilisation per device", xaxis_title="utilisation %",
                   yaxis_title="devices", bargap=0.05)


def ranking_bar(df: pd.DataFrame, label: str, value: str, title: str) -> go.Figure:
    top = df[df[value] > 0].nlargest(15, value).iloc[::-1]
    fig = go.Figure(go.Bar(x=top[value], y=top[label].astype(str), orientation="h", marker_color=ACCENT))
    return _layout(fig, height=max(220, 28 * len(top) + 80), title=title, xaxis_title="recoverable GPU-hours per day")


def freed_over_time(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure(go.Bar(x=_time(df.t), y=df.devices_freed, marker_color=ACTIVE, name="devices freed"))
    return _layout(fig, title="Devices freed by applied plans", yaxis_title="devices")


def consolidation(df: pd.DataFrame) -> go.Figure:
    """Per consolidation cycle: devices held, devices the plan needs, and devices it freed."""
    t = _time(df.t)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=t, y=df.devices_held, mode="lines+markers", line_shape="hv", name="devices held"))
    fig.add_trace(go.Scatter(x=t, y=df.devices_needed, mode="lines+markers", line_shape="hv",
                             name="devices the plan needs"))
    fig.add_trace(go.Bar(x=t, y=df.devices_freed, marker_color=ACTIVE, name="devices freed", opacity=0.6))
    return _layout(fig, title="Consolidation cycles", yaxis_title="devices")


def workflow_series(df: pd.DataFrame) -> go.Figure:
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.14,
                        subplot_titles=("Utilisation and SM activity", "Memory against device memory"))
    t = _time(df.t)
    if "own_util" in df and df.own_util.notna().any():
        fig.add_scatter(x=t, y=df.own_util * 100, name="its processes' utilisation %", line=dict(color=ACTIVE),
                        row=1, col=1)
        fig.add_scatter(x=t, y=df.util * 100, name="device utilisation % (lane-mates included)",
                        line=dict(color=HELD, dash="dot"), row=1, col=1)
    else:
        fig.add_scatter(x=t, y=df.util * 100, name="GPU utilisation %", line=dict(color=ACTIVE), row=1, col=1)
    fig.add_scatter(x=t, y=df.sm_active * 100, name="SM active %", line=dict(color=BLUE), row=1, col=1)
    fig.add_scatter(x=t, y=df.mem_used / GIB, name="memory used, fullest device (GiB)", line=dict(color=ACCENT),
                    fill="tozeroy", row=2, col=1)
    fig.add_scatter(x=t, y=df.mem_total / GIB, name="device memory (GiB)", line=dict(color=HELD, dash="dash"),
                    row=2, col=1)
    fig.update_yaxes(title_text="%", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="GiB", rangemode="tozero", row=2, col=1)
    # the legend under the plots, so it never covers a subplot's title
    return _layout(fig, height=520, legend=dict(orientation="h", yanchor="top", y=-0.12, x=0))


def step_time(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    t = _time(df.t)
    fig.add_scatter(x=t, y=df.mean_s * 1000, name="mean", mode="lines+markers", line=dict(color=ACTIVE))
    fig.add_scatter(x=t, y=df.p95_s * 1000, name="p95", mode="lines", line=dict(color=ACCENT, dash="dot"))
    return _layout(fig, height=260, title="Step time", yaxis_title="ms")


def _numeric_items(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    return {str(k): float(v) for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def breakdown_tables(summary: dict[str, Any] | None) -> list[tuple[str, pd.DataFrame]]:
    """The per-rank breakdowns in a trace summary as (title, rank x category) tables.

    The analyzer writes {name: {rank: {category: value}}} (and may add scalars); every nested mapping of
    numbers becomes one stacked chart, so a new breakdown shows up without a UI change.
    """
    out: list[tuple[str, pd.DataFrame]] = []
    for name, value in (summary or {}).items():
        if not isinstance(value, dict) or not value:
            continue
        rows = {str(k): _numeric_items(v) for k, v in value.items() if isinstance(v, dict)}
        rows = {k: v for k, v in rows.items() if v}
        if rows:
            out.append((str(name), pd.DataFrame.from_dict(rows, orient="index").fillna(0.0)))
        elif _numeric_items(value):
            out.append((str(name), pd.DataFrame([_numeric_items(value)], index=["all"])))
    return out


MAIN_PARTS = ("computation", "communication", "memory", "idle")


def trace_figures(summary: dict[str, Any] | None) -> list[tuple[str, go.Figure]]:
    """Charts of one rank's trace summary (analyzer.traces.summary): time per step by kind, idle time by cause,
    and the top kernels. A summary in another shape falls back to one stacked chart per numeric mapping."""
    if not summary:
        return []
    if not isinstance(summary.get("breakdown"), list):
        return [(name, breakdown(name, table)) for name, table in breakdown_tables(summary)]
    out: list[tuple[str, go.Figure]] = []
    steps = pd.DataFrame(summary["breakdown"])
    if not steps.empty and "step" in steps:
        x = steps.step.astype(str)
        fig = go.Figure()
        for i, part in enumerate(MAIN_PARTS):
            if f"{part}_us" in steps:
                fig.add_bar(x=x, y=steps[f"{part}_us"] / 1000, name=part, marker_color=PALETTE[i])
        out.append(("steps", _layout(fig, title="Time per step by kind", barmode="stack", yaxis_title="ms",
                                      xaxis_title="step")))
        causes = [c for c in steps.columns if c.endswith("_us") and c.removesuffix("_us") not in MAIN_PARTS
                  and c != "step_us"]
        if causes and steps[causes].fillna(0).to_numpy().sum() > 0:
            fig = go.Figure()
            for i, c in enumerate(causes):
                fig.add_bar(x=x, y=steps[c] / 1000, name=c.removesuffix("_us").replace("_", " "),
                            marker_color=PALETTE[(i + 4) % len(PALETTE)])
            out.append(("idle", _layout(fig, title="Idle time by cause", barmode="stack", yaxis_title="ms",
                                         xaxis_title="step")))
    kernels = pd.DataFrame(summary.get("top_kernels") or [])
    if not kernels.empty and {"name", "total_us"} <= set(kernels.columns):
        top = kernels.nlargest(10, "total_us").iloc[::-1]
        names = [n if len(n) <= 60 else n[:59] + "…" for n in map(kernel_label, top.name.astype(str))]
        fig = go.Figure(go.Bar(x=top.total_us / 1000, y=names, orientation="h", marker_color=BLUE))
        out.append(("kernels", _layout(fig, height=max(220, 26 * len(top) + 90), title="Top kernels",
                                        xaxis_title="ms in the trace")))
    return out


def breakdown(title: str, table: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for i, column in enumerate(table.columns):
        fig.add_bar(y=[f"rank {r}" if str(r).isdigit() else str(r) for r in table.index], x=table[column],
                    name=str(column), orientation="h", marker_color=PALETTE[i % len(PALETTE)])
    return _layout(fig, height=max(200, 40 * len(table) + 120), barmode="stack",
                   title=title.replace("_", " ").capitalize())


def lanes(df: pd.DataFrame) -> go.Figure:
    """One bar per device: its lanes as memory slices, the rest free. Every lane is named in the legend and on hover
    (a slice narrower than its label cannot show it inside)."""
    fig = go.Figure()
    lanes_ = df.groupby(["device_id", "lane_id"], sort=True).agg(
        host_id=("host_id", "first"), size=("size_bytes", "first"), total=("memory_total", "first"),
        jobs=("workflow_id", lambda s: ", ".join(sorted(str(x) for x in s.dropna())) or "(empty)"),
    ).reset_index()
    label = {d: f"{h} · dev {d}" for d, h in zip(lanes_.device_id, lanes_.host_id, strict=True)}
    for i, row in enumerate(lanes_.itertuples()):
        fig.add_bar(
            y=[label[row.device_id]], x=[row.size / GIB], orientation="h", name=f"lane {row.lane_id}",
            marker=dict(color=PALETTE[i % len(PALETTE)], line=dict(color="white", width=2)),
            text=[f"lane {row.lane_id}"], textposition="inside", insidetextanchor="middle",
            hovertemplate=f"lane {row.lane_id}<br>{row.size / GIB:.1f} GiB<br>{row.jobs}<extra></extra>",
            showlegend=True, legendgroup=f"lane {row.lane_id}",
        )
        fig.data[-1].name = f"lane {row.lane_id} ({row.size / GIB:.0f} GiB): {row.jobs}"
    for device_id, group in lanes_.groupby("device_id"):
        total = group.total.iloc[0]
        if total and total == total:
            free = max(0.0, float(total) - float(group["size"].sum()))
            fig.add_bar(y=[label[device_id]], x=[free / GIB], orientation="h", name="free", showlegend=False,
                        marker=dict(color="#eef1f4"), text=["free"], textposition="inside",
                        hovertemplate=f"free {free / GIB:.1f} GiB<extra></extra>")
    return _layout(fig, height=max(260, 60 * lanes_.device_id.nunique() + 40 * len(lanes_) + 100), barmode="stack",
                   title="Lanes per device (memory slices)", xaxis_title="GiB", uniformtext=dict(minsize=9,
                                                                                             mode="hide"),
                   legend=dict(orientation="h", yanchor="top", y=-0.25, x=0, title_text="lanes"))


def action_timeline(events: pd.DataFrame) -> go.Figure:
    """A migration's states as consecutive bars from one event to the next."""
    df = events.copy()
    df["start"] = _time(df.ts)
    df["finish"] = df.start.shift(-1).fillna(df.start + pd.Timedelta(seconds=1))
    fig = go.Figure()
    for i, row in enumerate(df.itertuples()):
        fig.add_bar(
            base=[row.start], x=[(row.finish - row.start).total_seconds() * 1000], y=[row.to_state],
            orientation="h", marker_color=PALETTE[i % len(PALETTE)], showlegend=False,
            hovertemplate=f"{row.to_state}<br>{row.message}<extra></extra>",
        )
    fig.update_xaxes(type="date")
    fig.update_yaxes(categoryorder="array", categoryarray=list(dict.fromkeys(df.to_state))[::-1])
    return _layout(fig, height=max(200, 36 * len(df) + 100), title="State timeline")


def sweep_widths(events: pd.DataFrame) -> go.Figure:
    """Each trial's width over time: a step line per trial, from its start to its end."""
    fig = go.Figure()
    for i, (trial, rows) in enumerate(events.groupby("trial_id", sort=False)):
        width = rows.new_width.where(~rows.kind.isin(["finish", "died"]), 0.0)
        fig.add_scatter(x=_time(rows.ts), y=width, name=str(trial), mode="lines+markers", line_shape="hv",
                        line=dict(color=PALETTE[i % len(PALETTE)]))
    return _layout(fig, title="Width of each trial (GPUs; below 1: sharing one GPU in a lane)",
                   yaxis=dict(title="GPUs", rangemode="tozero"))


def sweep_gpu_use(use: pd.DataFrame, gpus: int) -> go.Figure:
    """GPUs the sweep held against what one trial per GPU would have held for the same running trials."""
    fig = go.Figure()
    t = _time(use.t)
    fig.add_scatter(x=t, y=use.held, name="held under Fluid", mode="lines", line_shape="hv", fill="tozeroy",
                    line=dict(color=ACTIVE))
    fig.add_scatter(x=t, y=use.one_per_gpu, name="one trial per GPU", mode="lines", line_shape="hv",
                    line=dict(color=ACCENT, dash="dash"))
    return _layout(fig, title=f"GPU use of the sweep (of {gpus})", yaxis=dict(title="GPUs", rangemode="tozero"))
