"""Reader for Alibaba's GenAI GPU telemetry (cluster-trace-v2026-GenAI): one serving container = one job."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from enforcer.sim.model import GIB, NodeSpec, ReadReport, SimJob, Trace
from enforcer.sim.readers.common import numeric, read_csv
from store.errors import InvalidInput

UTIL_FILE = "alibaba_genai_pod_gpu_duty_cycle.csv.gz"
MEM_FILE = "alibaba_genai_pod_gpu_memory_used_bytes.csv.gz"
COLUMNS = ("value", "timestamp_anon", "container_ip")
# The containers peak at 47 GiB; GenAI serving runs on 80 GiB devices (A100/H800 class).
DEVICE_MEM = 80 * GIB


def _paths(path: Path) -> tuple[Path, Path]:
    path = Path(path)
    if path.is_dir():
        return path / UTIL_FILE, path / MEM_FILE
    if "memory_used" in path.name:
        return path.with_name(path.name.replace("memory_used_bytes", "duty_cycle")), path
    if "duty_cycle" in path.name:
        return path, path.with_name(path.name.replace("duty_cycle", "memory_used_bytes"))
    raise InvalidInput(
        f"Alibaba telemetry: {path} is neither a folder holding {UTIL_FILE} and {MEM_FILE} nor one of those files"
    )


def read_alibaba_series(path: Path) -> tuple[pd.DataFrame, ReadReport]:
    """Both series joined per container and timestamp: columns container, ts, util (0..1), mem (bytes)."""
    util_path, mem_path = _paths(path)
    report = ReadReport(str(util_path.parent))
    frames = {}
    for what, p in (("util", util_path), ("mem", mem_path)):
        df, bad_lines = read_csv(p, f"Alibaba GPU {what} telemetry", COLUMNS)
        report.rows += len(df) + bad_lines
        report.skip("malformed", bad_lines)
        df, bad = numeric(df, ["value", "timestamp_anon"])
        report.skip("malformed", bad)
        neg = df["value"] < 0
        report.skip("malformed", int(neg.sum()))
        df = df[~neg & (df["container_ip"].str.len() > 0)]
        frames[what] = df.rename(columns={"value": what, "timestamp_anon": "ts", "container_ip": "container"})
    frames["util"]["util"] = frames["util"]["util"].clip(upper=100.0) / 100.0
    series = frames["util"].merge(frames["mem"], on=["container", "ts"], how="outer")
    return series, report


def read_alibaba(path: Path, *, util_quantile: float = 0.95, device_mem: int = DEVICE_MEM) -> Trace:
    """One job per container, alive from its first sample to its last: util = its `util_quantile` utilisation,
    mem = its peak memory. A container with only one of the two series is skipped and counted; one larger
    than a device is kept, and the simulator says per job why it cannot run. Each asked
    for a whole device in production; the trace does not say how many devices the cluster had, so the
    cluster is one device per container (what exclusive allocation needs)."""
    series, report = read_alibaba_series(path)
    t0 = float(series["ts"].min()) if len(series) else 0.0
    step = float(series["ts"].drop_duplicates().sort_values().diff().median() or 60.0) if len(series) else 60.0
    g = series.groupby("container")
    summary = pd.DataFrame({
        "first": g["ts"].min(), "last": g["ts"].max(), "util": g["util"].quantile(util_quantile),
        "util_mean": g["util"].mean(), "mem": g["mem"].max(),
    })
    jobs = []
    for cid, row in summary.iterrows():
        if row["util"] != row["util"] or row["mem"] != row["mem"]:
            report.skip("one_series_only")
            continue
        jobs.append(
            SimJob(str(cid), float(row["first"] - t0), float(row["last"] - row["first"] + step), gpus=1,
                   share=1.0, mem=max(1, int(row["mem"])), util=float(row["util"]))
        )
    report.jobs = len(jobs)
    cluster = [NodeSpec(f"alibaba-{i:03d}", 1, device_mem, "80GB") for i in range(len(jobs))]
    notes = {"util_quantile": util_quantile, "sample_step_s": step,
             "util_mean": float(summary["util_mean"].mean()) if len(summary) else 0.0}
    return Trace("alibaba", jobs, cluster, report, notes)
