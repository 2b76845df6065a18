"""Consolidation planning: sizing from observed history, guard moves, device-freeing moves, caps, memory never over."""

from __future__ import annotations

import random

import numpy as np
import pytest

from enforcer.consolidate import lane_bytes, plan_consolidation
from enforcer.consolidation_sizing import ConsolidateParams, JobDemand, size_job, size_jobs
from enforcer.lanes import lane_request
from store.errors import InvalidInput
from store.settings import Settings

GIB = 2**30
NOW = 100_000.0
P = ConsolidateParams(window_s=3600.0, min_history_s=900.0, downtime_s=30.0, horizon_s=3600.0)


def steady(job_id: str, device_id: int | None, gib: float, util: float = 0.2, minutes: int = 60,
           **kw) -> JobDemand:
    t = NOW - 60.0 * np.arange(minutes)[::-1]
    return JobDemand(job_id, device_id, t, np.full(minutes, gib * GIB), np.full(minutes, util), **kw)


def devices(n: int, gib: int = 80) -> list[tuple[int, int]]:
    return [(i, gib * GIB) for i in range(n)]


def assert_within_memory(plan) -> None:
    pk = plan.packing
    pk.fleet.check()
    for d in pk.fleet.devices:
        assert sum(lane.size for lane in d.lanes.values()) <= d.capacity


def test_size_from_recent_peak_and_p95():
    mem = np.concatenate([np.full(30, 30 * GIB), np.full(30, 10 * GIB)])  # the 30 GiB peak was over an hour ago
    t = NOW - 60.0 * np.arange(60)[::-1] * 3  # three hours of samples, every 3 minutes
    util = np.linspace(0.0, 1.0, 60)
    s = size_job(JobDemand("a", 0, t, mem, util), NOW, P)
    recent = t >= NOW - P.window_s
    assert s.mem == int(mem[recent].max()) == 10 * GIB
    assert s.util == pytest.approx(np.quantile(util[recent], 0.95))
    assert s.shareable and s.why == "steady"


def test_short_history_and_growth_keep_a_job_alone():
    assert size_job(steady("a", 0, 10, minutes=5), NOW, P).why == "short_history"
    t = NOW - 60.0 * np.arange(60)[::-1]
    growing = JobDemand("b", 0, t, np.linspace(5, 20, 60) * GIB, np.full(60, 0.1))
    s = size_job(growing, NOW, P)
    assert (s.shareable, s.why) == (False, "growing")
    assert size_job(JobDemand("c", declared_mem=GIB, declared_util=0.3), NOW, P).why == "declared"


def test_a_passing_spike_is_not_growth():
    # 30 GiB with a five-minute burst to 40 GiB lately: sized at the burst, but it may share
    spiky = steady("a", 0, 30)
    spiky.mem[-8:-3] = 40 * GIB
    s = size_job(spiky, NOW, P)
    assert (s.mem, s.shareable, s.why) == (40 * GIB, True, "steady")


def test_sizing_many_jobs_at_once_matches_each_job_alone():
    rng = np.random.default_rng(3)
    demands = []
    for k in range(40):
        n = int(rng.integers(1, 300))
        span = 600.0 if k % 7 == 0 else 3 * P.window_s  # some jobs just came; some have nothing in the window
        t = NOW - np.sort(rng.uniform(0, span, n))[::-1]
        util = rng.uniform(0, 1, n)
        util[rng.uniform(0, 1, n) < 0.1] = np.nan
        mem = rng.uniform(1, 30, n) * GIB
        if k % 3 == 0:
            mem[int(n * 0.95):] += 40 * GIB  # a new level lately: growing
        demands.append(JobDemand(f"j{k}", 0, t, mem, util))
    sizes = size_jobs(demands, NOW, P)
    for d in demands:
        lo = int(np.searchsorted(d.times, NOW - P.window_s))
        lo = 0 if lo >= len(d.times) else lo
        u = np.nan_to_num(d.util[lo:], nan=1.0)
        assert sizes[d.job_id].mem == int(d.mem[lo:].max())
        assert sizes[d.job_id].util == pytest.approx(float(np.quantile(u, 0.95)))
        mid = int(np.searchsorted(d.times, NOW - P.window_s / 4))
        growing = lo < mid < len(d.times) and np.median(d.mem[mid:]) > d.mem[lo:mid].max() * (1 + P.growth)
        assert sizes[d.job_id].why == ("short_history" if d.times[-1] - d.times[0] < P.min_history_s
                                       else "growing" if growing else "steady")
    assert {s.why for s in sizes.values()} == {"short_history", "growing", "steady"}


def test_a_history_with_readings_missing_is_refused_by_name():
    bad = steady("b", 1, 10)
    bad.util = bad.util[:-1]
    with pytest.raises(InvalidInput, match="job 'b': 60 sample times, 60 memory and 59 utilisation"):
        size_jobs([steady("a", 0, 10), bad, steady("c", 2, 10)], NOW, P)


def test_two_half_empty_devices_become_one():
    plan = plan_consolidation(devices(3), [steady("a", 0, 20), steady("b", 1, 20)], NOW, P)
    assert len(plan.moves) == 1 and plan.moves[0].reason == "free_device"
    assert plan.devices_held == 2 and plan.devices_needed == 1
    assert plan.devices_freed == [plan.moves[0].from_device_id]
    assert_within_memory(plan)


def test_no_move_when_it_frees_nothing_or_costs_more_than_it_returns():
    # 50 + 50 GiB do not fit one 80 GiB device with Salus's headroom: keeping both is the plan
    plan = plan_consolidation(devices(3), [steady("a", 0, 50), steady("b", 1, 50)], NOW, P)
    assert plan.moves == [] and plan.devices_needed == 2
    # a job with more unsaved work than the freed device returns over the horizon stays
    costly = [steady("a", 0, 20, since_checkpoint_s=2 * P.horizon_s), steady("b", 1, 20,
                                                                            since_checkpoint_s=2 * P.horizon_s)]
    assert plan_consolidation(devices(3), costly, NOW, P).moves == []
    # short histories are never co-located
    assert plan_consolidation(devices(3), [steady("a", 0, 20, minutes=5), steady("b", 1, 20, minutes=5)],
                              NOW, P).moves == []


def test_the_device_cheapest_to_drain_is_emptied():
    # b is smaller, but has twenty minutes of work since its last checkpoint: a moves to b
    plan = plan_consolidation(devices(2), [steady("a", 0, 20), steady("b", 1, 10, since_checkpoint_s=1200.0)],
                              NOW, P)
    assert [(m.job_id, m.from_device_id, m.to_device_id) for m in plan.moves] == [("a", 0, 1)]
    # with nothing to lose on either, the device with more free memory goes first
    plan = plan_consolidation(devices(2), [steady("a", 0, 20), steady("b", 1, 10)], NOW, P)
    assert [(m.job_id, m.from_device_id, m.to_device_id) for m in plan.moves] == [("b", 1, 0)]


def test_move_caps_per_job_per_day_and_per_cycle():
    moved_twice = [NOW - 3600.0, NOW - 7200.0]
    jobs = [steady("a", 0, 20, moves=list(moved_twice)), steady("b", 1, 20, moves=list(moved_twice))]
    assert plan_consolidation(devices(3), jobs, NOW, P).moves == []
    # a day later the cap has passed
    old = [NOW - 2 * 86400.0]
    assert len(plan_consolidation(devices(3), [steady("a", 0, 20, moves=old), steady("b", 1, 20, moves=old)],
                                  NOW, P).moves) == 1
    many = [steady(f"j{i}", i, 10) for i in range(12)]
    capped = ConsolidateParams(window_s=P.window_s, min_history_s=P.min_history_s, max_moves_per_cycle=3)
    assert len(plan_consolidation(devices(12), many, NOW, capped).moves) == 3
    assert len(plan_consolidation(devices(12), many, NOW, P).moves) > 3


def test_guard_moves_a_job_whose_memory_grew_toward_its_share():
    # a and b were co-located at 30 GiB each; b's recent peak is now 45 GiB: both lanes no longer fit 80 GiB
    a = steady("a", 0, 30, since_checkpoint_s=600.0)
    b = steady("b", 0, 30)
    b.mem[-10:] = 45 * GIB
    plan = plan_consolidation(devices(2), [a, b], NOW, P)
    assert [(m.job_id, m.reason, m.from_device_id, m.to_device_id) for m in plan.moves] == [
        ("b", "guard_memory", 0, 1)]
    assert_within_memory(plan)
    # the one with less work to lose is the one that goes, even when it is not the one that grew
    a = steady("a", 0, 30)
    b = steady("b", 0, 30, since_checkpoint_s=600.0)
    b.mem[-10:] = 45 * GIB
    assert [m.job_id for m in plan_consolidation(devices(2), [a, b], NOW, P).moves] == ["a"]
    # both still fit: nothing moves
    assert plan_consolidation(devices(2), [steady("a", 0, 30), steady("b", 0, 30)], NOW, P).moves == []


def test_guard_compute_over_the_cap():
    plan = plan_consolidation(devices(2), [steady("a", 0, 10, util=0.7), steady("b", 0, 10, util=0.6)], NOW, P)
    assert [m.reason for m in plan.moves] == ["guard_compute"]
    assert plan.packing.util.max() <= P.util_cap


def test_unmovable_jobs_stay():
    plan = plan_consolidation(devices(3), [steady("a", 0, 20, movable=False), steady("b", 1, 20, movable=False)],
                              NOW, P)
    assert plan.moves == []


def test_a_guard_move_never_moves_a_job_that_did_not_opt_in():
    # two jobs that did not opt in ask more compute than the guard allows: neither moves, the device takes nobody
    stuck = [steady("a", 0, 10, util=0.7, movable=False), steady("b", 0, 10, util=0.6, movable=False)]
    plan = plan_consolidation(devices(2), [*stuck, steady("c", 1, 5, util=0.1)], NOW, P)
    assert plan.moves == [] and set(plan.unresolved) == {"b"}
    # beside one that opted in, that one is moved off, though it has more work to lose
    mixed = [steady("a", 0, 10, util=0.7, movable=False), steady("b", 0, 10, util=0.6, since_checkpoint_s=900.0)]
    plan = plan_consolidation(devices(2), mixed, NOW, P)
    assert [(m.job_id, m.reason) for m in plan.moves] == [("b", "guard_compute")] and plan.unresolved == {}


def test_never_plans_a_device_over_its_memory_random_fleets():
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randint(2, 12)
        devs = [(i, rng.choice([24, 40, 80]) * GIB) for i in range(n)]
        jobs = []
        for k in range(rng.randint(1, 2 * n)):
            dev = rng.randrange(n)
            jobs.append(steady(f"j{k}", dev, rng.uniform(0.5, 18), util=rng.uniform(0, 0.6),
                               minutes=rng.choice([5, 60])))
        plan = plan_consolidation(devs, jobs, NOW, P)
        assert_within_memory(plan)
        where = {m.job_id: m.to_device_id for m in plan.moves}
        caps = dict(devs)
        for m in plan.moves:
            s = plan.sizes[m.job_id]
            assert lane_bytes(s, caps[m.to_device_id]) <= caps[m.to_device_id]
        assert len(where) == len(plan.moves)  # a job moves at most once per cycle


def test_params_come_from_settings():
    s = Settings(consolidate_window_s=1234.0, consolidate_max_moves_per_job_day=5)
    p = ConsolidateParams.from_settings(s)
    assert (p.window_s, p.max_moves_per_job_day) == (1234.0, 5)
    assert Settings().consolidate_interval_s == 900.0
    assert lane_request(10 * GIB, 0, 80 * GIB)[1] > 10 * GIB  # Salus's headroom is what sizing adds


# ---- storage: a job moves only to a host that can read its checkpoint location ---------------------------------

HOSTS = {0: "h1", 1: "h2", 2: "h3", 3: "h1"}


def three_hosts(readable: frozenset[str] | None) -> list[JobDemand]:
    """A small movable job on h1's device 0; jobs that stay on h2 (the fuller: best fit) and h3."""
    return [steady("a", 0, 5, readable_hosts=readable), steady("b", 1, 40, movable=False),
            steady("c", 2, 20, movable=False)]


def test_a_consolidation_move_goes_only_to_a_host_that_can_read_the_checkpoints():
    # without storage facts (the simulator) best fit picks h2's fuller device
    anywhere = plan_consolidation(devices(3), three_hosts(None), NOW, P, hosts=HOSTS)
    assert [(m.job_id, m.to_device_id) for m in anywhere.moves] == [("a", 1)] and anywhere.refused == []
    # h2 cannot read a's checkpoint location, h3 can: a goes to h3, and device 0 still comes free
    plan = plan_consolidation(devices(3), three_hosts(frozenset({"h3"})), NOW, P, hosts=HOSTS)
    assert [(m.job_id, m.from_device_id, m.to_device_id) for m in plan.moves] == [("a", 0, 2)]
    assert plan.devices_freed == [0] and plan.refused == []
    assert_within_memory(plan)


def test_a_device_is_not_emptied_when_its_job_could_only_go_where_its_checkpoints_cannot_be_read():
    plan = plan_consolidation(devices(3), three_hosts(frozenset()), NOW, P, hosts=HOSTS)
    assert plan.moves == [] and plan.devices_freed == [] and plan.devices_needed == 3
    (refusal,) = plan.refused
    assert (refusal["workflow_id"], refusal["from_device_id"], refusal["to_device_id"], refusal["to_host"]) == (
        "a", 0, 1, "h2")
    assert "cannot read its checkpoint location" in refusal["reason"] and "runs on where it is" in refusal["reason"]
    assert plan.unresolved == {} and plan.summary()["refused"] == plan.refused
    # a job that fits nowhere at all is not blamed on storage
    big = three_hosts(frozenset())
    big[0] = steady("a", 0, 60, readable_hosts=frozenset())
    assert plan_consolidation(devices(3), big, NOW, P, hosts=HOSTS).refused == []
    # a device of its own host is always readable: a moves there (device 3 on h1 holds a job too)
    own = [*three_hosts(frozenset()), steady("d", 3, 30, movable=False)]
    plan = plan_consolidation(devices(4), own, NOW, P, hosts=HOSTS)
    assert [(m.job_id, m.to_device_id) for m in plan.moves] == [("a", 3)] and plan.refused == []


def grown(readable: frozenset[str] | None, extra: list[JobDemand] = ()) -> list[JobDemand]:
    """x and y share h1's device 0; y's memory grew (it may no longer share) so both no longer fit. Empty devices
    wait on h2 (device 1, a guard move's first choice) and h3 (device 2)."""
    x = steady("x", 0, 45, since_checkpoint_s=600.0)
    y = steady("y", 0, 20, readable_hosts=readable)
    y.mem[-10:] = 30 * GIB
    return [x, y, *extra]


def test_a_guard_move_goes_to_a_host_that_can_read_the_checkpoints_or_the_job_stays_with_the_reason():
    anywhere = plan_consolidation(devices(3), grown(None), NOW, P, hosts=HOSTS)
    assert [(m.job_id, m.reason, m.to_device_id) for m in anywhere.moves] == [("y", "guard_memory", 1)]
    readable = plan_consolidation(devices(3), grown(frozenset({"h3"})), NOW, P, hosts=HOSTS)
    assert [(m.job_id, m.reason, m.to_device_id) for m in readable.moves] == [("y", "guard_memory", 2)]
    assert readable.refused == []
    assert_within_memory(readable)
    kept = plan_consolidation(devices(3), grown(frozenset()), NOW, P, hosts=HOSTS)
    assert kept.moves == [] and "y" not in kept.unresolved
    (refusal,) = kept.refused
    assert (refusal["workflow_id"], refusal["from_device_id"], refusal["to_device_id"], refusal["to_host"]) == (
        "y", 0, 1, "h2")
    # an empty device of its own host takes it
    alone = plan_consolidation(devices(4), grown(frozenset()), NOW, P, hosts=HOSTS)
    assert [(m.job_id, m.to_device_id) for m in alone.moves] == [("y", 3)] and alone.refused == []


def test_the_device_a_refused_guard_move_leaves_over_its_share_takes_nobody():
    # z on h2 would fit next to x on device 0 were y not still running there
    z = steady("z", 3, 8)
    plan = plan_consolidation(devices(4), grown(frozenset(), [z]), NOW, P, hosts={**HOSTS, 3: "h2"})
    assert [r["workflow_id"] for r in plan.refused] == ["y"] and plan.moves == []
    # with y gone from the plan's view (it moved to h3), z joins x
    plan = plan_consolidation(devices(4), grown(frozenset({"h3"}), [z]), NOW, P, hosts={**HOSTS, 3: "h2"})
    assert [(m.job_id, m.to_device_id) for m in plan.moves] == [("y", 2), ("z", 0)]
