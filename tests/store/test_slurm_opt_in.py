"""A Slurm job's opt-in, decided in one place (store.slurm.opt_in): its --comment or its fleetlens SDK's start mark
asks, and Slurm may requeue it, and it holds shards. The start mark is read for it only when it is that job's own,
and a mark from before the SDK said anything of the kind reads as not asked."""

from __future__ import annotations

import json
from pathlib import Path

from store.settings import Settings
from store.slurm import OPT_IN_WORD, opt_in, parse_gres, parse_jobs
from store.slurm_marks import STARTED, Started, asked_to_move, job_folder, read_started, sdk_asked_from, write_mark

SHARD = parse_gres("shard:2")
WHOLE = parse_gres("gpu:1")


def test_the_comment_or_the_sdk_opts_a_job_in_and_nothing_else_does():
    assert opt_in(OPT_IN_WORD, True, SHARD, None) == (True, None)  # comment only
    assert opt_in(None, True, SHARD, None, sdk_asked=True) == (True, None)  # SDK only
    ok, why = opt_in("just a note", True, SHARD, None)  # neither
    assert not ok and why.startswith("did not opt in")
    assert OPT_IN_WORD in why and "FLEETLENS_MOVABLE" in why and "movable=True" in why  # both ways are named
    ok, why = opt_in(None, False, SHARD, None, sdk_asked=True)  # the SDK asked, but --no-requeue
    assert not ok and "by its fleetlens SDK" in why and "--no-requeue" in why
    ok, why = opt_in(None, True, WHOLE, None, sdk_asked=True)  # the SDK asked, but a whole-GPU request
    assert not ok and "23.02.6" in why and "--gres=shard:N" in why
    ok, why = opt_in(OPT_IN_WORD, False, SHARD, None)
    assert not ok and "by its --comment" in why


def _squeue(*jobs: dict) -> dict:
    return {"meta": {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}, "errors": [],
            "jobs": [{"job_state": "RUNNING", "tres_per_node": "gres:shard:2", "requeue": True, "submit_time": 1000,
                      "restart_cnt": 0, **j} for j in jobs]}


def test_parse_jobs_asks_about_the_sdk_only_for_jobs_the_comment_did_not_opt_in():
    asked: list[int] = []

    def sdk(job_id: int, submit_time: float, restart_count: int) -> bool:
        asked.append(job_id)
        return job_id in (2, 4)

    _, jobs = parse_jobs(_squeue({"job_id": 1, "comment": OPT_IN_WORD}, {"job_id": 2}, {"job_id": 3},
                                 {"job_id": 4, "requeue": False}), sdk_asked=sdk)
    assert asked == [2, 3, 4]
    assert [j for j, job in jobs.items() if job.opted_in] == [1, 2]
    assert "--no-requeue" in jobs[4].not_movable_reason and "did not opt in" in jobs[3].not_movable_reason
    _, alone = parse_jobs(_squeue({"job_id": 2}))  # without a reader of marks only the comment counts
    assert not alone[2].opted_in


def _started(**kw) -> Started:
    return Started(**{"job_id": 7, "restart_count": 0, "step": 0, "gpus": "0", "started_at": 1000.0,
                      "movable": True, **kw})


def test_a_start_mark_counts_only_for_its_own_job_and_run():
    assert asked_to_move(_started(), 7, 990.0, 0)
    assert not asked_to_move(_started(movable=False), 7, 990.0, 0)
    assert not asked_to_move(None, 7, 990.0, 0)
    assert not asked_to_move(_started(), 8, 990.0, 0)  # another job's mark
    # a mark from long before this job was submitted: an earlier job under a reused id
    assert not asked_to_move(_started(), 7, 5000.0, 0)
    # ...and still after this job was requeued (a new submit time, one more restart), however often
    assert not asked_to_move(_started(), 7, 5000.0, 1, first_submit_time=4900.0)
    assert not asked_to_move(_started(), 7, 5000.0, 3, first_submit_time=4900.0)
    # this job's own earlier run, before Slurm requeued it: written after its first submission
    assert asked_to_move(_started(), 7, 5000.0, 1, first_submit_time=990.0)
    # ...which must be known: without it only a mark written after its latest submission counts
    assert not asked_to_move(_started(), 7, 5000.0, 1)
    assert asked_to_move(_started(restart_count=1, started_at=5010.0), 7, 5000.0, 1)


def test_marks_written_before_the_sdk_said_so_read_as_not_asked_and_unreadable_ones_as_not_asked(tmp_path: Path):
    settings = Settings(home=tmp_path)
    folder = job_folder(settings, "slurm-7")
    Path(folder).mkdir(parents=True)
    old = {"job_id": 7, "restart_count": 0, "step": 3, "gpus": "1", "started_at": 1000.0, "restored_sha256": None}
    (Path(folder) / STARTED).write_text(json.dumps(old))
    started = read_started(folder)
    assert (started.step, started.movable, started.memory_fraction) == (3, False, None)
    sdk = sdk_asked_from(settings)
    assert not sdk(7, 990.0, 0)
    write_mark(folder, STARTED, _started(step=3))
    assert sdk(7, 990.0, 0) and not sdk(8, 990.0, 0)  # job 8 has no mark at all
    (Path(folder) / STARTED).write_text("{not json")
    assert not sdk(7, 990.0, 0)
    (Path(folder) / STARTED).write_text(json.dumps({**old, "movable": True, "from_a_newer_sdk": 1}))
    assert read_started(folder).movable  # a newer SDK's extra field is left aside
