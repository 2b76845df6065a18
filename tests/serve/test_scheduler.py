"""The embedded scheduler of `fleetlens serve`: cadences on a fake clock, failures isolated and retried with
backoff, real threads that stop when asked, and the DAGs' entry points run on a real seeded store."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import func, select

from store.db import Store
from store.errors import DatabaseUnavailable, InvalidInput
from store.migrations import upgrade
from store.models import Finding, Plan, ProfileRequest, Rollup
from store.settings import get_settings
from tests.collector.agent_helpers import wait_for
from tests.dags.seed import seed
from ui.serve.scheduler import CADENCES, TRACES_JOB, Job, Scheduler, periodic_jobs


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def recorder(calls: list[tuple[str, float]], name: str, clock: FakeClock):
    return lambda: calls.append((name, clock.t)) or name


def test_each_job_runs_on_its_own_cadence() -> None:
    clock, calls = FakeClock(), []
    s = Scheduler([Job("fast", 10, recorder(calls, "fast", clock)),
                   Job("slow", 25, recorder(calls, "slow", clock)),
                   Job("later", 10, recorder(calls, "later", clock), first_delay_s=15)], clock=clock)
    ran = {}
    for t in range(0, 51):
        clock.t = float(t)
        ran[t] = s.run_due()
    assert {t: names for t, names in ran.items() if names} == {
        0: ["fast", "slow"], 10: ["fast"], 15: ["later"], 20: ["fast"], 25: ["slow", "later"], 30: ["fast"],
        35: ["later"], 40: ["fast"], 45: ["later"], 50: ["fast", "slow"]}
    assert s.state("fast").runs == 6 and s.state("slow").last_result == "slow"


def test_a_failing_job_backs_off_and_leaves_the_others_running() -> None:
    clock, calls = FakeClock(), []
    broken = {"on": True}

    def flaky() -> str:
        if broken["on"]:
            raise DatabaseUnavailable("cannot reach the database; check FLEETLENS_DB_URL")
        return "back"

    s = Scheduler([Job("flaky", 100, flaky, retry_base_s=5), Job("steady", 10, recorder(calls, "steady", clock))],
                  clock=clock)
    flaky_runs = []
    for t in range(0, 301):
        clock.t = float(t)
        if t == 160:
            broken["on"] = False
        if "flaky" in s.run_due():
            flaky_runs.append(t)
    # retries after 5, 10, 20, 40, 80, then capped at the interval (100); once back, the plain cadence
    assert flaky_runs == [0, 5, 15, 35, 75, 155, 255]
    state = s.state("flaky")
    assert state.runs == 1 and state.failures == 6 and state.consecutive_failures == 0
    assert state.last_error is None and state.last_result == "back" and state.next_due == 355
    assert [t for _, t in calls] == list(range(0, 301, 10))  # the steady job never missed a beat


def test_threads_run_jobs_concurrently_and_stop_when_asked() -> None:
    counts = {"ticks": 0, "boom": 0}
    release = threading.Event()

    def tick() -> None:
        counts["ticks"] += 1

    def boom() -> None:
        counts["boom"] += 1
        raise RuntimeError("a bug in one job")

    def slow() -> None:
        release.wait(30)  # a long job: must not hold the others back

    jobs = [Job("tick", 0.02, tick), Job("boom", 0.02, boom, retry_base_s=0.01), Job("slow", 0.02, slow),
            Job("daily", 86400, tick, first_delay_s=86400)]  # waits a day: stop() must wake it
    with Scheduler(jobs) as s:
        assert s.running
        wait_for(lambda: counts["ticks"] >= 5 and counts["boom"] >= 3, timeout=20)
        release.set()
        assert s.state("boom").failures >= 3 and "a bug in one job" in s.state("boom").last_error
    assert not s.running
    after = dict(counts)
    assert s.stop(timeout=0.0)  # stopping twice is harmless
    release.wait(0.1)
    assert counts == after  # nothing runs once stopped


def test_stop_returns_as_soon_as_the_waiting_threads_wake() -> None:
    s = Scheduler([Job(f"idle-{i}", 3600, lambda: None, first_delay_s=3600) for i in range(4)]).start()
    assert s.running
    assert s.stop(timeout=10.0) is True  # a thread still asleep would make this False
    assert not s.running


def test_bad_jobs_are_refused_with_a_clear_error() -> None:
    with pytest.raises(InvalidInput, match="interval must be a positive"):
        Job("x", 0, lambda: None)
    with pytest.raises(InvalidInput, match="two scheduler jobs are named 'x'"):
        Scheduler([Job("x", 1, lambda: None), Job("x", 2, lambda: None)])
    with pytest.raises(InvalidInput, match="no scheduler job 'nope'"):
        Scheduler([Job("x", 1, lambda: None)]).run_now("nope")
    with pytest.raises(InvalidInput, match="speedup"):
        periodic_jobs(None, get_settings(fresh=True), speedup=0)  # type: ignore[arg-type]


def test_periodic_jobs_do_the_dags_work_on_a_real_store(fleet_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'fleetlens.db'}")
    upgrade(store)
    seed(store)
    monkeypatch.setenv("FLEETLENS_ENFORCE_DRIVE_S", "0")
    settings = get_settings(fresh=True)
    s = Scheduler(periodic_jobs(store, settings, speedup=60))
    assert {j.name: j.interval_s for j in s.jobs if j.name != TRACES_JOB} == {
        name: seconds / 60 for name, seconds in CADENCES.items()}
    ran = s.run_due()
    assert set(ran) == set(CADENCES)  # the trace job waits its first interval
    states = s.states()
    assert all(states[name].last_error is None for name in ran), {n: states[n].last_error for n in ran}
    with store.session() as db:
        assert db.scalar(select(func.count()).select_from(Rollup)) > 0
        rules = set(db.execute(select(Finding.workflow_id, Finding.rule)).all())
        plan = db.scalar(select(Plan))
        requests = db.scalar(select(func.count()).select_from(ProfileRequest))
    assert ("idle-a", "idle_holder") in rules
    assert plan is not None and plan.summary["outcome"]["mode"] == "dry_run"
    # the profile job ran in the same pass as the rollup, or saw its rollups: either way it returned a summary
    assert states["fleetlens_periodic_profile"].last_result["steps"] == settings.profile_steps
    assert requests == len(states["fleetlens_periodic_profile"].last_result["requested"])
    assert states[TRACES_JOB].runs == 0
    store.dispose()


def test_the_analyze_job_and_the_trace_job_at_once_analyse_each_trace_once(
        fleet_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import analyzer.traces.jobs as trace_jobs
    from analyzer.traces import register_trace

    store = Store(f"sqlite:///{tmp_path / 'fleetlens.db'}")
    upgrade(store)
    paths = [tmp_path / f"rank{i}.json" for i in range(3)]
    for path in paths:
        path.write_text("{}")
        register_trace(store, path, workflow_id="wf")
    s = Scheduler(periodic_jobs(store, get_settings(fresh=True)))
    analysed: list[str] = []

    def analyze_one(path: str, **_: object) -> tuple[dict, list]:
        analysed.append(Path(path).name)
        if len(analysed) == 1:  # the trace job runs while fleetlens_analyze is in its first trace
            s.run_now(TRACES_JOB)
        return {"n_steps": 1, "rank": 0}, []

    monkeypatch.setattr(trace_jobs, "analyze_one", analyze_one)
    s.run_now("fleetlens_analyze")
    assert sorted(analysed) == sorted(p.name for p in paths)  # each once
    assert s.state("fleetlens_analyze").last_result["traces"]["analyzed"] == 1
    assert s.state(TRACES_JOB).last_result == {"analyzed": 2, "failed": 0}
    store.dispose()
