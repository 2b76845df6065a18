"""The hosts the enforcer leaves alone, where the dashboard lists hosts or plans, and in `fleetlens status`: a host
whose agent fell silent and a Slurm node Slurm reports down are "not heard from", a drained Slurm node "takes no new
job", each named with the store's reason (store.registry.hosts_left_alone, the rule the planner plans by); hosts
heard from lately are not flagged."""

from __future__ import annotations

import re
import time

import pytest

from collector.importers.slurm import record_view
from enforcer.fleet_state import read_fleet_state
from store.db import Store
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings, get_settings
from store.slurm import SlurmView, parse_nodes
from tests.fakes.fake_slurm import META
from tests.ui.helpers import assert_clean, page, texts
from tests.ui.seed import GIB
from ui.cli import run

SILENT_FOR_S = 600.0  # past the default silence limit (120 s)
DRAINED = ("Slurm's latest listing shows it IDLE+DRAIN (reason: swap a fan): its jobs run on, but Slurm starts no "
           "new job there")
DOWN = ("Slurm's latest listing shows it DOWN (reason: slurmd gone): its slurmd does not answer Slurm, or the node "
        "failed or is powered off")


def _seconds_aside(text: str) -> str:
    """The text with how long a host has been silent left out (a page rendered a second later says one more)."""
    return re.sub(r"for \d+ s", "for N s", text)


def _left_alone(store: Store) -> None:
    """Beside the seeded fleet (gpu-a and gpu-b, heard from lately): gpu-c, whose agent registered it and its GPU
    SILENT_FOR_S ago and has not written since; and two nodes the Slurm import has just listed, node7 drained and
    node8 down."""
    now = time.time()
    with store.session() as s:
        register_host(s, "gpu-c", hostname="gpu-c.cluster", source="nvml", agent_version="0.1.0",
                      now=now - SILENT_FOR_S)
        register_devices(s, "gpu-c", [DeviceSpec(0, "GPU-gpu-c-0", "NVIDIA A100-SXM4-80GB", 80 * GIB)],
                         source="nvml", now=now - SILENT_FOR_S)
    doc = {"meta": META, "errors": [], "nodes": [
        {"name": "node7", "state": "idle", "state_flags": ["DRAIN"], "reason": "swap a fan", "gres": "gpu:2",
         "partitions": ["p"]},
        {"name": "node8", "state": "down", "state_flags": [], "reason": "slurmd gone", "gres": "gpu:2",
         "partitions": ["p"]}]}
    record_view(store, SlurmView("22.05.8", parse_nodes(doc)[1]), Settings(), now=now)


def test_fleet_and_enforcement_pages_name_the_hosts_not_heard_from_or_closed_with_why(seeded):
    store, _ = seeded
    _left_alone(store)
    limit = get_settings().host_silence_s
    at = page("fleet")
    assert_clean(at)
    # the notice at the top names them with why, and no host heard from
    notice = texts(at.warning)
    assert f"**node7** takes no new job: {DRAINED}" in notice
    assert f"**node8** is not heard from: {DOWN}" in notice
    assert "Hosts the enforcer leaves alone (3 of 5)" in notice
    assert "gpu-a" not in notice and "gpu-b" not in notice
    # the host table: each host's status and why, the ones left alone first
    table = next(df.value for df in at.dataframe if "status" in df.value.columns)
    status = dict(zip(table.host, table.status, strict=True))
    assert status == {"gpu-c": "not heard from", "node8": "not heard from", "node7": "takes no new job",
                      "gpu-a": "ok", "gpu-b": "ok"}
    assert list(table.host[:3]) == ["node8", "gpu-c", "node7"]  # not heard from (latest first), closed, then ok
    why = dict(zip(table.host, table.why, strict=True))
    assert re.fullmatch(rf"has not been heard from for (\d+) s \(more than {limit:.0f} s, "
                        r"FLEETLENS_HOST_SILENT_AFTER_S\)", why["gpu-c"])
    assert int(re.search(r"for (\d+) s", why["gpu-c"]).group(1)) >= SILENT_FOR_S
    assert why["node8"] == f"is not heard from: {DOWN}"
    assert why["node7"] == f"takes no new job: {DRAINED}"
    assert why["gpu-a"] == why["gpu-b"] == ""
    assert f"**gpu-c** {why['gpu-c']}" in notice
    # the Enforcement page, where plans are made and applied, names them too
    at = page("enforcement")
    assert_clean(at)
    assert _seconds_aside(texts(at.warning)) == _seconds_aside(notice)
    # what the pages flag is what the enforcer plans around
    with store.session() as s:
        state = read_fleet_state(s, settings=get_settings())
    assert set(state.not_heard_from) == {"gpu-c", "node8"} and set(state.closed) == {"node7"}


def test_status_counts_the_hosts_left_alone(seeded, capsys: pytest.CaptureFixture[str]):
    store, _ = seeded
    capsys.readouterr()
    assert run(["status"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"hosts not heard from\s+│\s+0\s", out) and re.search(r"hosts taking no new job\s+│\s+0\s", out)
    _left_alone(store)
    assert run(["status"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"hosts not heard from\s+│\s+2: gpu-c, node8\s", out), out
    assert re.search(r"hosts taking no new job\s+│\s+1: node7\s", out), out
