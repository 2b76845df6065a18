"""Whether the SDK is the batch step's own process, which the Slurm actuator needs before it sends the checkpoint
signal (`scancel --batch` signals that process alone; a batch script that runs the training as its child dies of
SIGUSR1). Judged from the real process tree: here a parent named like Slurm's step daemon, with its command line,
stands in for it (the real one is in tests/slurm/test_move_guards.py); the start mark carries the answer, and an
older SDK's mark reads as not known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from collector.slurm_job import SlurmSide, is_batch_step
from store.settings import Settings
from store.slurm_marks import STARTED, read_started

ROOT = Path(__file__).resolve().parents[2]
CHILD = "from collector.slurm_job import is_batch_step; print(is_batch_step(77))"


@pytest.mark.parametrize(("step", "expected"), [("[77.batch]", "True"), ("[77.0]", "False"), ("[78.batch]", "False")])
def test_only_a_child_of_the_job_s_batch_step_daemon_is_the_batch_step(tmp_path: Path, step: str, expected: str):
    daemon = tmp_path / "slurmstepd"  # the process's name is its executable's: a Python called slurmstepd
    daemon.symlink_to(sys.executable)
    # the "daemon" runs the SDK's check in a child, as slurmstepd runs the script that exec'd `python train.py`;
    # its command line ends with the step it serves, as Slurm's does ("slurmstepd: [77.batch]")
    parent = (f"import subprocess; r = subprocess.run([{sys.executable!r}, '-c', {CHILD!r}], capture_output=True, "
              "text=True); print(r.stdout.strip() or r.stderr)")
    out = subprocess.run([str(daemon), "-c", parent, step], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert out.stdout.strip() == expected, out.stderr


def test_the_start_mark_says_so_and_an_older_sdk_s_mark_does_not(fleet_home: Path):
    assert is_batch_step(77) is False  # pytest's parent is no slurmstepd
    settings = Settings(home=fleet_home, slurm_job_id=77)
    side = SlurmSide(settings, "slurm-77")
    side.started(0)
    mark = read_started(side.folder)
    assert mark.job_id == 77 and mark.batch_step is False
    old = {k: v for k, v in json.loads((Path(side.folder) / STARTED).read_text()).items() if k != "batch_step"}
    (Path(side.folder) / STARTED).write_text(json.dumps(old))
    assert read_started(side.folder).batch_step is None  # not known: the actuator refuses to signal it
