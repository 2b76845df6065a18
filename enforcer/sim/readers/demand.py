"""Readers for demand replay: jobs whose memory and utilisation change over time (Alibaba per-minute telemetry) or
are declared at arrival (openb pods' gpu_milli), with arrivals and departures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from enforcer.sim.model import ReadReport
from enforcer.sim.readers.alibaba import read_alibaba_series
from enforcer.sim.readers.common import numeric, read_csv
from store.errors import InvalidInput
from store.headroom import LANE_FACTOR, PERSISTENT_FACTOR


@dataclass(slots=True)
class DemandJob:
    """One job to replay. departure is when it leaves (None: it stays to the end); the planner never reads it.

    times / mem / util: its telemetry (what a collector would record), or declared_mem / declared_util when the job
    asked for a fixed quota at arrival. gpus > 1: whole devices for its lifetime, never moved."""

    id: str
    arrival: float
    departure: float | None
    times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    mem: np.ndarray = field(default_factory=lambda: np.zeros(0))
    util: np.ndarray = field(default_factory=lambda: np.zeros(0))
    declared_mem: int | None = None
    declared_util: float | None = None
    gpus: int = 1


@dataclass(slots=True)
class DemandTrace:
    kind: str
    jobs: list[DemandJob]
    report: ReadReport
    step_s: float | None  # telemetry interval (None: no telemetry, events only)
    rejected: dict[str, str] = field(default_factory=dict)  # job -> why it cannot be replayed
    notes: dict = field(default_factory=dict)


def read_alibaba_demand(path: Path) -> DemandTrace:
    """Alibaba GenAI containers with their per-minute memory and utilisation; a container arrives at its first
    sample and leaves one interval after its last. Readings with a missing or negative memory value are dropped
    and counted per container; a container left with no memory reading is rejected with that reason."""
    series, report = read_alibaba_series(Path(path))
    if series.empty:
        raise InvalidInput(f"Alibaba telemetry {path}: no usable rows (every reading was malformed or missing)")
    times = np.sort(series["ts"].unique())
    step = float(np.median(np.diff(times))) if len(times) > 1 else 60.0
    jobs: list[DemandJob] = []
    rejected: dict[str, str] = {}
    missing = series["mem"].isna()
    report.skip("memory_missing", int(missing.sum()))
    per_container_missing = series[missing].groupby("container").size().to_dict()
    for cid, g in series.sort_values("ts").groupby("container", sort=True):
        g = g[g["mem"].notna()]
        if g.empty:
            rejected[str(cid)] = "no usable memory reading (all missing or negative)"
            continue
        t = g["ts"].to_numpy(dtype=float)
        jobs.append(DemandJob(str(cid), float(t[0]), float(t[-1] + step), t, g["mem"].to_numpy(dtype=float),
                              g["util"].fillna(1.0).to_numpy(dtype=float)))
    report.jobs = len(jobs)
    notes = {"readings_without_memory": {k: int(v) for k, v in per_container_missing.items()}}
    return DemandTrace("alibaba", jobs, report, step, rejected, notes)


def quota_bytes(share: float, device_mem: int) -> int:
    """P such that Salus's lane of 1.05 x 1.1 P is `share` of the device: lanes then add up like gpu_milli."""
    return max(0, int(math.floor(share * device_mem / (LANE_FACTOR * PERSISTENT_FACTOR))) - 2)


def read_openb_demand(path: Path, device_mem: int) -> DemandTrace:
    """openb pods: gpu_milli is declared at arrival (compute share and, in proportion, memory), the departure
    is hidden from the planner. A pod list without time columns is replayed in file order without departures."""
    path = Path(path)
    df, bad_lines = read_csv(path, "openb pod list", ("name", "num_gpu", "gpu_milli"))
    report = ReadReport(str(path), rows=len(df) + bad_lines)
    report.skip("malformed", bad_lines)
    timed = all(c in df.columns for c in ("creation_time", "deletion_time", "scheduled_time"))
    df, bad = numeric(df, ["num_gpu", "gpu_milli"] + (["creation_time", "deletion_time"] if timed else []),
                      ["scheduled_time"] if timed else [])
    report.skip("malformed", bad)
    jobs: list[DemandJob] = []
    rejected: dict[str, str] = {}
    for k, row in enumerate(df.itertuples(index=False)):
        name, num_gpu, milli = str(row.name), row.num_gpu, row.gpu_milli
        if num_gpu < 0 or num_gpu != int(num_gpu) or not 0 <= milli <= 1000:
            rejected[name] = f"num_gpu {num_gpu} / gpu_milli {milli} out of range"
            continue
        if num_gpu == 0:
            report.skip("cpu_only")
            continue
        if timed:
            if row.scheduled_time != row.scheduled_time:
                report.skip("never_scheduled")
                continue
            arrival, departure = float(row.creation_time), float(row.creation_time + row.deletion_time
                                                                 - row.scheduled_time)
            if departure <= arrival:
                report.skip("zero_duration")
                continue
        else:
            arrival, departure = float(k), None
        if milli == 0:
            rejected[name] = "gpu_milli 0 on a GPU pod"
            continue
        share = milli / 1000.0 if num_gpu == 1 else 1.0
        jobs.append(DemandJob(name, arrival, departure, declared_mem=quota_bytes(share, device_mem),
                              declared_util=share, gpus=int(num_gpu)))
    if not jobs:
        raise InvalidInput(f"openb pod list {path}: no GPU pod to replay ({report.as_dict()['skipped']})")
    report.jobs = len(jobs)
    return DemandTrace("openb", jobs, report, None, rejected, {"timed": timed})
