"""What a simulation run measured: devices needed, device-hours, completion times, utilisation, fragmentation.

Definitions (all over the run, from the first arrival to the last completion):
- devices_needed: the most devices holding at least one job at the same time.
- device_hours: device-time allocated, i.e. the time each device held at least one job, summed.
- jct: completion minus arrival; queue_delay: first start minus arrival; stretch: jct / work alone (none for a
  job of no work).
- util_mean: device-time-weighted utilisation of the allocated devices, each device's utilisation being the sum
  of its running jobs' demand (measured utilisation, else compute share) times their current speed, capped at 1.
- fragmentation (the openb literature's GPU fragmentation, simplified): capacity that is unallocated yet sits on
  a partially allocated device, so a job asking for a whole device cannot use it. `fragmentation` is that
  stranded capacity as a share of allocated device-time; `frag_gpus` its time-averaged amount in devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd


@dataclass
class SimResult:
    policy: str
    metrics: dict[str, Any]
    jobs: pd.DataFrame  # one row per job: id, arrival, start, finish, work, gpus, share, jct, queue, preemptions
    busy: list[tuple[float, int]]  # (time, devices holding a job)
    queue: list[tuple[float, int]]  # (time, jobs waiting)
    sim: Any = field(default=None, repr=False)  # the Simulation (invariant checks read it)


def summarize(sim) -> SimResult:
    rows = []
    for js in sim.jobs:
        rows.append({
            "id": js.job.job_id, "arrival": js.sim.arrival, "start": js.start, "finish": js.finish,
            "work": js.sim.work, "gpus": js.sim.gpus, "share": js.sim.share, "served": js.served,
            "overhead": js.overhead, "preemptions": js.preemptions,
        })
    df = pd.DataFrame(rows, columns=["id", "arrival", "start", "finish", "work", "gpus", "share", "served",
                                     "overhead", "preemptions"])
    df["jct"] = df["finish"] - df["arrival"]
    df["queue"] = df["start"] - df["arrival"]
    # a job of no work has no stretch (it is left out of the mean, not counted infinite nor a division error)
    df["stretch"] = df["jct"].astype("float64") / df["work"].astype("float64").where(df["work"] > 0)
    done = df[df["finish"].notna()]
    t0 = float(df["arrival"].min()) if len(df) else 0.0
    t1 = float(done["finish"].max()) if len(done) else t0
    makespan = t1 - t0
    busy_s = sim.integrals["busy"]
    unplaceable = set(sim.unplaceable)
    metrics = {
        "policy": sim.policy.name,
        "jobs": len(df),
        "finished": int(len(done)),
        "unplaceable": len(unplaceable),
        "unfinished": int(len(df) - len(done) - len(unplaceable)),
        "devices": len(sim.fleet.devices),
        "devices_needed": int(max((n for _, n in sim.busy_series), default=0)),
        "device_hours": busy_s / 3600.0,
        "jct_mean_s": _f(done["jct"].mean()),
        "jct_p95_s": _f(done["jct"].quantile(0.95)),
        "makespan_s": makespan,
        "util_mean": sim.integrals["util"] / busy_s if busy_s > 0 else 0.0,
        "queue_delay_mean_s": _f(done["queue"].mean()),
        "queue_delay_p95_s": _f(done["queue"].quantile(0.95)),
        "stretch_mean": _f(done["stretch"].mean()),
        "fragmentation": sim.integrals["frag"] / busy_s if busy_s > 0 else 0.0,
        "frag_gpus": sim.integrals["frag"] / makespan if makespan > 0 else 0.0,
        "preemptions": int(df["preemptions"].sum()),
        "migration_hours": float(df["overhead"].sum()) / 3600.0,
        "events": sim.n_events,
    }
    return SimResult(sim.policy.name, metrics, df, list(sim.busy_series), list(sim.queue_series), sim)


def _f(x) -> float:
    return float(x) if x is not None and not np.isnan(x) else 0.0
