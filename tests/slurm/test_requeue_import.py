"""A requeue seen by the import, with squeue's answers as Slurm 22.05 gives them (a fake at the command boundary):
the job counts a restart at once, while it still says COMPLETING with its old submit time, and shows its new submit
time about 2 s later. The import takes the job for the same one whichever field it sees move first, and still
refuses a new job under a reused id. A start mark counts for the job only if written after its first submission:
one left by an earlier job under the same id never opts in the new job, requeued or not."""

from __future__ import annotations

from typing import Any

from collector.importers.slurm import import_slurm
from store.models import Workflow
from store.models_slurm import GONE, SlurmJob
from store.settings import Settings
from store.slurm import OPT_IN_WORD
from store.slurm_marks import STARTED, Started, job_folder, write_mark
from tests.fakes.fake_slurm import SlurmAnswers


def _job(state: str, restart: int, submit: int, **kw: Any) -> dict[str, Any]:
    held = state in ("RUNNING", "COMPLETING")
    return {"job_id": 5, "job_state": state, "restart_cnt": restart, "submit_time": submit, "requeue": True,
            "tres_per_node": "gres:shard:2", "name": "train", "user_name": "u", "start_time": submit + 10,
            **({"nodes": "n1", "batch_host": "n1", "gres_detail": ["shard:2(IDX:0)"]} if held else {}), **kw}


def test_a_requeue_seen_in_either_order_keeps_the_job_and_a_reused_id_is_still_refused(sqlite_store, tmp_path):
    settings, slurm = Settings(home=tmp_path), SlurmAnswers()
    seen = [
        _job("RUNNING", 0, 1000, comment=OPT_IN_WORD),
        _job("COMPLETING", 1, 1000, comment=OPT_IN_WORD),  # right after `scontrol requeue`: the old submit time
        _job("PENDING", 1, 1100, comment=OPT_IN_WORD),  # ~2 s later: the new one, the same restart count
        _job("RUNNING", 1, 1100, comment=OPT_IN_WORD),
        _job("PENDING", 2, 1200, comment=OPT_IN_WORD),  # requeued again, both fields moved together
        _job("RUNNING", 2, 1200, comment=OPT_IN_WORD),
    ]
    for now, raw in enumerate(seen, start=2000):
        slurm.jobs = [raw]
        assert import_slurm(sqlite_store, settings, cli=slurm, now=now).errors == []
        with sqlite_store.session() as s:
            row, wf = s.get(SlurmJob, "slurm-5"), s.get(Workflow, "slurm-5")
            assert (row.state, row.restart_count, row.opted_in) == (raw["job_state"], raw["restart_cnt"], True)
            assert wf.state == "running"
    # slurmctld lost its state and gave id 5 to another job: its count is back at 0, its submit time new
    slurm.jobs = [_job("RUNNING", 0, 5000, name="other")]
    result = import_slurm(sqlite_store, settings, cli=slurm, now=3000)
    assert len(result.errors) == 1 and "slurm job id 5 was reused" in result.errors[0]
    with sqlite_store.session() as s:
        assert s.get(SlurmJob, "slurm-5").name == "train"
    # ...and one that counts fewer restarts than the store saw is no requeue either
    slurm.jobs = [_job("RUNNING", 1, 5000, name="other")]
    assert "was reused" in import_slurm(sqlite_store, settings, cli=slurm, now=3001).errors[0]
    slurm.jobs = []  # gone: its id given again later, even with restarts, is another job
    import_slurm(sqlite_store, settings, cli=slurm, now=3002)
    slurm.jobs = [_job("RUNNING", 3, 6000)]
    assert "was reused" in import_slurm(sqlite_store, settings, cli=slurm, now=3003).errors[0]
    with sqlite_store.session() as s:
        assert s.get(SlurmJob, "slurm-5").state == GONE


def _mark(settings: Settings, started_at: float, restart: int = 0) -> None:
    write_mark(job_folder(settings, "slurm-5"), STARTED, Started(
        job_id=5, restart_count=restart, step=0, gpus="0", started_at=started_at, movable=True, batch_step=True))


def _opted_in(store) -> bool:
    with store.session() as s:
        return s.get(SlurmJob, "slurm-5").opted_in


def test_a_start_mark_of_an_earlier_job_under_the_same_id_never_opts_in_the_new_one(sqlite_store, tmp_path):
    settings, slurm = Settings(home=tmp_path), SlurmAnswers()
    _mark(settings, started_at=100.0)  # left by an earlier job 5, long before this one was submitted
    slurm.jobs = [_job("RUNNING", 0, 50_000)]
    import_slurm(sqlite_store, settings, cli=slurm, now=60_000)
    assert not _opted_in(sqlite_store)
    slurm.jobs = [_job("PENDING", 1, 50_100)]  # requeued: a restart, and still no mark of its own
    import_slurm(sqlite_store, settings, cli=slurm, now=60_001)
    assert not _opted_in(sqlite_store)


def test_the_job_s_own_mark_from_before_its_requeue_keeps_it_opted_in(sqlite_store, tmp_path):
    settings, slurm = Settings(home=tmp_path), SlurmAnswers()
    _mark(settings, started_at=1005.0)  # its SDK started after its submission
    slurm.jobs = [_job("RUNNING", 0, 1000)]
    import_slurm(sqlite_store, settings, cli=slurm, now=2000)
    assert _opted_in(sqlite_store)
    for now, raw in enumerate([_job("COMPLETING", 1, 1000), _job("PENDING", 1, 1100), _job("PENDING", 1, 1100)],
                              start=2001):
        slurm.jobs = [raw]  # requeued: its run 0's mark stays until run 1 writes its own
        assert import_slurm(sqlite_store, settings, cli=slurm, now=now).errors == []
        assert _opted_in(sqlite_store)


def test_a_job_held_to_run_again_is_waiting_not_failed(sqlite_store, tmp_path):
    """SPECIAL_EXIT (requeued held after its special exit code) and RESV_DEL_HOLD (held as its reservation was
    deleted) wait to run again, as a pending job does: the workflow stays running."""
    settings, slurm = Settings(home=tmp_path), SlurmAnswers()
    for now, state in enumerate(["RUNNING", "SPECIAL_EXIT", "RESV_DEL_HOLD"], start=2000):
        slurm.jobs = [_job(state, 0, 1000)]
        import_slurm(sqlite_store, settings, cli=slurm, now=now)
        with sqlite_store.session() as s:
            assert (s.get(SlurmJob, "slurm-5").state, s.get(Workflow, "slurm-5").state) == (state, "running")
