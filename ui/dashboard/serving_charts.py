"""Plotly figures of the Serving page: each application's latency CDF against its SLO, attainment per minute."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from store import latency_sketch as ls
from store.serving import AppWindow


def latency_cdf(apps: list[AppWindow]) -> go.Figure:
    fig = go.Figure()
    for w in apps:
        keys = sorted(w.latency_hist)
        if not keys:
            continue
        x = [ls.value(k) for k in keys]
        y = np.cumsum([w.latency_hist[k] for k in keys]) / max(1, w.n + w.dropped)  # shed ones never finish
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=w.app, line_shape="hv"))
        if w.slo_s is not None:
            fig.add_vline(x=w.slo_s, line_dash="dash", annotation_text=f"SLO {w.app}", opacity=0.6)
    fig.update_layout(xaxis_title="latency (s, log)", yaxis_title="share of requests", xaxis_type="log",
                      yaxis_range=[0, 1.02], height=360, margin={"t": 30})
    return fig


def attainment_over_time(apps: list[AppWindow]) -> go.Figure:
    fig = go.Figure()
    for w in apps:
        rows = [(m, (met if met is not None else np.nan) / (n + d)) for m, n, d, met in w.minutes if n + d]
        if not rows or w.slo_s is None:
            continue
        t = pd.to_datetime([r[0] for r in rows], unit="s", utc=True)
        fig.add_trace(go.Scatter(x=t, y=[r[1] for r in rows], mode="lines+markers", name=w.app))
        fig.add_hline(y=w.target, line_dash="dot", opacity=0.5)
    fig.update_layout(yaxis_title="met the SLO (share, per minute)", yaxis_range=[0, 1.02], height=320,
                      margin={"t": 30})
    return fig
