"""A case small enough to work out by hand, where each policy's answer is known exactly."""

from __future__ import annotations

import pytest

from enforcer.sim.adapter import make_policy
from enforcer.sim.engine import Simulation
from enforcer.sim.model import GIB, NodeSpec, SimJob
from tests.sim.invariants import assert_invariants

CLUSTER = [NodeSpec("n0", 1, 10 * GIB)]


def jobs() -> list[SimJob]:
    # small memory (all fit one lane of the 10 GiB device) and low utilisation (0.1: the co-location model gives
    # speed 1.0 for any two or three of them side by side), so only the policies' choices matter
    mk = lambda name, t, w: SimJob(name, t, w, mem=GIB + GIB // 10, mem_persistent=GIB // 10,  # noqa: E731
                                   mem_ephemeral=GIB, util=0.1)
    return [mk("A", 0.0, 10.0), mk("B", 1.0, 2.0), mk("C", 2.0, 4.0)]


def run(policy, **kw):
    result = Simulation(jobs(), CLUSTER, policy, check=True, **kw).run()
    assert_invariants(result)
    return {r.id: r.finish for r in result.jobs.itertuples()}, result.metrics


def test_fifo_exclusive():
    """FIFO, whole device, arrival order: A 0-10, B 10-12, C 12-16.
    JCT A 10, B 11, C 14: mean 35/3; makespan 16; one device held 16 s."""
    finish, m = run(make_policy("fifo"))
    assert finish == pytest.approx({"A": 10, "B": 12, "C": 16})
    assert m["jct_mean_s"] == pytest.approx(35 / 3)
    assert m["device_hours"] * 3600 == pytest.approx(16)
    assert m["queue_delay_mean_s"] == pytest.approx((0 + 9 + 10) / 3)


def test_pack_runs_side_by_side():
    """PACK: three lanes of 1.1655 GiB fit the device and the slowdown cap allows it (speed 1.0 at util 0.1),
    so all run at once: A 0-10, B 1-3, C 2-6. JCT 10, 2, 4: mean 16/3; one device held 10 s."""
    finish, m = run(make_policy("pack"))
    assert finish == pytest.approx({"A": 10, "B": 3, "C": 6})
    assert m["jct_mean_s"] == pytest.approx(16 / 3)
    assert m["device_hours"] * 3600 == pytest.approx(10)
    assert m["devices_needed"] == 1


def test_srtf_one_lane():
    """SRTF, one lane, preempting at iterations: A runs 0-1 (9 left); B (2) arrives and runs 1-3 (C arriving
    at 2 with 4 does not beat B's 1 left); C runs 3-7; A runs 7-16. JCT A 16, B 2, C 5: mean 23/3."""
    finish, m = run(make_policy("srtf", one_lane=True))
    assert finish == pytest.approx({"A": 16, "B": 3, "C": 7})
    assert m["jct_mean_s"] == pytest.approx(23 / 3)


def test_fair_one_lane_least_attained():
    """FAIR, one lane, least attained service: A alone 0-1 (attained 1); B runs alone 1-2 (catches up to 1);
    C alone 2-3; from 3 all three have 1 and share a third each: B needs 1 more, done at 6 (A, C at 2); A and
    C share halves: C needs 2 more, done at 10; A has 6 left, done at 16. JCT A 16, B 5, C 8: mean 29/3."""
    finish, m = run(make_policy("fair", one_lane=True))
    assert finish == pytest.approx({"A": 16, "B": 6, "C": 10})
    assert m["jct_mean_s"] == pytest.approx(29 / 3)


def test_tiresias_two_queues_with_migration_cost():
    """Tiresias, one queue threshold at 3 device-seconds, migration cost 1 s: A runs 0-3 and drops to queue 1;
    B (queue 0) preempts it and runs 3-5; C runs 5-8 and drops to queue 1 with 1 left; A (earlier arrival)
    restarts at 8 with 7 + 1 s to do, done at 16; C restarts with 1 + 1, done at 18.
    JCT A 16, B 4, C 16: mean 12; two preemptions."""
    finish, m = run(make_policy("tiresias", thresholds=(3.0,)), migration_cost_s=1.0)
    assert finish == pytest.approx({"A": 16, "B": 5, "C": 18})
    assert m["jct_mean_s"] == pytest.approx(12)
    assert m["preemptions"] == 2


@pytest.mark.parametrize("policy", ["fifo", "pack"])
def test_a_multi_device_job_no_node_has_enough_big_devices_for_is_reported_not_left_waiting(policy):
    # node a has 8 devices, but of 16 GiB; node b's are big enough for the job's 40 GiB, but there are 2 of them
    cluster = [NodeSpec("a", 8, 16 * GIB), NodeSpec("b", 2, 80 * GIB)]
    big = [SimJob("big", 0.0, 100.0, gpus=4, mem=40 * GIB), SimJob("small", 1.0, 50.0, mem=GIB)]
    result = Simulation(big, cluster, make_policy(policy), check=True).run()
    assert_invariants(result)
    assert result.sim.unplaceable == ["big"]
    assert "needs 4 devices of 44.0 GiB on one node; the most any node has is 2" in \
        result.sim.unplaceable_reasons["big"]
