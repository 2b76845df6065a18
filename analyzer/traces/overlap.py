"""Communication/computation overlap: the share of communication kernel time hidden under computation.

Same ratio as HTA's `get_comm_comp_overlap` (overlap over merged communication time), computed with
interval arithmetic: |comm ∩ comp| = |comm| + |comp| − |comm ∪ comp|. Only the time inside the step windows
counts, as in the step breakdown: the exposed communication per step is a share of the steps' wall time, so
collectives still running after the last step ends (or before the first) must not add to it.
"""

from __future__ import annotations

import numpy as np

from analyzer.traces.events import clipped_total, gpu_events, merge_intervals, step_windows
from analyzer.traces.parse import ParsedTrace


def comm_comp_overlap(t: ParsedTrace) -> dict:
    g = gpu_events(t)
    # masks over whole columns: a large trace's device events are not copied per kind
    ts, end = g["ts"].to_numpy(float), g["end"].to_numpy(float)
    is_comm, is_comp = g["kind"].eq("COMMUNICATION").to_numpy(), g["kind"].eq("COMPUTATION").to_numpy()
    w0, w1 = merge_intervals(*step_windows(t))

    def in_steps(mask: np.ndarray) -> float:
        s, e = merge_intervals(ts[mask], end[mask])
        return float(clipped_total(s, e, w0, w1).sum())

    comm_us = in_steps(is_comm)
    if comm_us <= 0:
        return {"communication_us": 0.0, "overlap_us": 0.0, "overlap_ratio": None, "exposed_communication_us": 0.0,
                "top_comm_kernels": []}
    overlap = comm_us + in_steps(is_comp) - in_steps(is_comm | is_comp)
    comm = g.loc[is_comm, ["s_name", "dur"]]
    top = (comm.assign(name=comm["s_name"].astype(object)).groupby("name")["dur"].agg(["size", "sum"])
           .sort_values("sum", ascending=False).head(5))
    return {
        "communication_us": comm_us,
        "overlap_us": overlap,
        "overlap_ratio": overlap / comm_us,
        "exposed_communication_us": comm_us - overlap,
        "top_comm_kernels": [{"name": n, "count": int(r["size"]), "total_us": float(r["sum"])}
                             for n, r in top.iterrows()],
    }
