"""Property test on random fleets in a real SQLite store: every consumer of the fleet state (admission, the planner,
consolidation, the dashboard) sees the same free capacity per device, and that capacity is the one rule's (memory
less what no placement explains), computed here independently from the fleet that was written."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enforcer.consolidation_sizing import ConsolidateParams
from enforcer.consolidation_store import load_demands
from enforcer.fleet_state import read_fleet_state
from enforcer.managed import load_host_fleet
from enforcer.plan_store import load_state
from store.db import Store
from store.device_memory import CONTEXT_LABEL
from store.headroom import charged
from store.ingest import write_samples
from store.migrations import upgrade
from store.models import Action, Lane, Placement
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.workflows import upsert_workflow
from ui.dashboard.state_queries import device_capacity

GIB = 2**30
DEFAULT_CONTEXT = Settings(secret="t").context_bytes
NOW = 1_800_000_000.0

placement = st.fixed_dictionaries({
    "whole": st.booleans(),
    "persistent": st.one_of(st.none(), st.integers(0, 6 * GIB)),  # P as measured (the store keeps P, never P')
    "ephemeral": st.integers(0, GIB),
    "state": st.sampled_from(["active", "pending", "ended"]),
    "seen": st.one_of(st.none(), st.integers(0, 8 * GIB)),  # its process's latest sample on the device
    # its context (C) beside the lane: inside NVML-sized memory, the default for declared memory, or measured
    "context": st.one_of(st.sampled_from(["nvml", "default"]), st.integers(0, GIB)),
})
device = st.fixed_dictionaries({
    "host": st.sampled_from(["h1", "h2"]),
    "total_gib": st.sampled_from([8, 16, 40, 80]),
    "used": st.one_of(st.none(), st.integers(0, 80 * GIB)),  # the latest device sample's memory used
    "foreign": st.one_of(st.none(), st.integers(0, 8 * GIB)),  # a process no placement on it explains
    "placements": st.lists(placement, max_size=3),
    "arriving": st.one_of(st.none(), st.integers(1, 8 * GIB)),  # a lane opened for a job on its way
})
fleets = st.lists(device, min_size=1, max_size=5)


def _write(store: Store, fleet: list[dict]) -> dict[int, int]:
    """The fleet into the store; returns {device id: the free capacity by the rule, computed from `fleet`}."""
    expected: dict[int, int] = {}
    device_rows, process_rows = [], []
    with store.session() as s:
        ids: dict[int, int] = {}
        by_host: dict[str, list[int]] = defaultdict(list)
        for k, d in enumerate(fleet):
            by_host[d["host"]].append(k)
        for host, ks in by_host.items():
            register_host(s, host, hostname=host, source="nvml", now=NOW)
            got = register_devices(s, host, [DeviceSpec(i, f"GPU-{host}-{i}", "A100", fleet[k]["total_gib"] * GIB)
                                             for i, k in enumerate(ks)], source="nvml", now=NOW)
            for i, k in enumerate(ks):
                ids[k] = got[i]
        for k, d in enumerate(fleet):
            total = d["total_gib"] * GIB
            dev = ids[k]
            explained, placed, foreign_seen = 0, set(), 0
            for j, p in enumerate(d["placements"]):
                wf = f"job-{k}-{j}"
                declared = {} if p["context"] == "nvml" else {"mem_persistent": GIB, "mem_ephemeral": 0}
                measured = {} if isinstance(p["context"], str) else {"labels": {CONTEXT_LABEL: p["context"]}}
                upsert_workflow(s, wf, now=NOW, managed=True, command=["python", "t.py"], id_source="managed",
                                **declared, **measured)
                context = 0 if p["context"] == "nvml" else DEFAULT_CONTEXT if p["context"] == "default" \
                    else p["context"]
                lane_id = None
                if not p["whole"]:
                    lane = Lane(device_id=dev, size_bytes=charged(p["persistent"] or 0) + p["ephemeral"] + GIB,
                                compute_share=0.5, state="open", created_at=NOW)
                    s.add(lane)
                    s.flush()
                    lane_id = lane.id
                s.add(Placement(workflow_id=wf, device_id=dev, lane_id=lane_id, host_id=d["host"], pid=100 + j,
                                mem_persistent=p["persistent"], mem_ephemeral=p["ephemeral"], state=p["state"],
                                started_at=NOW))
                if p["state"] != "ended":
                    placed.add(wf)
                    explained += total if p["whole"] else charged(p["persistent"] or 0) + p["ephemeral"] + context
                if p["seen"] is not None:
                    process_rows.append(dict(device_id=dev, workflow_id=wf, host_id=d["host"], pid=100 + j, ts=NOW,
                                             mem_used=p["seen"]))
                    if wf not in placed and p["seen"]:
                        foreign_seen += p["seen"]  # an ended placement explains nothing
            if d["foreign"] is not None:
                process_rows.append(dict(device_id=dev, workflow_id=f"other-{k}", host_id=d["host"], pid=9, ts=NOW,
                                         mem_used=d["foreign"]))
                foreign_seen += d["foreign"]
            if d["arriving"] is not None:
                wf = f"arriving-{k}"
                upsert_workflow(s, wf, now=NOW, managed=True, command=["python", "t.py"], id_source="managed")
                lane = Lane(device_id=dev, size_bytes=d["arriving"], compute_share=0.5, state="open", created_at=NOW)
                s.add(lane)
                s.flush()
                s.add(Action(workflow_id=wf, from_device_id=None, to_device_id=dev, to_lane_id=lane.id,
                             state="stopped", created_at=NOW, updated_at=NOW))
                explained += d["arriving"]
            if d["used"] is not None:
                device_rows.append(dict(device_id=dev, ts=NOW, mem_used=min(d["used"], total), mem_total=total))
            beyond = max(0, min(d["used"], total) - explained) if d["used"] is not None else 0
            expected[dev] = max(0, total - max(beyond, foreign_seen))
    write_samples(store, device_rows, process_rows)
    return expected


def _consumers(store: Store, hosts: set[str]) -> dict[str, dict[int, int]]:
    conf = Settings(secret="t")
    seen: dict[str, dict[int, int]] = {}
    with store.session() as s:
        state = read_fleet_state(s, now=NOW, settings=conf)
        seen["fleet_state"] = {d: state.free_capacity(d) for d in state.devices}
        admission: dict[int, int] = {}
        for host in hosts:
            fleet, _ = load_host_fleet(s, host, conf)
            admission.update({d.device_id: d.capacity for d in fleet.devices})
        seen["admission"] = admission
        devices, _ = load_state(s, conf, NOW)
        # the planner holds a device's unmanaged memory (foreign) and hands out the rest
        seen["planner"] = {d.device_id: d.capacity - d.foreign for d in devices}
        caps, _, _ = load_demands(s, conf, NOW, ConsolidateParams())
        seen["consolidation"] = dict(caps)
    table = device_capacity(store, now=NOW, settings=conf)
    seen["dashboard"] = dict(zip(*(table[c] for c in ("device_id", "free_capacity")), strict=True))
    return seen


def test_every_consumer_sees_the_one_free_capacity(tmp_path: Path, fleet_home: Path) -> None:
    template = tmp_path / "template.db"
    blank = Store(f"sqlite:///{template}")
    upgrade(blank)
    blank.dispose()
    runs = iter(range(10**6))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(fleets)
    def check(fleet: list[dict]) -> None:
        db = tmp_path / f"fleet-{next(runs)}.db"
        shutil.copy(template, db)
        store = Store(f"sqlite:///{db}")
        try:
            expected = _write(store, fleet)
            seen = _consumers(store, {d["host"] for d in fleet})
        finally:
            store.dispose()
            db.unlink()
        for consumer, capacities in seen.items():
            assert capacities == expected, (consumer, capacities, expected)

    check()
