"""One comparison of the sweep simulator: a tuner on a benchmark, over seeds, one trial per GPU against Fluid."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from enforcer.sim.sweeps.data import Table
from enforcer.sim.sweeps.engine import Engine, RunResult
from enforcer.sim.sweeps.tuners import make_tuner
from enforcer.sweeps.fluid import FluidConfig
from enforcer.sweeps.speed import SpeedModel

MODES = ("static", "dynamic", "dynamic_noskip")


@dataclass(frozen=True)
class Comparison:
    baseline: list[RunResult]
    ours: dict[str, list[RunResult]]  # mode -> one run per seed
    speed: SpeedModel
    gpus: int

    def speedups(self, mode: str) -> list[float]:
        return [b.makespan / o.makespan for b, o in zip(self.baseline, self.ours[mode], strict=True)]

    def bound(self, run: RunResult) -> float:
        """max(sum of work / G, longest trial / (d * eta_d)): no schedule of these rounds is faster."""
        return max(run.work_s / self.gpus, run.longest_s / (self.speed.max_span * self.speed.dp_efficiency))

    def bound_ratio(self, mode: str) -> float:
        return statistics.median(o.makespan / self.bound(o) for o in self.ours[mode])

    def baseline_bound_ratio(self) -> float:
        return statistics.median(b.makespan / self.bound(b) for b in self.baseline)

    def late_gain_points(self, mode: str) -> float:
        return statistics.median(100.0 * (o.late_util - b.late_util)
                                 for b, o in zip(self.baseline, self.ours[mode], strict=True))


def run_baseline(algorithm: str, table: Table, seeds: list[int], speed: SpeedModel, gpus: int,
                 restart_s: float) -> list[RunResult]:
    return [Engine(make_tuner(algorithm, table, s, gpus), gpus, speed, None, restart_s).run() for s in seeds]


def compare(algorithm: str, table: Table, seeds: list[int], speed: SpeedModel, gpus: int, restart_s: float,
            baseline: list[RunResult] | None = None) -> Comparison:
    """The baseline (given, or run here) and the three Fluid modes on the same seeds."""
    base = baseline if baseline is not None else run_baseline(algorithm, table, seeds, speed, gpus, restart_s)
    ours: dict[str, list[RunResult]] = {}
    for mode in MODES:
        config = FluidConfig(gpus, speed, dynamic=mode != "static", restart_s=restart_s,
                             skip_unprofitable=mode != "dynamic_noskip")
        ours[mode] = [Engine(make_tuner(algorithm, table, s, gpus), gpus, speed, config, restart_s).run()
                      for s in seeds]
    return Comparison(base, ours, speed, gpus)
