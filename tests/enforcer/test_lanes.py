"""Salus lanes: the admission rule by hand, and its invariants under random sequences of arrivals and departures."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enforcer.lane_fleet import Fleet
from enforcer.lanes import DeviceLanes, Job, lane_request, remaining_time

GB = 2**30


def test_lane_request_follows_salus_headroom() -> None:
    p_prime, size = lane_request(10 * GB, 2 * GB, 80 * GB)
    assert p_prime == int(11 * GB)
    assert size == round(1.05 * (11 * GB + 2 * GB))
    # the lane never asks for more than the device has
    assert lane_request(70 * GB, 10 * GB, 80 * GB)[1] == 80 * GB


def test_new_lane_first_then_least_room_then_wait() -> None:
    dev = DeviceLanes(1, 16 * GB)
    lane_a = dev.bind(dev.admit(Job("a", 4 * GB, 1 * GB)))  # P' 4.4 GB, lane 5.67 GB, room 0.27 GB
    lane_b = dev.bind(dev.admit(Job("b", 4 * GB, GB * 8 // 10)))  # P' 4.4 GB, lane 5.46 GB, room 0.26 GB
    assert lane_a.lane_id != lane_b.lane_id
    assert dev.free == 16 * GB - lane_a.size - lane_b.size
    # 4.87 GB free < 5.67 GB asked, and no lane has 4.4 + 1 GB beyond its persistent memory: wait
    assert dev.admit(Job("c", 4 * GB, 1 * GB)) is None
    # small jobs still get lanes of their own while the device has room
    assert dev.admit(Job("c2", GB // 2, GB // 2)).new_lane
    dev.bind(dev.admit(Job("c2", GB // 2, GB // 2)))
    dev.bind(dev.admit(Job("d", 3 * GB, 0)))
    # now no lane of 0.76 GB fits: the job joins the fitting lane with the least room (b, not a)
    e = Job("e", GB // 5, GB // 2)
    adm = dev.admit(e)
    assert adm is not None and not adm.new_lane and adm.lane_id == lane_b.lane_id
    assert lane_a.fits(adm.p_prime, adm.ephemeral) and lane_b.room < lane_a.room
    dev.bind(adm)
    assert lane_b.used <= lane_b.size
    # a job bigger than the device never fits
    assert dev.admit(Job("huge", 20 * GB, 0)) is None
    dev.check()


def test_join_uses_the_largest_ephemeral_of_the_lane() -> None:
    dev = DeviceLanes(1, 10 * GB)
    first = dev.admit(Job("a", 2 * GB, 6 * GB))  # P' = 2.2 GB, lane = 1.05 * 8.2 GB = 8.61 GB
    dev.bind(first)
    # P' 0.55 GB + max(E 1 GB, lane's 6 GB) = 6.55 GB > 8.61 - 2.2 = 6.41 GB: does not fit, device has no room
    assert dev.admit(Job("b", GB // 2, 1 * GB)) is None
    # P' 0.11 GB + max(1.5, 6) GB = 6.11 GB <= 6.41 GB fits: the job shares the lane's ephemeral memory
    adm = dev.admit(Job("c", GB // 10, 3 * GB // 2))  # its own lane (1.69 GB) would not fit in 1.39 GB free
    assert adm is not None and adm.lane_id == next(iter(dev.lanes))
    lane = dev.bind(adm)
    assert lane.max_ephemeral == 6 * GB and lane.used <= lane.size
    dev.check()


def test_removal_closes_an_empty_lane_and_gives_memory_back() -> None:
    dev = DeviceLanes(7, 8 * GB)
    lane = dev.bind(dev.admit(Job("a", GB, GB)))
    assert dev.free == 8 * GB - lane.size
    dev.remove("a")
    assert dev.free == 8 * GB and not dev.lanes
    with pytest.raises(KeyError):
        dev.remove("a")


def test_whole_device_jobs_need_an_empty_device_and_block_joining() -> None:
    dev = DeviceLanes(1, 16 * GB)
    adm = dev.admit(Job("big", GB, 0, exclusive=True))
    assert adm is not None and adm.exclusive and adm.lane_size == 16 * GB
    dev.bind(adm)
    assert dev.admit(Job("small", 0, 0)) is None
    other = DeviceLanes(2, 16 * GB)
    other.bind(other.admit(Job("s", GB, 0)))
    assert other.admit(Job("big", GB, 0, exclusive=True)) is None


def test_fleet_places_multi_device_jobs_on_one_host() -> None:
    fleet = Fleet()
    for i in range(3):
        fleet.add_device(i, 16 * GB, host="h1")
    for i in range(3, 7):
        fleet.add_device(i, 16 * GB, host="h2")
    fleet.bind([fleet.admit(0, Job("s", GB, 0))], Job("s", GB, 0))
    by_host = fleet.whole_free_by_host(Job("g", GB, 0, gpus=3))
    assert set(by_host) == {fleet.host_codes["h2"]}
    assert sorted(fleet.devices[i].device_id for i in by_host[fleet.host_codes["h2"]]) == [3, 4, 5, 6]


def test_remaining_time() -> None:
    assert remaining_time(1000, 400, 0.5) == 300.0
    assert remaining_time(None, 1, 0.5) is None
    assert remaining_time(10, 20, 1.0) == 0.0


ops = st.lists(
    st.tuples(
        st.booleans(),  # True: a job arrives, False: a job leaves
        st.integers(0, 12 * GB),  # P
        st.integers(0, 6 * GB),  # E
        st.integers(0, 1000),  # which job leaves / which device
        st.booleans(),  # whole device
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, capacities=st.lists(st.integers(1 * GB, 40 * GB), min_size=1, max_size=4))
def test_lanes_never_exceed_their_size_nor_the_device(ops, capacities) -> None:
    fleet = Fleet()
    for i, cap in enumerate(capacities):
        fleet.add_device(i, cap, host=f"h{i % 2}")
    placed: list[str] = []
    for n, (arrive, p, e, pick, whole) in enumerate(ops):
        if arrive or not placed:
            job = Job(f"j{n}", p, e, exclusive=whole)
            i = pick % len(capacities)
            device = fleet.devices[i]
            before = device.free
            adm = fleet.admit(i, job)
            if adm is None:
                # waiting must be right: no new lane fits and (unless whole) no lane has the room
                p_prime, size = lane_request(p, e, device.capacity)
                if not whole:
                    assert device.free < size or p_prime + e > size
                    assert not any(lane.fits(p_prime, e) for lane in device.lanes.values())
                continue
            # the quick fleet filter must never drop a device the exact rule accepts
            assert i in set(fleet.candidates(job).tolist())
            fleet.bind([adm], job)
            placed.append(job.job_id)
            if adm.new_lane:
                assert device.free == before - adm.lane_size
        else:
            job_id = placed.pop(pick % len(placed))
            (device_id, _), = fleet.where(job_id)
            device = fleet.device(device_id)
            before = device.free
            lane = fleet.remove(job_id)[0]
            # removal restores room: the lane's memory when it closed, else the lane's room grows
            assert device.free == (before + lane.size if not lane.jobs else before)
            assert device.lane_of(job_id) is None
        for device in fleet.devices:
            assert device.reserved <= device.capacity
            for lane in device.lanes.values():
                assert lane.used <= lane.size
        fleet.check()
    for job_id in placed:
        fleet.remove(job_id)
    assert all(d.free == d.capacity and not d.lanes for d in fleet.devices)
