"""A Slurm job holding GPUs on a node whose agent sees no process of it is a finding; a job whose process the agent
sees is not. The agent is the real one (`fleetlens agent --once`, cpu source: on this GPU-less machine a job's
process counts as on its device when it is marked, as NVML lists only the processes that use a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy import select

from analyzer.slurm_holders import RULE, find_slurm_holders_without_processes
from collector.importers.slurm import import_slurm
from store.models import Finding, Process
from tests.slurm.cluster import PROJECT_ROOT

pytestmark = pytest.mark.slurm


def test_gpus_held_with_no_process_are_a_finding(slurm, job_env, sqlite_store, slurm_settings, fleet_home, tmp_path):
    marked = slurm.submit("export FLEETLENS_WORKFLOW=slurm-$SLURM_JOB_ID; exec sleep 120", gres="shard:1",
                          env=job_env, cwd=tmp_path, name="works")
    silent = slurm.submit("exec sleep 120", gres="gpu:1", env=job_env, cwd=tmp_path, name="holds")
    slurm.wait_running(marked, silent)
    env = {**os.environ, **job_env, "FLEETLENS_DB_URL": str(sqlite_store.url), "FLEETLENS_CPU_TOP_PROCESSES": "0"}
    done = subprocess.run([sys.executable, "-c", "from ui.cli import main; main()", "agent", "--once", "--source",
                           "cpu", "--host-id", slurm.node], env=env, cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import_slurm(sqlite_store, slurm_settings)
    with sqlite_store.session() as s:
        seen = set(s.scalars(select(Process.workflow_id).where(Process.host_id == slurm.node)))
    assert f"slurm-{marked}" in seen and f"slurm-{silent}" not in seen
    assert find_slurm_holders_without_processes(sqlite_store, grace_s=0) == 1
    with sqlite_store.session() as s:
        found = s.scalars(select(Finding).where(Finding.rule == RULE)).all()
    assert [f.workflow_id for f in found] == [f"slurm-{silent}"]
    assert f"Slurm job {silent} holds GPU" in found[0].title and found[0].evidence["gres"] == "gpu:1"
