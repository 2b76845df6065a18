"""A Slurm job whose node's agent fell silent: its telemetry findings there stay while Slurm still runs it on that
node, and resolve once the import records it requeued onto another node (its placements moved). squeue and sinfo
are answered by a fake at the command boundary."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from analyzer.telemetry import detect
from collector.importers.slurm import import_slurm
from store.models import Finding
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from tests.analyzer.telemetry_fleet import GIB, Fleet
from tests.fakes.fake_slurm import SlurmAnswers

WINDOW = 3 * 3600
LIMIT = 12 * 3600


def _gpu(fleet: Fleet, node: str) -> int:
    """GPU 0 of `node`, as its agent registers it (NVML)."""
    with fleet.store.session() as s:
        register_host(s, node, hostname=node, source="nvml", now=fleet.t0)
        device = register_devices(s, node, [DeviceSpec(0, f"GPU-{node}-0", "NVIDIA A100-SXM4-80GB", 80 * GIB)],
                                  source="nvml", now=fleet.t0)[0]
    fleet.hosts[device] = node
    return device


def _job(node: str, restart: int, submit: float) -> dict[str, Any]:
    return {"job_id": 5, "job_state": "RUNNING", "restart_cnt": restart, "submit_time": submit, "requeue": True,
            "tres_per_node": "gres:gpu:1", "name": "train", "user_name": "u", "start_time": submit + 10,
            "nodes": node, "batch_host": node, "gres_detail": ["gpu:1(IDX:0)"]}


def _statuses(store) -> dict[int, tuple[str, dict]]:
    with store.session() as s:
        return {f.id: (f.status, f.evidence) for f in s.scalars(select(Finding).where(
            Finding.workflow_id == "slurm-5", Finding.source == "telemetry"))}


def test_a_job_requeued_onto_another_node_resolves_its_silent_nodes_findings(any_store, tmp_path):
    fleet = Fleet(any_store)
    n1, n2 = _gpu(fleet, "n1"), _gpu(fleet, "n2")
    settings = Settings(home=tmp_path)
    slurm = SlurmAnswers(nodes=[{"name": n, "state": "mixed", "partitions": ["gpu"], "gres": "gpu:1"}
                                for n in ("n1", "n2")])
    slurm.jobs = [_job("n1", 0, fleet.t0)]
    assert import_slurm(any_store, settings, cli=slurm, now=fleet.minute(0)).errors == []
    fleet.run(n1, "slurm-5", 0, 180, util=0.0, mem_gib=70)
    fleet.flush()
    assert {f.device_id for f in detect(any_store, now=fleet.minute(180), window_s=WINDOW)} == {n1}
    first = _statuses(any_store)

    # n1's agent is down; Slurm still runs the job there: its findings stay
    assert import_slurm(any_store, settings, cli=slurm, now=fleet.minute(300)).errors == []
    detect(any_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(any_store) == first

    # requeued, it runs on n2 now (n2's agent down too: only Slurm says so)
    slurm.jobs = [_job("n2", 1, fleet.minute(310))]
    assert import_slurm(any_store, settings, cli=slurm, now=fleet.minute(320)).errors == []
    detect(any_store, now=fleet.minute(380), window_s=WINDOW, silent_limit_s=LIMIT)
    after = _statuses(any_store)
    assert {s for s, _ in after.values()} == {"resolved"}
    assert {(e["resolution"]["reason"], e["resolution"]["known_by"], e["resolution"]["now_on"])
            for _, e in after.values()} == {("moved", "placement", f"device {n2}")}
