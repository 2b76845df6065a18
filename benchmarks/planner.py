"""Planner speed: a plan for 10,000 devices and 20,000 jobs, against a naive first-fit on the same fleet; and one
consolidation cycle (enforcer.consolidate) on a fleet of that size.

Prints one JSON line per move limit: wall and CPU seconds of our plan (Salus lanes, PACK, co-location cap; the
machine is shared, so CPU seconds are the steadier figure), moves, devices freed; the last line adds the anchor.
The anchor moves each flagged job to the first in-use device with enough free memory, scanning devices in order,
and counts a device freed when all its jobs went; it knows no lanes, no slowdown and no move limit.
The consolidation line: 10,000 devices, 20,000 jobs with two hours of per-minute memory and utilisation each; the
plan sizes every job from its history, loads the placement through Salus's lanes and plans one cycle's moves.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

from enforcer.consolidate import plan_consolidation
from enforcer.consolidation_sizing import ConsolidateParams, JobDemand
from enforcer.planner import Holding, PlanDevice, plan_moves
from store.settings import Settings

GIB = 2**30


def fleet(n_devices: int = 10_000, n_jobs: int = 20_000, seed: int = 0) -> tuple[list[PlanDevice], list[Holding]]:
    rng = random.Random(seed)
    devices = [PlanDevice(i, (80 if i % 4 == 0 else 40) * GIB, host=f"h{i // 8}", kind="A100")
               for i in range(n_devices)]
    holdings = []
    for j in range(n_jobs):
        device = j % n_devices
        idle = rng.random() < 0.3
        cap = devices[device].capacity
        p = int(rng.uniform(0.02, 0.12 if idle else 0.3) * cap)
        holdings.append(Holding(
            workflow_id=f"job-{j}", device_id=device, persistent=p, ephemeral=int(p * rng.uniform(0, 0.5)),
            util=rng.uniform(0.0, 0.1) if idle else rng.uniform(0.2, 0.9), movable=rng.random() < 0.8,
            rules=("idle_holder",) if idle else (), lane_id=None,
        ))
    return devices, holdings


def naive_first_fit(devices: list[PlanDevice], holdings: list[Holding]) -> tuple[int, int]:
    used = {d.device_id: 0 for d in devices}
    on: dict[int, list[Holding]] = {}
    for h in holdings:
        used[h.device_id] += int((h.persistent or 0) * 1.1) + h.ephemeral
        on.setdefault(h.device_id, []).append(h)
    cap = {d.device_id: d.capacity for d in devices}
    freed = moves = 0
    emptied: set[int] = set()
    for d in devices:
        jobs = on.get(d.device_id, [])
        if not jobs or not all(h.movable and h.rules for h in jobs):
            continue
        plan = []
        for h in jobs:
            need = int((h.persistent or 0) * 1.1) + h.ephemeral
            target = next((t.device_id for t in devices if t.device_id != d.device_id and t.device_id not in emptied
                           and on.get(t.device_id) and cap[t.device_id] - used[t.device_id] >= need), None)
            if target is None:
                break
            used[target] += need
            plan.append((target, need))
        if len(plan) < len(jobs):
            for target, need in plan:
                used[target] -= need
            continue
        emptied.add(d.device_id)
        used[d.device_id] = 0
        moves += len(plan)
        freed += 1
    return moves, freed


def consolidation_fleet(n_devices: int = 10_000, n_jobs: int = 20_000, minutes: int = 120, seed: int = 0
                        ) -> tuple[list[tuple[int, int]], list[JobDemand], float]:
    """Devices of 80 and 40 GiB, two jobs each, every job with `minutes` of per-minute history: (devices, jobs,
    now)."""
    rng = np.random.default_rng(seed)
    devices = [(i, (80 if i % 4 == 0 else 40) * GIB) for i in range(n_devices)]
    now = 1e9
    t = now - 60.0 * np.arange(minutes)[::-1]
    demands = []
    for j in range(n_jobs):
        d = j % n_devices
        mem = np.full(minutes, rng.uniform(0.02, 0.3) * devices[d][1])
        demands.append(JobDemand(f"job-{j}", d, t, mem, rng.uniform(0.0, 0.2, minutes)))
    return devices, demands, now


def consolidation_speed(repeats: int = 3) -> dict:
    devices, demands, now = consolidation_fleet()
    params = ConsolidateParams.from_settings(Settings())
    runs = []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_consolidation(devices, demands, now, params)
        runs.append((time.perf_counter() - t0, time.process_time() - c0))
    wall, cpu = min(runs)
    return {"case": "consolidate_plan_10k_devices_20k_jobs", "seconds": round(wall, 3),
            "seconds_each_run": [round(w, 3) for w, _ in runs], "cpu_seconds": round(cpu, 3),
            "moves": len(plan.moves), "devices_freed": len(plan.devices_freed), "target_s": 1.0}


def main() -> None:
    devices, holdings = fleet()
    for max_moves in (4, 1_000, 20_000):
        print(f"planning {len(devices)} devices, {len(holdings)} jobs, max_moves={max_moves}", file=sys.stderr)
        t0, c0 = time.perf_counter(), time.process_time()
        result = plan_moves(devices, holdings, "pack", max_moves=max_moves)
        ours, cpu = time.perf_counter() - t0, time.process_time() - c0
        line = {
            "case": f"planner_10k_devices_20k_jobs_max_moves_{max_moves}",
            "seconds": round(ours, 4), "cpu_seconds": round(cpu, 4),
            "moves": len(result.moves), "devices_freed": len(result.devices_freed),
            "max_expected_slowdown": result.summary()["max_expected_slowdown"], "target_s": 1.0,
        }
        if max_moves == 20_000:
            t0 = time.perf_counter()
            n_moves, n_freed = naive_first_fit(devices, holdings)
            naive = time.perf_counter() - t0
            line.update(anchor="naive first-fit (no lanes, no slowdown cap, no move limit)",
                        anchor_seconds=round(naive, 4), anchor_moves=n_moves, anchor_devices_freed=n_freed,
                        time_ratio_ours_over_anchor=round(ours / naive, 2),
                        freed_ratio_ours_over_anchor=round(len(result.devices_freed) / max(n_freed, 1), 3))
        print(json.dumps(line))
    print("one consolidation cycle on 10,000 devices and 20,000 jobs", file=sys.stderr)
    print(json.dumps(consolidation_speed()))


if __name__ == "__main__":
    main()
