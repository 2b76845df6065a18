"""Moves between hosts with real parts: two agents on this machine, each with its own host id and FLEETLENS_HOME,
one PostgreSQL, a real torch training job. Through a shared checkpoint folder the job resumes on the other host at
its checkpoint step and finishes; without shared storage the move is refused and the job runs on where it was."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from enforcer.actuators.drive import drive_actions
from enforcer.migration import MoveRefused, action_log, plan_action, start_migration
from enforcer.plan_store import apply_plan
from store.db import Store
from store.errors import InvalidInput
from store.migrations import upgrade
from store.models import Action, Checkpoint, HostStorage, Placement, Plan, Workflow
from store.settings import Settings, get_settings
from tests.collector.agent_helpers import wait_for
from tests.conftest import PROJECT_ROOT
from tests.enforcer.migration_helpers import (
    FAST,
    AgentProc,
    action,
    assert_steps_cover,
    last_step,
    pid_alive,
    step_rows,
    train_cmd,
    workflow,
)
from ui.serve.run import run_managed

pytestmark = [pytest.mark.slow, pytest.mark.pg]


@dataclass
class TwoHosts:
    store: Store
    a: AgentProc
    b: AgentProc
    settings: Settings  # what `fleetlens run` on host A uses

    def launch(self, total: int, **options) -> str:
        job, _ = run_managed(self.store, train_cmd(total, step_sleep=0.05), detach=True, settings=self.settings,
                             movable=True, cwd=PROJECT_ROOT, steps=total, mem_bytes=64 << 20, **options)
        return job.workflow_id

    def placement(self, workflow_id: str) -> Placement:
        with self.store.session() as s:
            row = s.scalar(select(Placement).where(Placement.workflow_id == workflow_id, Placement.state == "active"))
            s.expunge_all()
            return row


def _jobs_of(host_ids: set[str]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FLEETLENS_MANAGED") in host_ids:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture(name="hosts")
def hosts_fixture(fleet_home: Path, pg_url: str, tmp_path: Path) -> Iterator[TwoHosts]:
    store = Store(pg_url)
    upgrade(store)
    probe = {"FLEETLENS_STORAGE_PROBE_S": "1"}
    a = AgentProc(tmp_path / "host-a", db_url=pg_url, **probe).start(store)
    b = AgentProc(tmp_path / "host-b", db_url=pg_url, **probe).start(store)
    settings = get_settings(fresh=True).model_copy(update={"host_id": a.host_id, "home": a.home, "db_url": pg_url})
    try:
        yield TwoHosts(store, a, b, settings)
    finally:
        a.stop()
        b.stop()
        left = _jobs_of({a.host_id, b.host_id})  # found by the environment the agents gave them
        for proc in left:
            proc.kill()
        psutil.wait_procs(left, timeout=10)
        store.dispose()


def _readable(hosts: TwoHosts, host_id: str, url: str) -> bool:
    with hosts.store.session() as s:
        row = s.get(HostStorage, (host_id, url))
        return row is not None and row.readable


def test_a_job_moves_to_another_host_through_a_shared_checkpoint_folder_and_finishes(
        hosts: TwoHosts, tmp_path: Path) -> None:
    total = 240
    shared = tmp_path / "shared-checkpoints"
    wf_id = hosts.launch(total, name="crosser", checkpoint_url=str(shared))
    first = hosts.placement(wf_id)
    assert first.host_id == hosts.a.host_id
    location = workflow(hosts.store, wf_id).checkpoint_url
    assert location == str(shared / wf_id)
    wait_for(lambda: _readable(hosts, hosts.b.host_id, location), timeout=30)  # B's agent says it can read it
    wait_for(lambda: last_step(hosts.store, wf_id) >= 30, timeout=90)

    target = hosts.b.devices(hosts.store)[0].id
    action_id = start_migration(hosts.store, wf_id, target, settings=hosts.settings)
    states = drive_actions(hosts.store, action_ids=[action_id], settings=hosts.settings,
                           migration_options=FAST, timeout_s=120)
    assert states == {action_id: "resumed"}, action_log(hosts.store, action_id)

    moved = action(hosts.store, action_id)
    with hosts.store.session() as s:
        ckpt = s.get(Checkpoint, moved.checkpoint_id)
        s.expunge_all()
    # the checkpoint is a fact: written on A, recorded by A's agent, in the shared folder, its sha256 the file's
    assert ckpt.host_id == hosts.a.host_id and ckpt.workflow_id == wf_id and ckpt.step == moved.checkpoint_step
    assert Path(ckpt.url).parent == shared / wf_id
    data = Path(ckpt.url).read_bytes()
    assert (ckpt.sha256, ckpt.size_bytes) == (hashlib.sha256(data).hexdigest(), len(data))
    assert moved.checkpoint_step >= 30

    here = hosts.placement(wf_id)
    assert here.host_id == hosts.b.host_id and here.device_id == target and not pid_alive(first.pid)
    assert psutil.Process(here.pid).environ()["FLEETLENS_MANAGED"] == hosts.b.host_id
    wait_for(lambda: workflow(hosts.store, wf_id).state == "finished", timeout=120)

    rows = step_rows(hosts.store, wf_id)
    on_b = [r for r in rows if r.pid == here.pid]
    assert min(r.first_step for r in on_b) >= moved.checkpoint_step  # resumed at or past the checkpoint step
    assert max(r.last_step for r in on_b) == total - 1  # and finished with the full step count
    assert_steps_cover(hosts.store, wf_id, total)
    assert f"resumed at step {min(r.first_step for r in on_b)}" in " | ".join(
        e["message"] for e in action_log(hosts.store, action_id))


def test_without_shared_storage_the_move_is_refused_and_the_job_runs_on(hosts: TwoHosts) -> None:
    wf_id = hosts.launch(100_000, name="homebound")  # checkpoints into host A's own FLEETLENS_HOME
    before = hosts.placement(wf_id)
    wait_for(lambda: last_step(hosts.store, wf_id) >= 5, timeout=90)
    target = hosts.b.devices(hosts.store)[0].id

    with pytest.raises(InvalidInput, match="refused: .*own FLEETLENS_HOME.*cannot read"):
        start_migration(hosts.store, wf_id, target, settings=hosts.settings)
    move = {"workflow_id": wf_id, "from_device_id": before.device_id, "to_device_id": target, "to_lane_id": None,
            "new_lane": "new-1", "lane_size": 1 << 30, "p_prime": 71 << 20, "ephemeral": 0, "util": 0.5,
            "compute_share": 0.5, "expected_slowdown": 1.0, "rules": ["idle_holder"]}
    with hosts.store.session() as s:
        plan = Plan(created_at=time.time(), policy="pack", moves=[move], summary={})
        s.add(plan)
        s.flush()
        plan_id = plan.id
    with pytest.raises(InvalidInput, match="refused to move.*cannot read"):
        apply_plan(hosts.store, plan_id, settings=hosts.settings)
    # a move begun by any other way (an actuator's begin, a hand-made action) meets the same check, once, before it
    # is recorded: no actuator ever receives it
    with hosts.store.session() as s:
        with pytest.raises(MoveRefused, match="cannot read.*runs on where it is"):
            plan_action(s, wf_id, "pack", before.device_id, target, None, now=time.time(), message="planned by hand",
                        detail={}, settings=hosts.settings)
    with hosts.store.session() as s:
        assert s.scalars(select(Action)).all() == []

    after = hosts.placement(wf_id)
    assert (after.id, after.host_id, after.pid) == (before.id, hosts.a.host_id, before.pid) and pid_alive(before.pid)
    assert workflow(hosts.store, wf_id).state == "running"
    step = last_step(hosts.store, wf_id)
    wait_for(lambda: last_step(hosts.store, wf_id) > step + 5, timeout=60)  # still training, nothing lost
    with hosts.store.session() as s:
        assert s.scalars(select(Checkpoint).where(Checkpoint.workflow_id == wf_id)).all() == []
        assert s.get(Workflow, wf_id).checkpoint_url is None


def test_a_host_that_cannot_see_the_shared_folder_says_so_and_the_move_there_is_refused(
        hosts: TwoHosts, tmp_path: Path) -> None:
    shared = tmp_path / "mounted-on-a-only"
    wf_id = hosts.launch(100_000, name="unseen", checkpoint_url=str(shared))
    location = workflow(hosts.store, wf_id).checkpoint_url
    # host C: a third agent whose filesystem does not have the shared folder (its own mount namespace)
    c = AgentProc(tmp_path / "host-c", db_url=hosts.settings.db_url, hide=shared, FLEETLENS_STORAGE_PROBE_S="1")
    try:
        c.start(hosts.store)

        def c_says() -> HostStorage | None:
            with hosts.store.session() as s:
                row = s.get(HostStorage, (c.host_id, location))
                s.expunge_all()
                return row

        wait_for(lambda: c_says() is not None, timeout=30)
        assert c_says().readable is False and location in c_says().error
        wait_for(lambda: _readable(hosts, hosts.b.host_id, location), timeout=30)  # B sees it: the contrast
        wait_for(lambda: last_step(hosts.store, wf_id) >= 5, timeout=90)
        before = hosts.placement(wf_id)
        with pytest.raises(InvalidInput, match=f"refused: host {c.host_id} cannot read {location}"):
            start_migration(hosts.store, wf_id, c.devices(hosts.store)[0].id, settings=hosts.settings)
        assert hosts.placement(wf_id).pid == before.pid and pid_alive(before.pid)
    finally:
        c.stop()
