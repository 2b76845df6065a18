"""An opted-in Slurm job whose own start mark says its SDK is not the batch step's process (the script runs the
training without `exec`) is recorded as not movable, with the reason, so that no enforcement cycle plans a move the
actuator would only refuse; a mark that says it is, or no mark yet, leaves the job movable."""

from __future__ import annotations

import time

import store.slurm_marks as marks_module
from collector.importers.slurm import import_slurm, record_view
from store.models_slurm import SlurmJob
from store.settings import Settings
from store.slurm import SlurmView, parse_jobs, parse_nodes
from store.slurm_marks import STARTED, Started, job_folder, write_mark

META = {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}
NODES = {"meta": META, "errors": [], "nodes": [{"name": "n1", "state": "mixed", "partitions": ["gpu"],
                                                 "gres": "gpu:4,shard:8"}]}


def _view() -> SlurmView:
    jobs = [{"job_id": j, "job_state": "RUNNING", "requeue": True, "submit_time": 1000, "restart_cnt": 0,
             "nodes": "n1", "batch_host": "n1", "tres_per_node": "gres:shard:2", "comment": "fleetlens:movable",
             "gres_detail": [f"shard:2(IDX:{j - 1})"]} for j in (1, 2, 3, 4)]
    version, parsed = parse_jobs({"meta": META, "errors": [], "jobs": jobs})
    return SlurmView(version=version, nodes=parse_nodes(NODES)[1], jobs=parsed)


def test_a_job_whose_mark_says_the_signal_would_kill_it_is_not_movable(sqlite_store, tmp_path) -> None:
    settings = Settings(home=tmp_path)
    for job_id, batch_step in ((1, True), (2, False), (3, None)):  # 4: no mark yet
        write_mark(job_folder(settings, f"slurm-{job_id}"), STARTED,
                   Started(job_id=job_id, restart_count=0, step=0, gpus="0", started_at=time.time(),
                           batch_step=batch_step))
    record_view(sqlite_store, _view(), settings, now=2000.0)
    with sqlite_store.session() as s:
        rows = {j: s.get(SlurmJob, f"slurm-{j}") for j in (1, 2, 3, 4)}
    assert rows[1].opted_in and rows[4].opted_in
    assert not rows[2].opted_in and "child of the batch script" in rows[2].not_movable_reason
    assert "exec python train.py" in rows[2].not_movable_reason
    assert not rows[3].opted_in and "older than that check" in rows[3].not_movable_reason


def test_one_import_reads_a_job_s_start_mark_once_for_its_opt_in_and_its_signal_safety(
        sqlite_store, tmp_path, monkeypatch) -> None:
    """A job opted in by its SDK alone (no comment): one reading of the cluster asks its mark whether the SDK asked
    to be movable and whether the signal is safe, and the shared checkpoint location is read once for both."""
    settings = Settings(home=tmp_path)
    write_mark(job_folder(settings, "slurm-7"), STARTED,
               Started(job_id=7, restart_count=0, step=0, gpus="0", started_at=2000.0, movable=True,
                       batch_step=False))
    job = {"job_id": 7, "job_state": "RUNNING", "requeue": True, "submit_time": 1000, "restart_cnt": 0,
           "nodes": "n1", "batch_host": "n1", "tres_per_node": "gres:shard:2", "comment": "",
           "gres_detail": ["shard:2(IDX:0)"]}

    class Cli:
        def json(self, command: str, *args: str) -> dict:
            return {"squeue": {"meta": META, "errors": [], "jobs": [job]}, "sinfo": NODES}[command]

    reads: list[str] = []
    real = marks_module.read_mark
    monkeypatch.setattr(marks_module, "read_mark",
                        lambda folder, name: (reads.append(folder) if name == STARTED else None) or real(folder, name))
    import_slurm(sqlite_store, settings, cli=Cli(), now=2000.0)
    assert reads == [job_folder(settings, "slurm-7")]
    with sqlite_store.session() as s:
        row = s.get(SlurmJob, "slurm-7")
    # its SDK asked (so it was looked at as opted in), and the same mark says the signal would kill it
    assert not row.opted_in and "exec python train.py" in row.not_movable_reason
