"""A job over its memory share fails alone: two real CPU jobs in one lane, started by a real agent; one dies out of
memory (as PyTorch reports it), the agent reaps it and fails its workflow with the share it exceeded, and its
lane-mate keeps training (the lane's turn passes on)."""

from __future__ import annotations

import sys

import pytest
from sqlalchemy import select

from enforcer.managed import ManagedJob
from store.headroom import charged
from store.models import Placement, Workflow
from store.paths import checkpoint_dir_for
from store.placements import FAILURE_LABEL
from store.workflows import sign_workflow_spec, upsert_workflow
from tests.collector.agent_helpers import wait_for
from tests.conftest import PROJECT_ROOT
from tests.enforcer.migration_helpers import (  # noqa: F401  (rig_fixture: the `rig` fixture)
    Rig,
    last_step,
    pid_alive,
    rig_fixture,
    train_cmd,
    workflow,
)
from ui.serve.run import launch_detached

pytestmark = pytest.mark.slow

# a lane job that trains a few steps through the SDK, then dies the way PyTorch's allocator reports a process
# that asked for more than its memory cap (torch is real; no CUDA here, so the error is raised by the job itself)
OOM_JOB = """
import torch
from collector.job import job
with job("greedy", total_steps=1000) as j:
    for step in j.steps():
        if step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
                                         "per-process memory fraction set)")
"""


def test_a_job_over_its_share_fails_alone_and_its_lane_mate_trains_on(rig: Rig) -> None:
    steady = rig.launch(train_cmd(100_000, step_sleep=0.01), lane="auto", mem_bytes=100 << 20, name="steady")
    assert steady.lane_id is not None
    # its lane-mate, admitted into the same lane with a share of its own
    with rig.store.session() as s:
        wf = upsert_workflow(s, "greedy", managed=True, id_source="managed", command=[sys.executable, "-c", OOM_JOB],
                             cwd=str(PROJECT_ROOT), checkpoint_dir=str(checkpoint_dir_for(rig.settings, "greedy")),
                             state="running")
        sign_workflow_spec(wf, rig.settings.secret_bytes())  # as `fleetlens run` registers it
        placement = Placement(workflow_id=wf.id, device_id=steady.device_ids[0], lane_id=steady.lane_id,
                              host_id=rig.agent.host_id, mem_persistent=4 << 20, mem_ephemeral=1 << 20,
                              state="pending", started_at=0.0)
        s.add(placement)
        s.flush()
        greedy = ManagedJob("greedy", rig.agent.host_id, list(wf.command), wf.cwd, wf.checkpoint_dir,
                            list(steady.device_ids), steady.lane_id, [placement.id], "pack")
    wait_for(lambda: last_step(rig.store, steady.workflow_id) >= 5, timeout=60)
    launch_detached(rig.store, greedy, settings=rig.settings)

    # the job's own SDK says it failed; the agent's reaper then finds why in its log
    failed = wait_for(lambda: FAILURE_LABEL in (workflow(rig.store, "greedy").labels or {})
                      and workflow(rig.store, "greedy"), timeout=60)
    assert failed.state == "failed"
    assert failed.labels[FAILURE_LABEL] == f"exceeded its memory share of {charged(4 << 20) + (1 << 20)} bytes " \
                                           "(out of memory)"
    at_death = last_step(rig.store, steady.workflow_id)
    # the lane-mate goes on: still running, still placed in its lane, and still taking steps
    wait_for(lambda: last_step(rig.store, steady.workflow_id) >= at_death + 20, timeout=60)
    assert pid_alive(steady.pid)
    with rig.store.session() as s:
        mine = s.scalar(select(Placement).where(Placement.workflow_id == steady.workflow_id))
        assert mine.state == "active" and mine.lane_id == steady.lane_id
        assert s.get(Workflow, steady.workflow_id).state == "running"
        assert FAILURE_LABEL not in (s.get(Workflow, steady.workflow_id).labels or {})
