"""A NaN or infinite metric (a GPM rate over no time, a source's division by nothing) is stored as not reported: it
used to make the spool refuse the whole batch (JSON has no NaN), so an outage lost every row of the flush with it."""

from __future__ import annotations

import math
from pathlib import Path

import pynvml
import pytest
from sqlalchemy import select

import collector.sources.nvml as nvml_mod
from collector.agent import Agent
from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer, connect
from collector.sources.nvml import NvmlSource
from collector.spool import Spool
from store.db import Store
from store.migrations import upgrade
from store.models import DeviceSample, ProcessSample, StepStat
from store.settings import Settings
from tests.collector.agent_helpers import StubSource, count_samples, wait_for
from tests.collector.test_context_memory import batch
from tests.fakes.fake_pynvml import FakeGPU, FakeNVML, GiB


class BadValueSource(StubSource):
    """The stub's devices, the first reading `bad` as its SM activity and its process's SM utilisation."""

    def __init__(self, bad: float) -> None:
        super().__init__(2)
        self.bad = bad

    def sample(self):
        readings = super().sample()
        readings[0].sm_active = self.bad
        for p in readings[0].processes:
            p.sm_util = self.bad
        return readings


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nan_metric_through_an_outage_loses_no_row_and_the_flusher_goes_on(tmp_path: Path, fleet_home: Path,
                                                                           bad: float) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    store = Store(f"sqlite:///{folder / 'fleetlens.db'}")
    upgrade(store)
    store.dispose()
    away = tmp_path / "db-away"
    folder.rename(away)  # the database is away: every flush spools
    agent = Agent(store, Settings(), BadValueSource(bad), host_id="h-nan", sample_interval_s=0.05,
                  flush_interval_s=0.2, serve_socket=False).start()
    try:
        wait_for(lambda: agent.stats.batches_spooled >= 2)
        away.rename(folder)
        wait_for(lambda: len(agent.spool) == 0 and agent.stats.batches_written >= 1)
    finally:
        agent.stop()
    assert agent.spool.dropped_rows == 0
    assert count_samples(store, "h-nan") == (agent.stats.device_rows, agent.stats.process_rows)
    with store.session() as s:
        active = s.scalars(select(DeviceSample.sm_active)).all()
        util = s.scalars(select(DeviceSample.gpu_util)).all()
        sm = s.scalars(select(ProcessSample.sm_util)).all()
    assert set(active) == {None} and set(util) == {0.5}  # the bad value is not reported; the row's others are kept
    assert set(sm) == {None}
    assert agent.stats.nonfinite_values == 2 * agent.stats.rounds  # the device's and its process's, each round


def test_the_spool_counts_a_batch_it_cannot_keep_rather_than_raise(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1 << 20)
    assert spool.put({"devices": [[0, 1.0, math.nan]]}, rows=1) is None
    assert (spool.dropped_batches, spool.dropped_rows, len(spool)) == (1, 1, 0)


def test_nvml_gpm_rates_that_are_no_number_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML([FakeGPU(name="NVIDIA H100 80GB HBM3", memory_used=20 * GiB, gpu_util=87,
                             gpm={pynvml.NVML_GPM_METRIC_SM_UTIL: math.nan,
                                  pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: math.inf,
                                  pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 40.0})])
    monkeypatch.setattr(nvml_mod, "pynvml", fake)
    source = NvmlSource()
    source.sample()  # GPM rates need two samples
    r = source.sample()[0]
    assert (r.sm_active, r.sm_occupancy, r.tensor_active, r.gpu_util) == (None, None, 0.4, 0.87)


class _Echo:
    def handle(self, msg):
        return {"ok": True, "got": msg}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_the_sdk_socket_refuses_nan_with_an_error_reply(tmp_path: Path, constant: str) -> None:
    """Python's json reads NaN; a step summary holding one made the database refuse the step rows of every job queued
    with it. The job that sent it gets an error; the connection stays open."""
    server = SocketServer(str(tmp_path / "a.sock"), _Echo()).start()
    try:
        with connect(str(tmp_path / "a.sock"), timeout=10.0) as sock:
            reader = sock.makefile("rb")
            sock.sendall(b'{"op":"steps","mean_s":' + constant.encode() + b"}\n")
            bad = reader.readline()
            sock.sendall(b'{"op":"steps","mean_s":0.5}\n')
            good = reader.readline()
    finally:
        server.stop()
    assert b'"ok":false' in bad and constant.lstrip("-").encode() in bad
    assert b'"ok":true' in good


def test_a_nan_metric_is_stored_as_not_reported_on_either_database(any_store: Store, fleet_home: Path) -> None:
    """With the database up, SQLite kept a NaN as NULL and PostgreSQL as NaN, which every mean over the column (the
    rollups' sm_active_mean) then was."""
    agent = Agent(any_store, Settings(), BadValueSource(math.nan), host_id="h-up", serve_socket=False)
    try:
        agent.sample_once()
        assert agent.flush()
    finally:
        agent.stop()
    with any_store.session() as s:
        assert s.scalars(select(DeviceSample.sm_active).where(DeviceSample.gpu_util == 0.5)).all() == [None, None]
        assert s.scalars(select(ProcessSample.sm_util)).all() == [None, None]


def test_a_step_summary_with_a_value_that_is_no_number_is_refused_and_the_others_are_written(
        sqlite_store: Store, fleet_home: Path) -> None:
    """The database refused the whole write of the queued step summaries for one bad value: every job's were
    dropped with it."""
    handlers = SdkHandlers(sqlite_store, "h1", Settings(), sync_interval_s=3600)
    try:
        bad = batch(1000.0, None)
        bad["mean_s"] = "slow"
        reply = handlers.handle({"op": "steps", "v": 1, "workflow": "bad", "pid": 1, "batches": [bad]})
        assert reply["ok"] is False and "mean_s" in reply["error"]
        assert handlers.handle({"op": "steps", "v": 1, "workflow": "good", "pid": 2,
                                "batches": [batch(1000.0, None)]}).get("ok") is not False
        handlers.flush()
    finally:
        handlers.close()
    with sqlite_store.session() as s:
        assert s.scalars(select(StepStat.workflow_id)).all() == ["good"]


@pytest.mark.parametrize(("field", "value"), [("first_step", 3 * 10**9), ("last_step", 10**400), ("n_steps", -1),
                                              ("first_step", 2.5), ("workflow", "w" * 513)])
def test_what_the_store_cannot_hold_is_refused_to_the_job_that_sent_it(sqlite_store: Store, fleet_home: Path,
                                                                       field: str, value) -> None:
    """A step number past the store's 32-bit column, or a workflow id past its 512 characters, was taken, queued and
    then given up when the database refused it; the job was never told."""
    handlers = SdkHandlers(sqlite_store, "h1", Settings(), sync_interval_s=3600)
    try:
        message = {"op": "steps", "v": 1, "workflow": "bad", "pid": 1, "batches": [batch(1000.0, None)]}
        if field == "workflow":
            message["workflow"] = value
        else:
            message["batches"][0][field] = value
        reply = handlers.handle(message)
        assert reply["ok"] is False and (field if field != "workflow" else "512-character limit") in reply["error"]
        at_edge = batch(1000.0, None)
        at_edge["last_step"] = 2**31 - 1
        assert handlers.handle({"op": "steps", "v": 1, "workflow": "g" * 512, "pid": 2,
                                "batches": [at_edge]}).get("ok") is not False
        handlers.flush()
    finally:
        handlers.close()
    with sqlite_store.session() as s:
        assert s.scalars(select(StepStat.last_step)).all() == [2**31 - 1]
    assert handlers.stats.sdk_rows_refused == 0
