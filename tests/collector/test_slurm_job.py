"""The job SDK under Slurm, with the real torch training job as a process (no cluster needed: Slurm's part is the
environment it gives a job and the signal): SIGUSR1 makes it checkpoint at a step boundary and write the manifest
(step, size, sha256); started again with a higher restart count it restores that checkpoint, and a checkpoint
changed since refuses to resume rather than start from something else."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store.settings import Settings
from store.slurm_marks import job_folder, read_manifest, read_started

ROOT = Path(__file__).resolve().parents[2]


def _start(home: Path, restart: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEETLENS_HOME": str(home), "SLURM_JOB_ID": "4242",
           "SLURM_RESTART_COUNT": str(restart), "CUDA_VISIBLE_DEVICES": "1"}
    env.pop("FLEETLENS_WORKFLOW", None)
    return subprocess.Popen([sys.executable, "-m", "collector.examples.train", "--mode", "tiny", "--steps", "1000000",
                             "--step-sleep", "0.01"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {predicate}")


@pytest.mark.slow
def test_checkpoint_on_sigusr1_and_resume_after_a_requeue(tmp_path, fleet_home):
    folder = job_folder(Settings(home=fleet_home), "slurm-4242")
    first = _start(fleet_home, 0)
    try:
        started = _wait(lambda: read_started(folder))
        assert (started.job_id, started.restart_count, started.step, started.gpus) == (4242, 0, 0, "1")
        time.sleep(0.5)
        first.send_signal(signal.SIGUSR1)
        manifest = _wait(lambda: read_manifest(folder))
        assert first.poll() is None  # it checkpointed and trains on
        data = Path(manifest.path).read_bytes()
        assert manifest.step > 0 and manifest.size_bytes == len(data)
        assert manifest.sha256 == hashlib.sha256(data).hexdigest() and manifest.signal_at is not None
    finally:
        first.kill()
        first.wait()
    second = _start(fleet_home, 1)  # Slurm started it again under the same id
    try:
        again = _wait(lambda: (s := read_started(folder)) is not None and s.restart_count == 1 and s)
        assert again.step == manifest.step and again.restored_sha256 == manifest.sha256
    finally:
        second.kill()
        second.wait()
    Path(manifest.path).write_bytes(data[:-10] + b"0123456789")  # changed after it was written
    third = _start(fleet_home, 2)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 2 and "does not match the sha256 its manifest recorded" in err
    assert read_started(folder).restart_count == 1  # it never said it started


@pytest.mark.parametrize(("run", "restored"), [(0, False), (1, True)],
                         ids=["a-new-job-under-a-reused-id", "the-job-requeued"])
def test_only_a_checkpoint_of_an_earlier_run_of_the_job_is_restored(fleet_home, monkeypatch, run, restored):
    from collector.slurm_job import SlurmSide
    from store.slurm_marks import CHECKPOINT_MANIFEST, CheckpointManifest, write_mark

    # a checkpoint that job 4242's run 0 wrote on the signal
    folder = job_folder(Settings(home=fleet_home), "slurm-4242")
    weights = fleet_home.parent / "ckpt.pt"
    weights.write_bytes(b"weights at step 8")
    write_mark(folder, CHECKPOINT_MANIFEST, CheckpointManifest(
        job_id=4242, restart_count=0, step=8, path=str(weights), size_bytes=weights.stat().st_size,
        sha256=hashlib.sha256(weights.read_bytes()).hexdigest(), written_at=time.time()))
    # run 0 of a job given the same id later (Slurm reuses ids), or run 1 of the job after its requeue
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(run))
    side = SlurmSide(Settings(home=fleet_home), "slurm-4242")
    assert side.resume_path() == (weights if restored else None)
