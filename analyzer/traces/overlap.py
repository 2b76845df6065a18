"""Communication/computation overlap: the share of communication kernel time hidden under computation.

Same ratio as HTA's `get_comm_comp_overlap` (overlap over merged communication time), computed with
interval arithmetic: |comm ∩ comp| = |comm| + |comp| − |comm ∪ comp|.
"""

from __future__ import annotations

from analyzer.traces.events import gpu_events, union_length
from analyzer.traces.parse import ParsedTrace


def comm_comp_overlap(t: ParsedTrace) -> dict:
    g = gpu_events(t)
    # masks over whole columns: a large trace's device events are not copied per kind
    ts, end = g["ts"].to_numpy(float), g["end"].to_numpy(float)
    is_comm, is_comp = g["kind"].eq("COMMUNICATION").to_numpy(), g["kind"].eq("COMPUTATION").to_numpy()
    comm_us = union_length(ts[is_comm], end[is_comm])
    if comm_us <= 0:
        return {"communication_us": 0.0, "overlap_us": 0.0, "overlap_ratio": None, "exposed_communication_us": 0.0,
                "top_comm_kernels": []}
    comp_us = union_length(ts[is_comp], end[is_comp])
    union_us = union_length(ts[is_comm | is_comp], end[is_comm | is_comp])
    overlap = comm_us + comp_us - union_us
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
