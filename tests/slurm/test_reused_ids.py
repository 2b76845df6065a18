"""A job id Slurm reuses (slurmctld started again without its state, so ids begin at 1 again) is not taken for the
old job: the store keeps the old job's record, the new job is left out with a message saying why and what to do."""

from __future__ import annotations

import pytest

from collector.importers.slurm import import_slurm
from store.models_slurm import SlurmJob

pytestmark = pytest.mark.slurm


def test_a_reused_job_id_is_refused_with_the_reason(slurm, sqlite_store, slurm_settings, tmp_path, monkeypatch):
    first = slurm.submit("sleep 1", name="before-restart", cwd=tmp_path, env={"SBATCH_HOLD": "1"})
    assert import_slurm(sqlite_store, slurm_settings).errors == []
    slurm.cancel_all()
    slurm.stop()
    slurm.start()  # its state is made anew: job ids begin again
    for key, value in slurm.env.items():
        monkeypatch.setenv(key, value)
    job = 0
    while job < first:
        job = slurm.submit("sleep 1", name="after-restart", cwd=tmp_path, env={"SBATCH_HOLD": "1"})
    assert job == first
    result = import_slurm(sqlite_store, slurm_settings)
    # squeue still lists the earlier tests' ended jobs for a while: their ids may come back too, each said so
    mine = [e for e in result.errors if e.startswith(f"slurm job id {first} was reused")]
    assert len(mine) == 1 and f"delete workflow slurm-{first}" in mine[0] and "before-restart" in mine[0]
    assert all(" was reused: " in e for e in result.errors)
    with sqlite_store.session() as s:
        assert s.get(SlurmJob, f"slurm-{first}").name == "before-restart"
