"""Each lane job's memory outside the caching allocator (C: CUDA context, library workspaces) is charged beside its
lane: jobs whose lane (P' + E) fits but whose context does not are refused, a measured C replaces the default, and
the lanes plus the contexts never exceed the device (DeviceLanes.check)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from enforcer.lane_fleet import Fleet
from enforcer.lanes import DeviceLanes, Job, lane_request
from store.models import Workflow
from store.settings import Settings

MiB, GiB = 1 << 20, 1 << 30
DEFAULT = Settings(secret="t").context_bytes


def test_the_default_context_is_512_mib_from_settings() -> None:
    assert DEFAULT == 512 * MiB
    assert Settings(secret="t", context_mb=300).context_bytes == 300 * MiB


# (device GiB, P GiB, E GiB, C MiB or None for the default, admitted?)
@pytest.mark.parametrize("capacity, p, e, context, admitted", [
    (16, 10, 2, None, True),  # lane 13.86 GiB + 0.5 GiB context: fits 16
    (16, 13.2, 1.2, None, False),  # P' + E = 15.72 GiB fits 16 alone; with 0.5 GiB beside it does not
    (16, 13.2, 1.2, 0, True),  # ...and is admitted when C is known to be inside P (NVML-sized memory)
    (16, 13.2, 1.2, 800, False),  # a measured C bigger than the default refuses too
    (16, 13.2, 1.2, 64, True),  # a measured small C replaces the default and lets it in
    (8, 6.5, 0.4, None, False),  # P' + E = 7.55 fits 8 GiB, P' + E + C = 8.05 does not: never
])
def test_a_lane_that_fits_without_its_context_is_refused_with_it(capacity, p, e, context, admitted) -> None:
    device = DeviceLanes(1, capacity * GiB, context_default=DEFAULT)
    job = Job("j", int(p * GiB), int(e * GiB), context=None if context is None else context * MiB)
    assert DeviceLanes(2, capacity * GiB).admit(Job("j", int(p * GiB), int(e * GiB), context=0)) is not None
    adm = device.admit(job)
    assert (adm is not None) is admitted
    if adm is not None:
        device.bind(adm)
        assert device.contexts == (DEFAULT if context is None else context * MiB)
        assert device.reserved + device.contexts <= device.capacity
        device.check()


@pytest.mark.parametrize("free_gib, context_mib, new_lane", [(5.4, None, False), (5.7, None, True),
                                                           (5.4, 200, True), (5.4, 0, True)])
def test_a_new_lane_needs_its_size_plus_its_context_free(free_gib, context_mib, new_lane) -> None:
    device = DeviceLanes(1, 16 * GiB, context_default=DEFAULT)
    full = device.add_lane(16 * GiB - int(free_gib * GiB))
    device.add_job(full.lane_id, "full", full.size, 0)  # no room to join
    job = Job("new", 4 * GiB, GiB // 2, context=None if context_mib is None else context_mib * MiB)
    size = lane_request(job.persistent, job.ephemeral, device.capacity)[1]
    assert size < device.free  # its lane (5.15 GiB) alone always fits
    adm = device.admit(job)
    assert (adm is not None) is new_lane
    if adm is not None:
        device.bind(adm)
        device.check()


def test_joining_a_lane_needs_room_for_the_context_beside_it() -> None:
    device = DeviceLanes(1, 16 * GiB, context_default=DEFAULT)
    # a big lane with room inside it for a small job
    device.bind(device.admit(Job("big", 8 * GiB, 4 * GiB, context=0)))  # lane 13.44 GiB, 8.8 + 4 used
    other = device.add_lane(device.free - 100 * MiB)  # someone else's lane takes all but 100 MiB of the rest
    device.add_job(other.lane_id, "other", other.size, 0)
    small = Job("small", 256 * MiB, GiB)  # fits in the big lane's room beside its 4 GiB peak
    lane = next(iter(device.lanes.values()))
    assert lane.fits(*lane_request(small.persistent, small.ephemeral, device.capacity)[:1], small.ephemeral)
    assert device.admit(small) is None  # 100 MiB free beside the lanes < 512 MiB of context
    measured = Job("small", 256 * MiB, GiB, context=64 * MiB)
    adm = device.admit(measured)
    assert adm is not None and adm.lane_id == lane.lane_id and adm.context == 64 * MiB
    device.bind(adm)
    assert device.free == 36 * MiB
    device.check()
    device.remove("small")
    assert device.contexts == 0 and device.free == 100 * MiB


def test_a_whole_device_holds_its_context_inside() -> None:
    device = DeviceLanes(1, 16 * GiB, context_default=DEFAULT)
    assert device.admit_whole(Job("w", int(13.9 * GiB / 1.1), GiB)) is not None  # 13.9 + 1 + 0.5 < 16
    assert device.admit_whole(Job("w", int(14.8 * GiB / 1.1), GiB)) is None  # 14.8 + 1 + 0.5 > 16
    device.bind(device.admit_whole(Job("w", GiB, 0)))
    assert device.contexts == 0 and device.free == 0  # the lane is the whole device, the context in it
    device.check()


def test_the_invariant_catches_contexts_past_the_device() -> None:
    device = DeviceLanes(1, 16 * GiB, context_default=DEFAULT)
    device.bind(device.admit(Job("a", 8 * GiB, 2 * GiB)))
    device.check()
    device.contexts += device.free + 1  # as if a context had been charged without room
    with pytest.raises(AssertionError):
        device.check()


def test_a_context_charge_must_be_bytes() -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        Job("j", GiB, 0, context=-1)
    with pytest.raises(ValueError, match="whole number of bytes"):
        Job("j", GiB, 0, context=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="whole number of bytes"):
        DeviceLanes(1, GiB, context_default=-5)
    device = DeviceLanes(1, 16 * GiB)
    lane = device.add_lane(GiB)
    with pytest.raises(ValueError, match="whole number of bytes"):
        device.add_job(lane.lane_id, "j", 0, 0, context=-1)


job_spec = st.tuples(
    st.integers(0, 12 * GiB),  # P
    st.integers(0, 4 * GiB),  # E
    st.one_of(st.none(), st.integers(0, 2 * GiB)),  # C measured, or None: the default
)


@settings(max_examples=150, deadline=None)
@given(capacity_gib=st.sampled_from([8, 16, 40, 80]), default=st.integers(0, GiB),
       ops=st.lists(st.tuples(st.booleans(), job_spec), min_size=1, max_size=40))
@example(capacity_gib=8, default=0, ops=[(False, (6_221_675_330, 0, 1_746_091_729))])  # P' + C one byte over 8 GiB
def test_random_fleets_never_hold_more_than_the_device_and_refuse_what_contexts_overfill(
        capacity_gib: int, default: int, ops: list) -> None:
    fleet = Fleet(context_default=default)
    fleet.add_device(1, capacity_gib * GiB)
    device = fleet.device(1)
    placed: list[str] = []
    for n, (leave, (p, e, c)) in enumerate(ops):
        if leave and placed:
            fleet.remove(placed.pop(0))
        else:
            job = Job(f"j{n}", p, e, context=c)
            charge = default if c is None else c
            free_before = device.free
            adm = device.admit(job)
            in_mask = bool(fleet.candidate_mask(job)[0])
            assert in_mask or adm is None  # the quick test never drops a device admission would take
            # what the same job would get if nothing were charged beside the lanes
            p_prime, size = lane_request(p, e, device.capacity)
            if adm is None:
                # refused although P' + E alone fit a new lane: then the context is what does not fit, beside the
                # lanes or beside the job itself (P' + E + C over the whole device)
                if free_before >= size and p_prime + e <= size:
                    beside = lane_request(p, e, device.capacity, charge)[1]
                    assert charge > 0 and (free_before < beside + charge or p_prime + e > beside)
            else:
                assert adm.context == charge
                assert free_before >= charge + (adm.lane_size if adm.new_lane else 0)
                fleet.bind([adm], job)
                placed.append(job.job_id)
        fleet.check()
        assert device.reserved + device.contexts <= device.capacity
        assert device.contexts == sum((default if fleet.job(j).context is None else fleet.job(j).context)
                                      for j in placed)


def test_a_trace_job_is_charged_no_context() -> None:
    """The simulator's jobs carry the memory the device showed of them (contexts included): none is added."""
    from enforcer.sim.convert import to_lane_job
    from enforcer.sim.model import SimJob

    job = to_lane_job(SimJob("t", arrival=0.0, work=10.0, mem=4 * GiB, util=0.5))
    assert job.context == 0
    device = DeviceLanes(1, 16 * GiB, context_default=DEFAULT)
    device.bind(device.admit(job))
    assert device.contexts == 0


def test_the_planner_moves_a_job_only_where_its_context_fits_beside_the_lanes() -> None:
    from enforcer.planner import Holding, PlanDevice, plan_moves

    def plan(context_default: int):
        devices = [PlanDevice(1, 16 * GiB, "h", "A100", context_default=context_default),
                   PlanDevice(2, 16 * GiB, "h", "A100", context_default=context_default)]
        holdings = [
            # device 2 runs a job in a 13.5 GiB lane: 2.5 GiB stay free beside it, 2 GiB beside it and its context
            Holding("busy", 2, persistent=int(13.5 * GiB / 1.1 / 1.05), util=0.3, context=None),
            # device 1: an idle job worth moving, whose own lane needs 2.1 GiB
            Holding("idle", 1, persistent=int(2 * GiB / 1.1 / 1.05) - 1, util=0.05, movable=True,
                    rules=("idle_holder",), context=None),
        ]
        return plan_moves(devices, holdings, "pack", max_moves=4)

    assert [m.workflow_id for m in plan(0).moves] == ["idle"]  # no contexts: it fits, device 1 comes free
    assert plan(512 * MiB).moves == []  # with a 0.5 GiB context each: 2 + 0.5 GiB do not fit in the 2 GiB left


def test_a_move_onto_a_whole_gpu_is_refused_when_the_job_and_its_context_overfill_it(sqlite_store) -> None:
    """The plan-level check of a move (enforcer.move_checks.move_refusal) counts the context inside a whole device."""
    from enforcer.move_checks import move_refusal
    from store.device_memory import CONTEXT_LABEL
    from store.headroom import charged
    from store.registry import DeviceSpec, register_devices, register_host
    from store.workflows import upsert_workflow

    conf = Settings(secret="t")
    with sqlite_store.session() as s:
        register_host(s, "h", hostname="h", source="nvml", now=1.0)
        (src, gpu) = register_devices(s, "h", [DeviceSpec(0, "GPU-0", "T4", 8 * GiB),
                                               DeviceSpec(1, "GPU-1", "T4", 8 * GiB)], source="nvml", now=1.0).values()
        # P' = 7.7 GiB: fits 8 GiB alone; not with the 0.5 GiB default context, nor a measured 1 GiB one
        for name, labels in (("unmeasured", {}), ("measured-big", {CONTEXT_LABEL: GiB}),
                             ("measured-small", {CONTEXT_LABEL: 128 * MiB})):
            upsert_workflow(s, name, now=1.0, mem_persistent=7 * GiB, mem_ephemeral=0, labels=labels)
        why = {name: move_refusal(s, s.get(Workflow, name), src, gpu, None, charged(7 * GiB), 0, conf, now=1.0)
               for name in ("unmeasured", "measured-big", "measured-small")}
    assert why["unmeasured"] is not None and f"needs {charged(7 * GiB) + 512 * MiB}" in why["unmeasured"]
    assert why["measured-big"] is not None and f"needs {charged(7 * GiB) + GiB}" in why["measured-big"]
    assert why["measured-small"] is None
