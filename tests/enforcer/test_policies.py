"""Policies: placement (filter -> score -> bind) and in-lane ordering, on small fleets worked out by hand."""

from __future__ import annotations

import pytest

from enforcer.lane_fleet import Fleet
from enforcer.lanes import Job
from enforcer.policies import Policy, get_policy, policy_names, register
from store.errors import InvalidInput

GB = 2**30


def fleet_of(n: int, capacity: int = 16 * GB, hosts: int = 1) -> Fleet:
    fleet = Fleet()
    for i in range(n):
        fleet.add_device(100 + i, capacity, kind="T4", host=f"h{i % hosts}")
    return fleet


def small(name: str, util: float = 0.2, **kw) -> Job:
    return Job(name, persistent=GB, ephemeral=GB // 2, util=util, **kw)


def test_get_policy_knows_the_four_and_refuses_others() -> None:
    assert policy_names() == ["fair", "fifo", "pack", "srtf"]
    assert get_policy("PACK").name == "pack"
    with pytest.raises(InvalidInput, match=r"unknown policy 'lifo'; known policies: fair, fifo, pack, srtf"):
        get_policy("lifo")


def test_pack_uses_fewest_devices_fair_spreads_fifo_takes_whole_devices() -> None:
    used = {}
    for name in ("pack", "fair", "fifo"):
        fleet, policy = fleet_of(4), get_policy(name)
        for k in range(4):
            assert policy.assign(small(f"j{k}"), fleet) is not None
        fleet.check()
        used[name] = fleet.devices_in_use()
    assert used == {"pack": 1, "fair": 4, "fifo": 4}


def test_fifo_waits_when_no_device_is_empty() -> None:
    fleet, fifo = fleet_of(1), get_policy("fifo")
    assert fifo.assign(small("a"), fleet)[0].exclusive
    assert fifo.place(small("b"), fleet) is None


def test_pack_caps_co_location_by_expected_slowdown() -> None:
    fleet, pack = fleet_of(2), get_policy("pack", max_slowdown=1.2)
    pack.assign(small("hot1", util=0.9), fleet)
    # memory would fit next to the busy job, but two 0.9-utilisation jobs slow each other down past 1.2x
    adm = pack.assign(small("hot2", util=0.9), fleet)
    assert adm[0].device_id != fleet.where("hot1")[0][0]
    # a light job still packs next to a busy one
    adm = pack.assign(small("light", util=0.05), fleet)
    assert pack.expected_slowdown(small("x", util=0.05), fleet, adm[0]) <= 1.2
    assert fleet.devices_in_use() == 2


def test_place_leaves_the_fleet_unchanged() -> None:
    fleet, pack = fleet_of(2), get_policy("pack")
    before = [d.free for d in fleet.devices]
    assert pack.place(small("a"), fleet) is not None
    assert [d.free for d in fleet.devices] == before and fleet.where("a") == []


def test_memory_decides_and_big_jobs_wait() -> None:
    fleet, pack = fleet_of(2, capacity=8 * GB), get_policy("pack")
    big = Job("big", persistent=5 * GB, ephemeral=GB, util=0.1)
    pack.assign(big, fleet)
    second = pack.assign(Job("big2", persistent=5 * GB, ephemeral=GB, util=0.1), fleet)
    assert second[0].device_id != fleet.where("big")[0][0]  # 6.9 GB lanes: two do not fit in 8 GB
    assert pack.place(Job("big3", persistent=5 * GB, ephemeral=GB, util=0.1), fleet) is None
    assert pack.place(Job("too-big", persistent=8 * GB), fleet) is None


def test_kinds_restrict_devices() -> None:
    fleet = fleet_of(2)
    fleet.add_device(999, 32 * GB, kind="V100", host="h9")
    adm = get_policy("fair").place(small("v", kinds=frozenset({"V100"})), fleet)
    assert adm[0].device_id == 999


def test_multi_device_jobs_get_whole_devices_on_one_host() -> None:
    fleet = fleet_of(6, hosts=2)  # h0: 100,102,104  h1: 101,103,105
    pack = get_policy("pack")
    pack.assign(small("s"), fleet)  # takes 100 on h0
    gang = pack.assign(Job("g", GB, 0, gpus=2), fleet)
    assert len(gang) == 2 and all(a.exclusive for a in gang)
    hosts = {fleet.device(a.device_id).host for a in gang}
    assert hosts == {"h0"}  # PACK picks the host with the fewest empty devices that still has two
    assert pack.place(Job("g3", GB, 0, gpus=3), fleet).__len__() == 3
    assert pack.place(Job("g4", GB, 0, gpus=4), fleet) is None


def test_ordering_inside_a_lane() -> None:
    a = Job("a", arrival=0.0, attained_s=500.0, remaining_s=900.0)
    b = Job("b", arrival=5.0, attained_s=100.0, remaining_s=50.0)
    c = Job("c", arrival=9.0, attained_s=300.0, remaining_s=None)
    jobs = [c, b, a]
    assert get_policy("fifo").pick_next(jobs) is a
    assert get_policy("pack").pick_next(jobs) is a  # Salus PACK: arrival order
    assert get_policy("fair").pick_next(jobs) is b  # least attained device time
    assert get_policy("srtf").pick_next(jobs) is b  # least remaining time
    assert [j.job_id for j in get_policy("srtf").queue_order(jobs)] == ["b", "a", "c"]  # unknown goes last
    assert get_policy("fair").pick_next([]) is None


def test_expected_slowdown_counts_turns_in_a_lane_and_neighbours() -> None:
    fleet, pack = fleet_of(1, capacity=5 * GB // 2), get_policy("pack", max_slowdown=10.0)
    pack.assign(Job("a", GB, GB // 2, util=0.6), fleet)
    pack.assign(Job("b", GB // 2, 0, util=0.3), fleet)  # second lane
    device = fleet.devices[0]
    assert len(device.lanes) == 2
    # a third job must join a lane (no memory for a new one): it takes turns there and feels the other lane
    job = Job("c", 0, GB // 4, util=0.5)
    adm = pack.place(job, fleet)[0]
    assert not adm.new_lane
    lane = device.lanes[adm.lane_id]
    expected = max(1.0, 0.5 + lane.demand) / pack.model.speed(0.5, device.demand - lane.demand)
    assert pack.expected_slowdown(job, fleet, adm) == pytest.approx(expected)


def test_register_adds_a_policy() -> None:
    @register
    class Lifo(Policy):
        name = "lifo-test"

        def priority(self, job: Job) -> tuple[float, ...]:
            return (-job.arrival,)

    assert get_policy("lifo-test").pick_next([Job("x", arrival=1), Job("y", arrival=2)]).job_id == "y"
    from enforcer.policies import POLICIES
    del POLICIES["lifo-test"]
