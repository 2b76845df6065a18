"""A recording written as OpenMetrics text under dcgm-exporter's names and labels.

What a fleet's Prometheus would hold had dcgm-exporter (with its Kubernetes pod mapping) watched the recorded GPUs:
DCGM_FI_DEV_GPU_UTIL (%), DCGM_FI_DEV_FB_USED and DCGM_FI_DEV_FB_FREE (MiB), labelled Hostname, gpu, UUID, device,
modelName, and pod / namespace / container for the workflow on the GPU (namespace = its team). The file is what
`promtool tsdb create-blocks-from openmetrics` backfills into a Prometheus data folder. Memory is written in MiB as a
decimal rather than dcgm-exporter's whole MiB so that the round trip through Prometheus loses nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from collector.dcgm_names import BY_NAME, MIB
from collector.recordings.recording import Recording


def _series_labels(rec: Recording) -> dict[tuple[str, int], str]:
    """{(host, index): '{label="value",...}'} for every device of the recording."""
    team = {w["id"]: w.get("team") or "default" for w in rec.workflows}
    on_device: dict[tuple[str, int], str] = {}
    for row in rec.process_samples[["host_id", "device_index", "workflow_id"]].drop_duplicates(
            ["host_id", "device_index"]).itertuples(index=False):
        on_device[(row.host_id, int(row.device_index))] = row.workflow_id
    out = {}
    for d in rec.devices:
        key = (d["host_id"], int(d["index"]))
        labels = {"Hostname": d["host_id"], "gpu": str(d["index"]), "UUID": d["uuid"], "device": f"nvidia{d['index']}",
                  "modelName": d["name"]}
        wf = on_device.get(key)
        if wf is not None:
            labels |= {"namespace": team.get(wf, "default"), "pod": wf, "container": "main"}
        out[key] = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write_openmetrics(rec: Recording, path: Path, *, start: float | None = None, end: float | None = None) -> int:
    """Write the recording's device samples of [start, end] to `path`; returns the number of samples written."""
    samples = rec.device_samples
    if start is not None:
        samples = samples[samples["ts"] >= start]
    if end is not None:
        samples = samples[samples["ts"] <= end]
    labels = _series_labels(rec)
    keys = list(zip(samples["host_id"], samples["device_index"].astype(int), strict=True))
    frame = pd.DataFrame({"labels": [labels[k] for k in keys], "ts": samples["ts"].to_numpy(dtype=float)})
    used = samples["mem_used"].to_numpy(dtype=float)
    values = {
        "DCGM_FI_DEV_GPU_UTIL": samples["gpu_util"].to_numpy(dtype=float) * 100.0,
        "DCGM_FI_DEV_FB_USED": used / MIB,
        "DCGM_FI_DEV_FB_FREE": (samples["mem_total"].to_numpy(dtype=float) - used) / MIB,
    }
    written = 0
    with open(path, "w") as out:
        for name, value in values.items():
            out.write(f"# HELP {name} {BY_NAME[name].help}\n# TYPE {name} gauge\n")
            ok = np.isfinite(value)
            part = frame[ok].assign(value=value[ok]).sort_values(["labels", "ts"], kind="stable")
            lines = (name + part["labels"] + " " + part["value"].map(repr) + " " + part["ts"].map(repr) + "\n")
            out.write("".join(lines.tolist()))
            written += len(part)
        out.write("# EOF\n")
    return written


__all__ = ["write_openmetrics"]
