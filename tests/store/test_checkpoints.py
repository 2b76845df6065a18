"""Checkpoint facts, checkpoint locations through fsspec, host storage probes and signed relaunch specs, on a real
SQLite store and real files (and fsspec's in-memory filesystem standing in for an object store)."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from sqlalchemy import func, select

from collector.storage_prober import probe_storage
from enforcer.managed import register_managed
from enforcer.move_checks import move_refusal
from enforcer.plan_store import apply_plan
from store.checkpoints import (
    check_location,
    digest,
    latest_checkpoint,
    location_for,
    locations_to_probe,
    probe,
    probed_for,
    readable_hosts_by_workflow,
    record_checkpoint,
    record_probes,
    unreadable_reason,
)
from store.db import Store
from store.errors import InvalidInput
from store.models import Action, Device, Placement, Plan, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import get_settings
from store.workflows import spec_refusal
from tests.conftest import PROJECT_ROOT


@pytest.fixture(name="fleet")
def fleet_fixture(fleet_home: Path, sqlite_store: Store) -> Store:
    with sqlite_store.session() as s:
        for host in ("a", "b"):
            register_host(s, host, hostname=host, source="cpu")
            register_devices(s, host, [DeviceSpec(i, f"cpu:{host}:{i}", f"cpu core {i}", 8 << 30, (i,))
                                        for i in range(3)], source="cpu")
    return sqlite_store


def _register(store: Store, **options) -> Workflow:
    settings = get_settings(fresh=True).model_copy(update={"host_id": "a"})
    job = register_managed(store, [sys.executable, "-c", "pass"], settings=settings, movable=True, name="j",
                           cwd=PROJECT_ROOT, **options)
    with store.session() as s:
        wf = s.get(Workflow, job.workflow_id)
        s.expunge_all()
        return wf


def test_locations_are_urls_and_an_object_store_needs_its_backend(tmp_path: Path) -> None:
    assert location_for(str(tmp_path), "my job/1") == str(tmp_path / "my_job_1")
    assert location_for(f"file://{tmp_path}/", "w") == str(tmp_path / "w")
    assert location_for("memory://bucket/ckpt/", "w") == "memory://bucket/ckpt/w"
    check_location("memory://bucket/ckpt/w")  # an object store with its backend: fine
    with pytest.raises(InvalidInput, match="fsspec backend that is not installed.*s3fs"):
        check_location("s3://bucket/ckpt/w")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InvalidInput, match="cannot be written"):
        check_location(str(blocker / "ckpt"))
    fsspec.open("memory://bucket/ckpt/w/step-1.pt", "wb").open().write(b"abc")
    assert digest("memory://bucket/ckpt/w/step-1.pt") == (hashlib.sha256(b"abc").hexdigest(), 3)
    assert probe("memory://bucket/ckpt/w") is None
    assert "not a folder" in probe(str(tmp_path / "missing"))
    assert "no fsspec backend" in probe("s3://bucket/x")


def test_a_checkpoint_is_recorded_and_the_newest_is_found(fleet: Store, tmp_path: Path) -> None:
    wf = _register(fleet, checkpoint_url=str(tmp_path / "shared"))
    assert wf.checkpoint_url == str(tmp_path / "shared" / wf.id) and wf.checkpoint_dir == wf.checkpoint_url
    with fleet.session() as s:
        assert latest_checkpoint(s, wf.id) is None
        record_checkpoint(s, wf.id, host_id="a", url="/x/1", step=10, sha256="0" * 64, size_bytes=5, now=1.0)
        record_checkpoint(s, wf.id, host_id="a", url="/x/2", step=20, sha256="1" * 64, size_bytes=6, now=2.0)
    with fleet.session() as s:
        newest = latest_checkpoint(s, wf.id)
        assert (newest.step, newest.url, newest.size_bytes) == (20, "/x/2", 6)


def test_a_move_to_another_host_needs_that_host_to_say_it_reads_the_location(fleet: Store, tmp_path: Path) -> None:
    local = _register(fleet)
    shared = _register(fleet, checkpoint_url=str(tmp_path / "shared"))
    with fleet.session() as s:
        assert locations_to_probe(s, "memory://fleet") == sorted([shared.checkpoint_url, "memory://fleet"])
        assert unreadable_reason(s, local, "a", "a", max_age_s=60) is None  # same host: its own disk
        assert "own FLEETLENS_HOME" in unreadable_reason(s, local, "a", "b", max_age_s=60)
        assert "has not said" in unreadable_reason(s, shared, "a", "b", max_age_s=60, now=100.0)
        record_probes(s, "b", [(shared.checkpoint_url, "permission denied")], now=100.0)
    with fleet.session() as s:
        assert "cannot read" in unreadable_reason(s, shared, "a", "b", max_age_s=60, now=101.0)
        assert "permission denied" in unreadable_reason(s, shared, "a", "b", max_age_s=60, now=101.0)
        record_probes(s, "b", [(shared.checkpoint_url, None)], now=100.0)
    with fleet.session() as s:
        assert unreadable_reason(s, shared, "a", "b", max_age_s=60, now=101.0) is None
        assert "ago" in unreadable_reason(s, shared, "a", "b", max_age_s=60, now=200.0)  # a stale probe


def test_the_relaunch_spec_is_signed_at_registration_and_any_change_is_refused(fleet: Store) -> None:
    wf = _register(fleet, env={"DATA": "/data"})
    secret = get_settings().secret_bytes()
    assert wf.spec_env == {"DATA": "/data"} and spec_refusal(wf, secret) is None
    assert "another FLEETLENS_SECRET" in spec_refusal(wf, b"another key")
    for field, value in (("command", ["rm", "-rf", "/"]), ("cwd", "/"), ("spec_env", {"DATA": "/elsewhere"}),
                         ("checkpoint_dir", "/tmp/other"), ("checkpoint_url", "memory://other")):
        changed = Workflow(**{c.name: getattr(wf, c.name) for c in Workflow.__table__.columns})
        setattr(changed, field, value)
        assert "does not match the digest signed" in spec_refusal(changed, secret), field
    wf.spec_signature = None
    assert "no signed relaunch spec" in spec_refusal(wf, secret)


def test_a_move_the_target_host_cannot_make_safely_is_refused_when_it_is_begun(fleet: Store, tmp_path: Path) -> None:
    local = _register(fleet)
    shared = _register(fleet, checkpoint_url=str(tmp_path / "shared"))
    with fleet.session() as s:
        a2 = s.query(Device).filter(Device.host_id == "a").order_by(Device.index).all()[2].id
        b0 = s.query(Device).filter(Device.host_id == "b").first().id
        here = {}
        for p in s.scalars(select(Placement)):
            p.state, here[p.workflow_id] = "active", p.device_id  # both jobs running where they were placed
        record_probes(s, "b", [(shared.checkpoint_url, None)])
    settings = get_settings().model_copy(update={"host_id": "a"})
    with fleet.session() as s:
        # the local job cannot go to b; the shared one can; a move within host a needs no probe
        assert "own FLEETLENS_HOME" in move_refusal(s, s.get(Workflow, local.id), here[local.id], b0, None, 1 << 20, 0,
                                                    settings, now=time.time())
        assert move_refusal(s, s.get(Workflow, shared.id), here[shared.id], b0, None, 1 << 20, 0, settings,
                            now=time.time()) is None
        assert move_refusal(s, s.get(Workflow, local.id), here[local.id], a2, None, 1 << 20, 0, settings,
                            now=time.time()) is None

    def move(wf: Workflow, dst: int) -> dict:
        return {"workflow_id": wf.id, "from_device_id": here[wf.id], "to_device_id": dst, "to_lane_id": None,
                "new_lane": f"new-{wf.id}", "lane_size": 1 << 30, "p_prime": 1 << 20, "ephemeral": 0, "util": 0.5,
                "compute_share": 0.5, "expected_slowdown": 1.0, "rules": ["idle_holder"]}

    with fleet.session() as s:
        plan = Plan(created_at=time.time(), policy="pack", moves=[move(shared, b0), move(local, b0)], summary={})
        s.add(plan)
        s.flush()
        plan_id = plan.id
    with pytest.raises(InvalidInput, match=f"refused to move '{local.id}': .*own FLEETLENS_HOME.*nothing was moved"):
        apply_plan(fleet, plan_id, settings=settings)
    with fleet.session() as s:  # all or nothing: the shared job's move was not kept either
        assert s.scalar(select(func.count()).select_from(Action)) == 0 and not s.get(Plan, plan_id).applied


class GuardedMemory(MemoryFileSystem):
    """fsspec's in-memory filesystem (its store shared with memory://) that counts writes and can refuse them, as
    a read-only mount or a bucket without write permission does."""

    protocol = "guardedmem"
    writes = 0
    read_only = False

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.replace("guardedmem://", "memory://", 1))

    def pipe_file(self, path, value, **kwargs):
        if GuardedMemory.read_only:
            raise PermissionError(30, "Read-only file system", path)
        GuardedMemory.writes += 1
        return super().pipe_file(path, value, **kwargs)


@pytest.fixture
def guarded(monkeypatch):
    fsspec.register_implementation(GuardedMemory.protocol, GuardedMemory, clobber=True)
    monkeypatch.setattr(GuardedMemory, "writes", 0)
    monkeypatch.setattr(GuardedMemory, "read_only", False)
    return GuardedMemory


def test_the_probe_writes_reads_back_and_deletes_where_it_is_asked_to(guarded, tmp_path: Path) -> None:
    fsspec.open("memory://probe-bucket/ckpt/w/step-1.pt", "wb").open().write(b"abc")
    listing = sorted(fsspec.filesystem("memory").ls("/probe-bucket/ckpt/w", detail=False))
    assert probe("guardedmem://probe-bucket/ckpt/w", write_as="host/1") is None and guarded.writes == 1
    assert sorted(fsspec.filesystem("memory").ls("/probe-bucket/ckpt/w", detail=False)) == listing  # nothing left
    assert probe(str(tmp_path), write_as="host-1") is None and list(tmp_path.iterdir()) == []
    guarded.read_only = True  # readable, not writable
    assert probe("guardedmem://probe-bucket/ckpt/w") is None  # listing alone does not see it
    assert "cannot be written here" in probe("guardedmem://probe-bucket/ckpt/w", write_as="host-1")


def test_an_agent_probes_the_fleet_root_for_the_jobs_under_it_and_each_location_elsewhere(
        fleet: Store, guarded) -> None:
    root = "guardedmem://probe-fleet"
    jobs = [_register(fleet, checkpoint_url=root) for _ in range(2)]
    own = _register(fleet, checkpoint_url="guardedmem://elsewhere")  # a job's own location, outside the root
    for wf in (*jobs, own):
        fsspec.open(f"{wf.checkpoint_url}/step-1.pt", "wb").open().write(b"abc")
    settings = get_settings(fresh=True).model_copy(update={"host_id": "b", "checkpoint_url": root})

    guarded.writes = 0  # registering checked that each location can be written
    # one listing and one write at the root for both jobs under it, and the same at the location outside it
    assert probe_storage(fleet, settings, "b") == {root: None, own.checkpoint_url: None}
    assert guarded.writes == 2
    with fleet.session() as s:
        assert readable_hosts_by_workflow(s, [*jobs, own], max_age_s=60) == {
            wf.id: frozenset({"b"}) for wf in (*jobs, own)}
        assert unreadable_reason(s, jobs[0], "a", "b", max_age_s=60) is None  # the root's probe speaks for it
    guarded.read_only = True
    results = probe_storage(fleet, settings, "b")
    assert all("cannot be written here" in error for error in results.values()), results
    with fleet.session() as s:
        # host b no longer says it can take these jobs: a move there is refused with the reason
        assert readable_hosts_by_workflow(s, [*jobs, own], max_age_s=60) == {wf.id: frozenset() for wf in (*jobs, own)}
        reason = unreadable_reason(s, jobs[0], "a", "b", max_age_s=60)
        assert reason.startswith(f"host b cannot write {jobs[0].checkpoint_url}: {root} cannot be written here"), reason


def test_the_nearest_probe_above_a_location_decides_for_each_host(fleet: Store, tmp_path: Path) -> None:
    root = str(tmp_path / "fleet")
    wf = _register(fleet, checkpoint_url=root)
    assert probed_for(wf.checkpoint_url)[:2] == [wf.checkpoint_url, root]
    assert probed_for("s3://bucket/ckpt/w") == ["s3://bucket/ckpt/w", "s3://bucket/ckpt", "s3://bucket"]
    with fleet.session() as s:
        assert locations_to_probe(s, root + "/") == [root]  # the job's folder lies under the root
        register_host(s, "c", hostname="c", source="cpu")
        record_probes(s, "b", [(root, None)], now=100.0)
        record_probes(s, "c", [(root, None), (wf.checkpoint_url, "permission denied")], now=100.0)
    with fleet.session() as s:
        # c said it cannot read the job's own folder: that is nearer than its root's answer
        assert readable_hosts_by_workflow(s, [wf], max_age_s=60, now=101.0) == {wf.id: frozenset({"b"})}
        assert unreadable_reason(s, wf, "a", "b", max_age_s=60, now=101.0) is None
        assert "permission denied" in unreadable_reason(s, wf, "a", "c", max_age_s=60, now=101.0)
        # an answer older than max_age_s no longer counts, and the reason says how old it is
        assert readable_hosts_by_workflow(s, [wf], max_age_s=60, now=200.0) == {wf.id: frozenset()}
        assert "100 s ago" in unreadable_reason(s, wf, "a", "b", max_age_s=60, now=200.0)
