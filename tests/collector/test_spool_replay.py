"""Spooled batches reach the store once, whole and on their own devices: a batch an agent of another version spooled
(metrics added or removed since), a batch written just before the agent died, before it could forget it, and a batch
spooled before a reboot that numbered the GPUs otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from collector.agent import Agent
from collector.agent_batch import DEVICE_FIELDS, PROCESS_FIELDS
from collector.sources.base import DeviceInfo, DeviceReading
from collector.spool import Spool
from store.errors import DatabaseUnavailable
from store.models import Device, DeviceSample, ProcessSample
from store.samples import INT_METRICS
from store.settings import Settings
from tests.collector.agent_helpers import StubSource, count_samples


@pytest.fixture
def settings(fleet_home: Path) -> Settings:
    return Settings()


def agent_of(store, settings) -> Agent:
    return Agent(store, settings, StubSource(n=1), host_id="h", serve_socket=False,
                 attribute=lambda pid: ("wf", "env"))


def test_a_batch_spooled_by_an_agent_of_another_version_is_written_with_what_it_has(any_store, settings):
    """An older agent did not sample tensor_active; a newer one sampled a metric this one does not store."""
    device_fields = [f for f in DEVICE_FIELDS if f != "tensor_active"] + ["nvlink_bytes"]
    process_fields = [f for f in PROCESS_FIELDS if f != "cpu_util"]
    agent = agent_of(any_store, settings)
    device_row = [0, *({"ts": 100.0}.get(f, 1 if f in INT_METRICS else 0.5) for f in device_fields)]
    known = {"workflow_id": "wf", "pid": 7, "ts": 100.0, "mem_used": 4096}
    process_row = [0, *(known.get(f, 0.25) for f in process_fields)]
    agent.spool.put({"v": 1, "host_id": "h", "device_fields": device_fields, "process_fields": process_fields,
                     "devices": [device_row], "processes": [process_row], "workflows": {"wf": "env"}}, rows=2)
    assert agent.flush()
    assert len(agent.spool) == 0 and agent.spool.dropped_batches == 0
    with any_store.session() as s:
        d = s.execute(select(DeviceSample)).scalar_one()
        p = s.execute(select(ProcessSample)).scalar_one()
    assert (d.ts, d.gpu_util, d.mem_used, d.sm_active, d.tensor_active) == (100.0, 0.5, 1, 0.5, None)
    assert (p.pid, p.workflow_id, p.mem_used, p.sm_util, p.cpu_util) == (7, "wf", 4096, 0.25, None)


class Killed(BaseException):
    """The agent's process ending between two statements (SIGKILL, power lost)."""


def test_a_batch_written_just_before_the_agent_died_is_not_written_twice_by_the_next_agent(any_store, settings,
                                                                                           monkeypatch):
    first = agent_of(any_store, settings)
    assert first._try_register()
    first.sample_once()
    first.sample_once()
    with first._batch_lock:  # the database was away at this flush: the batch went to the spool
        batch = first._batch
        first._batch = type(batch)()
    first.spool.put(batch.to_json("h"), batch.rows)

    def killed(_segment) -> None:
        raise Killed

    monkeypatch.setattr(first.spool, "ack", killed)  # written, then killed before the spool forgot the batch
    with pytest.raises(Killed):
        first.flush()
    taken = (first.stats.device_rows, first.stats.process_rows)
    assert count_samples(any_store) == taken == (2, 2)
    again = agent_of(any_store, settings)  # the restarted agent finds the batch in the spool and sends it
    assert len(again.spool) == 1
    assert again.flush() and len(again.spool) == 0
    assert count_samples(any_store) == taken


class NumberedSource(StubSource):
    """Two GPUs, numbered in the order `uuids` gives; each one's utilisation tells which GPU it is."""

    name = "nvml"
    util = {"GPU-x": 0.1, "GPU-y": 0.9}

    def __init__(self, uuids: list[str]) -> None:
        super().__init__(n=len(uuids), pids=[])
        self.uuids = uuids

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(i, u, "A100", 1 << 30) for i, u in enumerate(self.uuids)]

    def sample(self) -> list[DeviceReading]:
        return [DeviceReading(index=i, ts=100.0, gpu_util=self.util[u]) for i, u in enumerate(self.uuids)]


def test_a_batch_spooled_before_a_reboot_that_numbered_the_gpus_otherwise_goes_to_its_own_gpus(any_store, settings,
                                                                                                monkeypatch):
    before = Agent(any_store, settings, NumberedSource(["GPU-x", "GPU-y"]), host_id="h", serve_socket=False)
    assert before._try_register()
    before.sample_once()

    def away(*_a, **_k) -> None:
        raise DatabaseUnavailable("the database is away")

    monkeypatch.setattr(before, "_send", away)
    assert not before.flush() and len(before.spool) == 1
    after = Agent(any_store, settings, NumberedSource(["GPU-y", "GPU-x"]), host_id="h", serve_socket=False)
    assert after.flush() and len(after.spool) == 0 and after.stats.rows_dropped == 0
    with any_store.session() as s:
        stored = dict(s.execute(select(Device.uuid, DeviceSample.gpu_util)
                                .join(DeviceSample, DeviceSample.device_id == Device.id)).all())
    assert stored == NumberedSource.util


def test_an_agent_spools_into_the_spool_it_is_given_even_an_empty_one(sqlite_store, settings, tmp_path):
    """An empty Spool is falsy: the agent put the default folder's spool in its place and spooled there."""
    given = Spool(tmp_path / "given", 1 << 20)
    agent = Agent(sqlite_store, settings, StubSource(n=1), host_id="h", serve_socket=False, spool=given)
    assert agent.spool is given
