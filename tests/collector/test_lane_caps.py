"""The memory caps of a lane's jobs, as `fleetlens run` and the agent give them, never add up to more than the lane:
for a lane sized by Salus's admission (ΣP' + max E, with its 5 % headroom), the caps in force while any one job
holds the turn (its turn cap, every lane-mate's cap outside its turn) sum to at most the lane; and the caps of all
a device's lanes plus every job's context (outside every cap) sum to at most the device."""

from __future__ import annotations

import itertools

import pytest

from collector.launch import job_env
from enforcer.lanes import DeviceLanes, Job, lane_fits, lane_request
from store.db import Store
from store.models import Lane, Placement
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.workflows import upsert_workflow

GiB = 1 << 30
CAPACITY = 80 * GiB


def _caps(env: dict[str, str]) -> tuple[float, float]:
    """(cap during its turn, cap outside it) in bytes; a job with one cap holds it all the time."""
    turn = float(env["FLEETLENS_MEMORY_FRACTION"]) * CAPACITY
    idle = float(env.get("FLEETLENS_IDLE_MEMORY_FRACTION", env["FLEETLENS_MEMORY_FRACTION"])) * CAPACITY
    return turn, idle


@pytest.mark.parametrize("jobs", [
    [(10 * GiB, 20 * GiB), (int(0.4 * GiB), 20 * GiB)],  # P, E: two jobs that peak alike
    [(4 * GiB, 12 * GiB), (GiB // 2, 3 * GiB), (GiB // 5, 9 * GiB)],  # three, one much bigger peak
])
def test_the_caps_in_force_never_sum_past_the_lane(sqlite_store: Store, jobs: list[tuple[int, int]]) -> None:
    # Salus's admission: the first job opens a lane, the others join it where P' + max(E, lane's E) fits
    admitted = [lane_request(p, e, CAPACITY)[0] for p, e in jobs]
    size = lane_request(*jobs[0], CAPACITY)[1]
    persistent_sum, max_e = admitted[0], jobs[0][1]
    for p_prime, (_, e) in zip(admitted[1:], jobs[1:], strict=True):
        assert lane_fits(size, persistent_sum, max_e, p_prime, e), "the case must be one lane"
        persistent_sum, max_e = persistent_sum + p_prime, max(max_e, e)
    with sqlite_store.session() as s:
        register_host(s, "caps-host", hostname="h", source="nvml")
        (device_id,) = register_devices(s, "caps-host", [DeviceSpec(0, "GPU-caps-0", "A100", CAPACITY)],
                                        source="nvml").values()
        lane = Lane(device_id=device_id, size_bytes=size, compute_share=0.5, state="open", created_at=1.0)
        s.add(lane)
        s.flush()
        names = [f"job-{k}" for k in range(len(jobs))]
        for name, (p, e) in zip(names, jobs, strict=True):
            upsert_workflow(s, name, now=1.0, id_source="managed", managed=True, state="running")
            s.add(Placement(workflow_id=name, device_id=device_id, lane_id=lane.id, host_id="caps-host",
                            mem_persistent=p, mem_ephemeral=e, state="active", started_at=1.0))
        s.flush()
        caps = {name: _caps(job_env(s, name, [device_id], lane.id, host_id="caps-host")[0]) for name in names}
    for name, p_prime, (_, e) in zip(names, admitted, jobs, strict=True):
        assert caps[name][0] >= p_prime + e - CAPACITY * 1e-6  # its turn holds its whole step
        assert caps[name][1] >= p_prime - CAPACITY * 1e-6  # outside it, its persistent memory
    for holder in names:
        in_force = caps[holder][0] + sum(caps[other][1] for other in names if other != holder)
        assert in_force <= size, f"while {holder} holds the turn the caps sum to {in_force / GiB:.2f} GiB, " \
                                 f"past the lane's {size / GiB:.2f} GiB"
    assert list(itertools.combinations(names, 2))  # lane-mates, not one job


def test_the_caps_of_every_lane_plus_every_context_never_sum_past_the_device(sqlite_store: Store) -> None:
    """The caps cover only the caching allocator; each process's context (C) sits beside them. Admission charges C
    beside the lanes, so what all the device's jobs can hold at once, caps in force plus contexts, fits the device."""
    context = Settings(secret="t").context_bytes
    device = DeviceLanes(0, CAPACITY, context_default=context)
    # big jobs open lanes until the device is full; small ones then join lanes, each with its own context
    jobs = [(9 * GiB, 6 * GiB), (5 * GiB, 2 * GiB), (3 * GiB, 8 * GiB), (GiB, GiB), (7 * GiB, 3 * GiB)] \
        + [(GiB // 2, GiB)] * 30
    admitted = []
    for k, (p, e) in enumerate(jobs):
        adm = device.admit(Job(f"job-{k}", p, e))
        if adm is not None:
            device.bind(adm)
            admitted.append(adm)
    assert len(device.lanes) >= 2 and any(len(lane.jobs) > 1 for lane in device.lanes.values())
    assert device.contexts == len(admitted) * context
    device.check()
    with sqlite_store.session() as s:
        register_host(s, "ctx-host", hostname="h", source="nvml")
        (device_id,) = register_devices(s, "ctx-host", [DeviceSpec(0, "GPU-ctx-0", "A100", CAPACITY)],
                                        source="nvml").values()
        rows = {}
        for lane in device.lanes.values():
            rows[lane.lane_id] = Lane(device_id=device_id, size_bytes=lane.size, compute_share=0.5, state="open",
                                      created_at=1.0)
            s.add(rows[lane.lane_id])
        s.flush()
        for adm in admitted:
            lane_id = device.lane_of(adm.job_id).lane_id
            upsert_workflow(s, adm.job_id, now=1.0, id_source="managed", managed=True, state="running")
            s.add(Placement(workflow_id=adm.job_id, device_id=device_id, lane_id=rows[lane_id].id,
                            host_id="ctx-host", mem_persistent=jobs[int(adm.job_id.split("-")[1])][0],
                            mem_ephemeral=adm.ephemeral,
                            state="active", started_at=1.0))
        s.flush()
        worst = 0.0
        for lane in device.lanes.values():
            caps = {name: _caps(job_env(s, name, [device_id], rows[lane.lane_id].id, host_id="ctx-host")[0])
                    for name in lane.jobs}
            in_force = max(caps[h][0] + sum(caps[o][1] for o in caps if o != h) for h in caps)
            assert in_force <= lane.size
            worst += in_force
    assert worst + len(admitted) * context <= CAPACITY, \
        f"caps {worst / GiB:.2f} GiB + {len(admitted)} contexts of {context / GiB:.2f} GiB past {CAPACITY / GiB} GiB"
