"""The memory a job's process holds outside PyTorch's caching allocator (C), measured by the agent: NVML's per-process
used memory (the sampler) less the allocator's reserved bytes (the SDK's step batches), put on the workflow, and
taken by admission in place of the default."""

from __future__ import annotations

import os
import time

import pytest

from collector.agent import Agent
from collector.sdk_context import ContextMeter
from collector.sdk_handlers import SdkHandlers
from enforcer.managed import register_managed
from store.db import Store
from store.device_memory import CONTEXT_LABEL, MEM_STEPS_LABEL, known_context
from store.errors import InvalidInput
from store.models import Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.workflows import upsert_workflow
from tests.collector.agent_helpers import StubSource
from tests.conftest import PROJECT_ROOT

MiB, GiB = 1 << 20, 1 << 30


def batch(ts_end: float, reserved: int | None, source: str = "cuda") -> dict:
    return {"first_step": 0, "last_step": 9, "n_steps": 10, "ts_start": ts_end - 1, "ts_end": ts_end,
            "mean_s": 0.1, "p50_s": 0.1, "p95_s": 0.1, "max_s": 0.2, "mem_persistent": GiB,
            "mem_peak": 2 * GiB, "mem_source": source, "mem_reserved": reserved}


def test_a_pair_close_in_time_measures_the_memory_outside_the_allocator() -> None:
    meter = ContextMeter(window_s=5.0)
    assert meter.note_nvml(7, 3 * GiB, 100.0) is None  # nothing to pair with yet
    assert meter.note_reserved("wf", 7, int(2.5 * GiB), 102.0) == "wf"
    assert meter.workflow_context("wf") == GiB // 2
    # a reading too far from its partner is not paired
    assert meter.note_reserved("wf", 7, GiB, 110.0) is None
    assert meter.workflow_context("wf") == GiB // 2
    # allocator bigger than NVML's figure (readings straddling a change): no negative context
    meter.note_nvml(8, GiB, 200.0)
    meter.note_reserved("wf2", 8, 2 * GiB, 200.0)
    assert meter.workflow_context("wf2") == 0


def test_the_median_of_a_processs_pairs_is_kept_and_the_largest_process_wins() -> None:
    meter = ContextMeter()
    # a lane job: pairs straddle its turn's end now and then, off by its E (2 GiB) either way
    for k, off in enumerate([0, 0, 2 * GiB, 0, -GiB // 4, 0, 0]):
        meter.note_nvml(7, 3 * GiB + 400 * MiB + off, 1000.0 + k)
        meter.note_reserved("wf", 7, 3 * GiB, 1000.0 + k)
    assert meter.process_context("wf", 7) == 400 * MiB
    for k in range(3):  # a second rank with a bigger context
        meter.note_nvml(9, GiB + 600 * MiB, 2000.0 + k)
        meter.note_reserved("wf", 9, GiB, 2000.0 + k)
    assert meter.workflow_context("wf") == 600 * MiB
    meter.forget(9)
    assert meter.workflow_context("wf") == 600 * MiB  # a process that ended keeps what it showed
    with pytest.raises(ValueError, match="pairing window"):
        ContextMeter(window_s=0)


def test_readings_of_processes_that_never_report_are_not_kept_forever() -> None:
    from collector.sdk_context import MAX_UNPAIRED

    meter = ContextMeter(window_s=5.0)
    for pid in range(3 * MAX_UNPAIRED):  # one reading each, a second apart, none ever paired
        meter.note_nvml(pid, GiB, float(pid))
    assert len(meter._nvml) <= MAX_UNPAIRED + 1
    assert meter.note_reserved("late", 3 * MAX_UNPAIRED - 1, GiB // 2, 3 * MAX_UNPAIRED - 1.0) == "late"


def test_the_agent_pairs_nvml_with_the_sdk_and_admission_charges_the_measurement(
        sqlite_store: Store, fleet_home) -> None:
    settings = Settings()
    pid = os.getpid()
    source = StubSource(n=1, pids=[pid])  # NVML shows 4096 bytes used by this process
    handlers = SdkHandlers(sqlite_store, "host-a", settings, sync_interval_s=3600)
    agent = Agent(sqlite_store, settings, source, host_id="host-a", sample_interval_s=3600, flush_interval_s=3600,
                  attribute=lambda p: ("measured", "env"), serve_socket=False, sdk_handler=handlers)
    try:
        agent.sample_once()
        now = time.time()
        reply = handlers.handle({"op": "steps", "v": 1, "workflow": "measured", "pid": pid,
                                 "batches": [batch(now, 1024)]})
        assert reply.get("ok") is not False and "error" not in reply
        handlers.flush()
        with sqlite_store.session() as s:
            wf = s.get(Workflow, "measured")
            assert wf.labels[CONTEXT_LABEL] == 4096 - 1024
            assert known_context(wf) == 3072
        # host-memory batches (a CPU job) never pair: a process without a CUDA context
        handlers.handle({"op": "steps", "v": 1, "workflow": "cpu-job", "pid": pid + 1,
                         "batches": [batch(now, 1024, source="rss")]})
        handlers.flush()
        with sqlite_store.session() as s:
            assert CONTEXT_LABEL not in (s.get(Workflow, "cpu-job").labels or {})
            assert known_context(s.get(Workflow, "cpu-job")) == 0
    finally:
        agent.stop()
        handlers.close()


def test_known_context_follows_where_the_memory_came_from(sqlite_store: Store) -> None:
    with sqlite_store.session() as s:
        nvml = upsert_workflow(s, "nvml-sized", now=1.0)  # no SDK profile, nothing declared
        declared = upsert_workflow(s, "declared", now=1.0, mem_persistent=GiB, mem_ephemeral=0)
        sdk = upsert_workflow(s, "sdk", now=1.0, mem_persistent=GiB, mem_ephemeral=0,
                              labels={"mem_source": "cuda", MEM_STEPS_LABEL: 50})
        measured = upsert_workflow(s, "measured", now=1.0, mem_persistent=GiB, mem_ephemeral=0,
                                   labels={"mem_source": "cuda", CONTEXT_LABEL: 300 * MiB})
        bad = upsert_workflow(s, "bad", now=1.0, mem_persistent=GiB, labels={CONTEXT_LABEL: "lots"})
        assert known_context(nvml) == 0  # NVML's figure includes the context
        assert known_context(declared) is None and known_context(sdk) is None  # allocator figures: the default
        assert known_context(measured) == 300 * MiB
        assert known_context(bad) is None  # not a byte count: the default, not a guess


def test_fleetlens_run_charges_a_measured_context_in_place_of_the_default(sqlite_store: Store, fleet_home) -> None:
    """A 7 GiB GPU and jobs of P = 6 GiB (P' 6.6 GiB): the 0.5 GiB default context does not fit beside the lane, a
    measured 64 MiB does; a measured 2 GiB context refuses even a 5 GiB job."""
    conf = Settings(home=fleet_home, host_id="h1", memory_seen_steps=1, secret="t")
    with sqlite_store.session() as s:
        register_host(s, "h1", hostname="h1", source="nvml", now=1.0)
        register_devices(s, "h1", [DeviceSpec(0, "GPU-0", "T4", 7 * GiB)], source="nvml", now=1.0)
        for name, persistent, context in (("no-ctx", 6 * GiB, None), ("small-ctx", 6 * GiB, 64 * MiB),
                                          ("big-ctx", 5 * GiB, 2 * GiB)):
            labels = {"mem_source": "cuda", MEM_STEPS_LABEL: 5}
            if context is not None:
                labels[CONTEXT_LABEL] = context
            upsert_workflow(s, name, now=1.0, mem_persistent=persistent, mem_ephemeral=0, labels=labels)

    def run(name: str):
        return register_managed(sqlite_store, ["python", "t.py"], settings=conf, lane="auto", workflow_id=name,
                                cwd=PROJECT_ROOT, policy="pack", util=0.2)

    with pytest.raises(InvalidInput, match=f"{512 * MiB} of CUDA context"):
        run("no-ctx")  # 6.6 GiB + the default 0.5 GiB > 7 GiB
    with pytest.raises(InvalidInput, match=f"{2 * GiB} of CUDA context"):
        run("big-ctx")  # 5.5 GiB + 2 GiB measured > 7 GiB
    placed = run("small-ctx")  # 6.6 GiB + 64 MiB measured fits
    assert placed.lane_id is not None
