"""Reader for Salus's workloads file, and the seeded 100-job Poisson workload Salus evaluates on one GPU."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enforcer.sim.model import GIB, NodeSpec, ReadReport, SimJob, Trace
from enforcer.sim.readers.common import numeric, read_csv
from store.errors import InvalidInput

COLUMNS = ("name", "jct_s", "peak_mem_mib", "iterations", "command")
MIB = 1024**2
# Salus's own devices (Titan X / P100 class) had 12-16 GiB; P100 16 GiB holds its largest workload (12.7 GiB).
SALUS_DEVICE_MEM = 16 * GIB


@dataclass(frozen=True, slots=True)
class SalusWorkload:
    name: str
    model: str
    batch: int
    jct_s: float
    peak_mem: int
    iterations: int


def read_salus_workloads(path: Path) -> tuple[list[SalusWorkload], ReadReport]:
    """The rows of salus_workloads.csv (no header): name, JCT alone (s), peak memory (MiB), iterations, command."""
    df, bad_lines = read_csv(path, "Salus workloads file", COLUMNS, header=False)
    report = ReadReport(str(path), rows=len(df) + bad_lines)
    report.skip("malformed", bad_lines)
    df, bad = numeric(df, ["jct_s", "peak_mem_mib", "iterations"])
    report.skip("malformed", bad)
    rows = []
    for name, jct, mem, iters, cmd in zip(df["name"], df["jct_s"], df["peak_mem_mib"], df["iterations"],
                                          df["command"], strict=True):
        if jct <= 0 or mem <= 0 or iters <= 0:
            report.skip("malformed")
            continue
        m = re.search(r"--model=(\w+)", cmd) or re.match(r"([a-z]+\d*)_", str(name))
        b = re.search(r"--batch_size=(\d+)", cmd)
        rows.append(
            SalusWorkload(str(name), m.group(1) if m else str(name), int(b.group(1)) if b else 0,
                          float(jct), int(mem * MIB), int(iters))
        )
    report.jobs = len(rows)
    return rows, report


def read_salus(
    path: Path,
    *,
    n_jobs: int = 100,
    seed: int = 0,
    load: float = 1.0,
    persistent_fraction: float = 0.1,
    device_mem: int = SALUS_DEVICE_MEM,
) -> Trace:
    """A Salus-style workload: `n_jobs` drawn (seeded, with replacement) from the workloads file, Poisson arrivals.

    The mean inter-arrival time is the mean run time of the jobs drawn divided by `load`, so `load` is the
    offered load on ONE device (1.0 = as much work arrives as one device can do). The file gives only the peak
    memory; Salus's profiles show most of it is ephemeral (per-iteration), so P = `persistent_fraction` x peak
    and E = the rest. The cluster is one device of `device_mem` bytes.
    """
    if n_jobs < 1:
        raise InvalidInput(f"a Salus workload needs at least one job, not {n_jobs} (--jobs)")
    if seed < 0:  # numpy's generator takes no negative seed
        raise InvalidInput(f"the random seed must be 0 or more, not {seed} (--seed)")
    if not 0 < load < math.inf:  # NaN too: its arrivals would all be NaN
        raise InvalidInput(f"the offered load must be a positive number, not {load} (--load)")
    workloads, report = read_salus_workloads(path)
    if not workloads:
        raise InvalidInput(f"Salus workloads file {path} has no usable row (skipped: {dict(report.skipped)})")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(workloads), size=n_jobs)
    chosen = [workloads[i] for i in picks]
    mean_work = float(np.mean([w.jct_s for w in chosen]))
    gaps = rng.exponential(mean_work / load, size=n_jobs)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    jobs = []
    for i, (w, t) in enumerate(zip(chosen, arrivals, strict=True)):
        p = int(w.peak_mem * persistent_fraction)
        jobs.append(
            SimJob(f"{i:03d}-{w.name}", float(t), w.jct_s, gpus=1, share=1.0, mem=w.peak_mem,
                   mem_persistent=p, mem_ephemeral=w.peak_mem - p, model=w.model, steps=w.iterations)
        )
    report.jobs = len(jobs)
    notes = {"seed": seed, "load": load, "n_jobs": n_jobs, "mean_interarrival_s": mean_work / load,
             "persistent_fraction": persistent_fraction}
    return Trace("salus", jobs, [NodeSpec("salus-0", 1, device_mem, "P100")], report, notes)
