"""The three real traces under every policy (a subset of openb here; the benchmark runs all of it)."""

from __future__ import annotations

import pytest

from enforcer.sim.runner import DEFAULT_POLICIES, read_trace, simulate
from tests.conftest import FLEET
from tests.sim.invariants import assert_invariants


@pytest.fixture(scope="module")
def traces():
    return {
        "salus": read_trace("salus", FLEET / "salus_workloads.csv", n_jobs=60, seed=1),
        "alibaba": read_trace("alibaba", FLEET),
        "openb": read_trace("openb", FLEET / "openb_pod_list_default.csv"),
    }


@pytest.mark.parametrize("policy", DEFAULT_POLICIES)
def test_salus_every_policy(traces, policy):
    (result,) = simulate(traces["salus"], [policy], check=True)
    assert_invariants(result)
    assert result.metrics["finished"] == 60 and result.metrics["devices_needed"] == 1


@pytest.mark.parametrize("policy", ["srtf", "fair", "pack"])
def test_salus_one_lane(traces, policy):
    (result,) = simulate(traces["salus"], [policy], one_lane=True, check=True)
    assert_invariants(result)


def test_salus_srtf_beats_fifo_on_one_device(traces):
    fifo, srtf = simulate(traces["salus"], ["fifo", "srtf"], one_lane=True)
    assert srtf.metrics["jct_mean_s"] < fifo.metrics["jct_mean_s"]
    # same work on one device, no idling: the device is busy just as long
    assert srtf.metrics["device_hours"] == pytest.approx(fifo.metrics["device_hours"])


@pytest.mark.parametrize("policy", DEFAULT_POLICIES)
def test_alibaba_every_policy(traces, policy):
    (result,) = simulate(traces["alibaba"], [policy], check=True)
    assert_invariants(result)
    assert result.metrics["finished"] == 143


def test_alibaba_pack_needs_fewer_devices(traces):
    fifo, pack = simulate(traces["alibaba"], ["fifo", "pack"])
    assert pack.metrics["devices_needed"] < fifo.metrics["devices_needed"] <= 143
    assert pack.metrics["device_hours"] < fifo.metrics["device_hours"]


@pytest.mark.parametrize("policy", DEFAULT_POLICIES)
def test_openb_subset_every_policy(traces, policy):
    sub = traces["openb"].subset(300)
    (result,) = simulate(sub, [policy], check=True)
    assert_invariants(result)
    assert result.metrics["finished"] == 300


def test_openb_pack_saves_device_hours(traces):
    sub = traces["openb"].subset(1500)
    fifo, pack = simulate(sub, ["fifo", "pack"])
    assert pack.metrics["device_hours"] < fifo.metrics["device_hours"]
    assert fifo.metrics["fragmentation"] == 0.0  # whole devices strand nothing
