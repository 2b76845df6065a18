"""The Slurm part of the enforcement cycle: a job's use is what all its processes use together (the p95 over the
window, as the planner sizes it), a job whose move ended within the cool-down is not planned again, and a job on a
node Slurm reports not answering (not heard from) or closed to new jobs (drained, draining, in maintenance, reserved:
its requeued job could not start there again) is not moved, counted and named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import select

from collector.importers.slurm import record_view
from enforcer.actuators.base import Move
from enforcer.actuators.slurm import SlurmActuator
from enforcer.slurm_cycle import run_slurm_cycle, slurm_holdings
from store.errors import InvalidInput
from store.models import Action, Placement, ProcessSample
from store.settings import Settings
from store.slurm import SlurmView, parse_jobs, parse_nodes
from tests.fakes.fake_slurm import META, FakeSlurm

NOW = 2_000_000.0
WF = "slurm-9"


@pytest.fixture
def settings(fleet_home: Path) -> Settings:
    return Settings(home=fleet_home)


def _import(store, settings: Settings, gres: str = "shard:2", *, now: float = NOW, state: str = "mixed",
            flags: tuple[str, ...] = ()) -> int:
    """Job 9 running on `gres` of GPU 0 of a node with 2 shards per GPU, the node in `state` with `flags` (sinfo
    --json), imported at `now`; the store's device it was placed on."""
    nodes = {"meta": META, "errors": [],
             "nodes": [{"name": "gpu01", "state": state, "state_flags": list(flags), "reason": "x",
                        "gres": "gpu:4,shard:8", "partitions": ["p"]}]}
    jobs = {"meta": META, "errors": [], "jobs": [{
        "job_id": 9, "job_state": "RUNNING", "submit_time": 1000, "tres_per_node": f"gres:{gres}", "requeue": True,
        "comment": "fleetlens:movable", "nodes": "gpu01", "batch_host": "gpu01", "gres_detail": [f"{gres}(IDX:0)"]}]}
    record_view(store, SlurmView("22.05.8", parse_nodes(nodes)[1], parse_jobs(jobs)[1]), settings, now=now)
    with store.session() as s:
        return s.scalar(select(Placement.device_id).where(Placement.workflow_id == WF, Placement.state == "active"))


def _samples(store, device: int, readings: list[list[float]]) -> None:
    """One reading per second up to NOW, each of the job's processes' SM utilisation (its memory seen each time)."""
    with store.session() as s:
        for t, utils in enumerate(readings):
            for pid, util in enumerate(utils, start=100):
                s.add(ProcessSample(device_id=device, workflow_id=WF, host_id="gpu01", pid=pid, ts=NOW - t,
                                    sm_util=util, mem_used=2**20))


def test_a_jobs_use_is_its_processes_together_at_their_busiest(sqlite_store, settings):
    device = _import(sqlite_store, settings)
    # the training process uses 0.9 at every reading; a second one holds a CUDA context and runs no kernel (NVML: 0)
    _samples(sqlite_store, device, [[0.9, 0.0]] * 30)
    (holding,) = slurm_holdings(sqlite_store, settings, now=NOW)
    assert holding.used == pytest.approx(0.9)
    # so it keeps both shards of its GPU: half of them would hold half of what it uses
    assert run_slurm_cycle(sqlite_store, settings, apply=False, now=NOW)["moves"] == []


def test_a_job_busy_now_and_then_is_sized_by_its_busy_readings(sqlite_store, settings):
    device = _import(sqlite_store, settings)
    _samples(sqlite_store, device, [[0.2]] * 20 + [[0.8]] * 10)  # a mean of 0.4 would fit one shard of two
    (holding,) = slurm_holdings(sqlite_store, settings, now=NOW)
    assert holding.used == pytest.approx(0.8)
    assert run_slurm_cycle(sqlite_store, settings, apply=False, now=NOW)["moves"] == []


def test_a_job_moved_within_the_cool_down_is_not_planned_again(sqlite_store, settings):
    device = _import(sqlite_store, settings)
    _samples(sqlite_store, device, [[0.1]] * 30)
    assert run_slurm_cycle(sqlite_store, settings, apply=False, now=NOW)["moves"] == [WF]
    # a move of it ended a minute ago; the import after it has not come yet, so the row still says shard:2
    with sqlite_store.session() as s:
        s.add(Action(kind="migrate", workflow_id=WF, state="resumed", attempts=1, created_at=NOW - 120,
                     updated_at=NOW - 60, engine="slurm", detail={"job_id": 9}))
    assert run_slurm_cycle(sqlite_store, settings, apply=False, now=NOW)["moves"] == []
    # past the cool-down, with the same readings since (and the import's since): planned again
    later = NOW + settings.cooldown_s
    with sqlite_store.session() as s:
        for sample in s.scalars(select(ProcessSample)):
            sample.ts += settings.cooldown_s
    _import(sqlite_store, settings, now=later)
    assert run_slurm_cycle(sqlite_store, settings, apply=False, now=later)["moves"] == [WF]


NOT_ANSWERING = [("down", ()), ("mixed", ("NOT_RESPONDING",)), ("mixed", ("FAIL",)), ("idle", ("POWERED_DOWN",))]
CLOSED = [("mixed", ("DRAIN",)), ("allocated", ("DRAIN",)), ("mixed", ("MAINTENANCE", "RESERVED")),
          ("mixed", ("RESERVED",))]


@pytest.mark.parametrize(("state", "flags", "kept"), [(*c, "on a host not heard from") for c in NOT_ANSWERING]
                         + [(*c, "on a node that takes no new job") for c in CLOSED],
                         ids=["+".join((s, *f)) for s, f in NOT_ANSWERING + CLOSED])
def test_a_job_on_a_node_that_does_not_answer_or_takes_no_new_job_is_not_moved(sqlite_store, settings, state, flags,
                                                                                kept):
    device = _import(sqlite_store, settings, state=state, flags=flags)
    _samples(sqlite_store, device, [[0.1]] * 30)  # it would fit one shard of two
    result = run_slurm_cycle(sqlite_store, settings, apply=True, now=NOW,
                             actuator=SlurmActuator(sqlite_store, settings, cli=FakeSlurm()))
    assert result["moves"] == [] and result["begun"] == [] and result["skipped"] == {kept: 1}
    said = "+".join((state.upper(), *flags)) + " (reason: x)"
    named = result["not_heard_from"] if kept == "on a host not heard from" else result["closed"]
    assert list(named) == ["gpu01"] and said in named["gpu01"]
    # nor is a move of it begun by hand: the node is its target too
    with pytest.raises(InvalidInput, match=re.escape(f"runs on node gpu01, which {named['gpu01']}; nothing moved")):
        SlurmActuator(sqlite_store, settings, cli=FakeSlurm()).begin(
            Move(workflow_id=WF, to_device_id=device, request={"gres": "shard:1"}), now=NOW)
    with sqlite_store.session() as s:
        assert s.scalars(select(Action)).all() == []
    # Slurm lists it up and taking jobs again: moved
    _import(sqlite_store, settings)
    assert run_slurm_cycle(sqlite_store, settings, apply=False, now=NOW)["moves"] == [WF]


def test_a_node_the_import_has_not_listed_lately_is_not_heard_from(sqlite_store, settings):
    device = _import(sqlite_store, settings)
    _samples(sqlite_store, device, [[0.1]] * 30)
    later = NOW + settings.host_silence_s + 30  # no import since (slurmctld away); its samples are still recent
    with sqlite_store.session() as s:
        for sample in s.scalars(select(ProcessSample)):
            sample.ts += settings.host_silence_s + 30
    result = run_slurm_cycle(sqlite_store, settings, apply=False, now=later)
    assert result["moves"] == [] and result["skipped"] == {"on a host not heard from": 1}
    assert result["not_heard_from"] == {"gpu01": "has not been heard from for 150 s (more than 120 s, "
                                                 "FLEETLENS_HOST_SILENT_AFTER_S)"}
