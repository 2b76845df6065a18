"""Simulating "what if" on the fleet fleetlens recorded (a real store, SQLite and PostgreSQL)."""

from __future__ import annotations

from enforcer.sim.readers.store import read_store
from enforcer.sim.runner import simulate
from store.models import Device, Host, ProcessSample, StepStat, Workflow
from tests.sim.invariants import assert_invariants


def test_store_workflows_replay(any_store):
    with any_store.session() as s:
        s.add(Host(id="h1", hostname="h1", source="replay", started_at=0.0, last_seen=0.0))
        s.flush()
        for i in range(2):
            s.add(Device(host_id="h1", index=i, uuid=f"u{i}", name="A100", source="replay",
                         memory_total=40 * 2**30, registered_at=0.0, last_seen=0.0))
        for i, (p, e) in enumerate([(2**30, 4 * 2**30), (2**30, 2**30), (None, None)]):
            s.add(Workflow(id=f"w{i}", created_at=10.0 * i, last_seen=10.0 * i + 100, mem_persistent=p,
                           mem_ephemeral=e))
        s.add(Workflow(id="empty", created_at=5.0, last_seen=5.0))
        s.flush()
        s.add(StepStat(workflow_id="w0", ts_start=0, ts_end=50, first_step=0, last_step=99, n_steps=100,
                       mean_s=0.5, p50_s=0.5, p95_s=0.6, max_s=0.7))
        for ts, mem, util in ((20.0, 3 * 2**30, 0.2), (30.0, 5 * 2**30, 0.4)):  # w2 has no SDK memory profile
            s.add(ProcessSample(device_id=1, workflow_id="w2", host_id="h1", pid=7, ts=ts, mem_used=mem, sm_util=util))
    tr = read_store(any_store)
    assert {j.id for j in tr.jobs} == {"w0", "w1", "w2"} and tr.report.skipped == {"no_duration": 1}
    assert next(j for j in tr.jobs if j.id == "w0").work == 50.0
    w2 = next(j for j in tr.jobs if j.id == "w2")
    assert w2.work == 100.0 and w2.mem == 5 * 2**30 and abs(w2.util - 0.3) < 1e-9  # peak memory, mean utilisation
    assert tr.cluster is not None and sum(n.devices for n in tr.cluster) == 2
    for result in simulate(tr, ["fifo", "pack", "tiresias"], check=True):
        assert_invariants(result)
