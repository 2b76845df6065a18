"""A node drained or set down on the real cluster (`scontrol update nodename=... state=drain|down`), read through the
Slurm import as sinfo --json gives it (a drained node is `idle` with the flag DRAIN, a draining one `mixed` with it):
the enforcer moves no job of a draining node (a move requeues the job, which could not start there again) and counts
it, and a node set down is not heard from. The node is resumed whatever the test's outcome."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import select

from collector.importers.slurm import import_slurm
from enforcer.slurm_cycle import run_slurm_cycle
from store.models import Placement, ProcessSample
from store.registry import closed_hosts, silent_hosts

pytestmark = pytest.mark.slurm


def _node_state(slurm) -> tuple[str, list[str]]:
    (node,) = json.loads(slurm.run("sinfo", "--json"))["nodes"]
    return node["state"], list(node.get("state_flags") or [])


def _resume(slurm) -> None:
    slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=resume", check=False)
    slurm.wait(lambda: _node_state(slurm)[1] == [] and _node_state(slurm)[0] in ("idle", "mixed"), timeout=30)


def _idle_readings(store, workflow_id: str, now: float) -> None:
    """30 readings of the job using a tenth of its GPU (its memory seen long enough to share one)."""
    with store.session() as s:
        device = s.scalar(select(Placement.device_id).where(Placement.workflow_id == workflow_id,
                                                            Placement.state == "active"))
        for t in range(30):
            s.add(ProcessSample(device_id=device, workflow_id=workflow_id, host_id="n", pid=100, ts=now - t,
                                sm_util=0.1, mem_used=2**20))


def test_a_draining_node_moves_no_job_and_a_down_one_is_not_heard_from(slurm, sqlite_store, slurm_settings,
                                                                        tmp_path):
    node, reason = slurm.node, "fleetlens test"
    job = slurm.submit("sleep 300", gres="shard:2", comment="fleetlens:movable", cwd=tmp_path, name="on-drain")
    slurm.wait_running(job)
    wf = f"slurm-{job}"
    try:
        slurm.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")
        assert _node_state(slurm) == ("mixed", ["DRAIN"])  # draining: its job runs on
        now = time.time()
        assert import_slurm(sqlite_store, slurm_settings, now=now).errors == []
        _idle_readings(sqlite_store, wf, now)
        with sqlite_store.session() as s:
            assert silent_hosts(s, [node], slurm_settings.host_silence_s, now) == {}
            assert closed_hosts(s, [node]) == {node: (
                f"takes no new job: Slurm's latest listing shows it MIXED+DRAIN (reason: {reason}): its jobs run "
                "on, but Slurm starts no new job there")}
        result = run_slurm_cycle(sqlite_store, slurm_settings, apply=True, now=now)
        assert result["moves"] == [] and result["begun"] == []
        assert result["skipped"] == {"on a node that takes no new job": 1} and list(result["closed"]) == [node]
        after = slurm.job(job)
        assert (after["job_state"], after["restart_cnt"], after["tres_per_node"]) == ("RUNNING", 0, "gres:shard:2")

        _resume(slurm)  # taking jobs again: the same job would be moved (a dry run here)
        now = time.time()
        import_slurm(sqlite_store, slurm_settings, now=now)
        assert run_slurm_cycle(sqlite_store, slurm_settings, apply=False, now=now)["moves"] == [wf]

        slurm.cancel_all()  # setting a node down requeues its jobs
        slurm.run("scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}")
        assert _node_state(slurm)[0] == "down"
        now = time.time()
        import_slurm(sqlite_store, slurm_settings, now=now)
        with sqlite_store.session() as s:
            assert silent_hosts(s, [node], slurm_settings.host_silence_s, now) == {node: (
                f"is not heard from: Slurm's latest listing shows it DOWN (reason: {reason}): its slurmd does not "
                "answer Slurm, or the node failed or is powered off")}
    finally:
        _resume(slurm)
