"""Checks every simulator run must pass: every job finishes, work and device-time are conserved."""

from __future__ import annotations

import math
from collections import defaultdict

from enforcer.sim.metrics import SimResult


def device_seconds_from_intervals(result: SimResult) -> float:
    """Device-time allocated, recomputed from each job's (device, on, off) intervals: the union per device."""
    per_device: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for js in result.sim.jobs:
        for pos, on, off in js.intervals:
            per_device[pos].append((on, off))
    total = 0.0
    for spans in per_device.values():
        spans.sort()
        cur_on, cur_off = spans[0]
        for on, off in spans[1:]:
            if on > cur_off:
                total += cur_off - cur_on
                cur_on, cur_off = on, off
            else:
                cur_off = max(cur_off, off)
        total += cur_off - cur_on
    return total


def assert_invariants(result: SimResult) -> None:
    m = result.metrics
    assert m["unfinished"] == 0 and m["finished"] + m["unplaceable"] == m["jobs"], m
    for js in result.sim.jobs:
        if js.job.job_id in result.sim.unplaceable:
            continue
        assert js.finish is not None and js.start is not None and js.finish >= js.start >= js.sim.arrival - 1e-6
        # work conserved: what the job was served is its work plus any restart cost, no more, no less
        assert math.isclose(js.served, js.sim.work + js.overhead, rel_tol=1e-6, abs_tol=1e-3), (
            js.job.job_id, js.served, js.sim.work, js.overhead)
        # a job never runs faster than alone: its time on devices is at least its work
        on_device = sum(off - on for _, on, off in js.intervals) / js.sim.gpus
        assert on_device >= js.sim.work - 1e-3, (js.job.job_id, on_device, js.sim.work)
    # device-time conserved: the metric equals the union of the jobs' device intervals
    assert math.isclose(device_seconds_from_intervals(result), m["device_hours"] * 3600, rel_tol=1e-6, abs_tol=1e-3)
    assert 0.0 <= m["fragmentation"] <= 1.0 and 0.0 <= m["util_mean"] <= 1.0 + 1e-9
    # no device ever held more jobs at once than memory allowed: check=True asserted it at every event
    assert result.sim.check
