"""The embedded scheduler of `fleetlens serve`: the periodic work the Airflow DAGs do for a fleet, run in-process for
one host, calling the same entry points (analyzer.periodic, analyzer.profiles, enforcer.cycle) on the same cadences.

It lives in `ui.serve` because it composes the analyzer and the enforcer, which never call each other: only the layers
above both (the DAG files for Airflow, `ui` for the `fleetlens` command's own processes) may.

Each job runs in a thread of its own, so a slow one (a big trace to analyse) never delays the others and never
overlaps itself. A job that raises is logged and retried sooner, with exponential backoff capped at its interval
(as the DAGs retry); the other jobs go on. `stop()` wakes every waiting thread at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from analyzer import periodic, profiles
from collector.importers.prometheus import import_from_settings
from collector.importers.slurm import import_slurm_from_settings
from enforcer import cycle
from store.db import Store
from store.errors import FleetlensError, InvalidInput
from store.settings import Settings

log = logging.getLogger(__name__)

# seconds between runs, per DAG id: the DAGs' schedules (tests/dags checks they agree)
CADENCES: dict[str, float] = {
    "fleetlens_rollup": 3600.0,
    "fleetlens_analyze": 900.0,
    "fleetlens_enforce": 900.0,
    "fleetlens_periodic_profile": 86400.0,
    "fleetlens_import_prometheus": 300.0,
    "fleetlens_import_slurm": 60.0,
}
# serve only: Airflow analyses an on-demand trace in fleetlens_profile_on_demand as soon as it lands; on one host
# the requests come from the dashboard or `fleetlens profile`, so their traces are picked up this often instead
TRACES_JOB, TRACES_INTERVAL_S = "fleetlens_traces", 30.0
RETRY_BASE_S = 30.0


@dataclass(frozen=True)
class Job:
    name: str
    interval_s: float
    fn: Callable[[], Any]
    first_delay_s: float = 0.0  # the first run comes this long after start()
    retry_base_s: float = RETRY_BASE_S  # after a failure: retry_base_s, then twice that, ... (at most interval_s)

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise InvalidInput(f"job {self.name}: the interval must be a positive number of seconds, "
                               f"not {self.interval_s!r}")


@dataclass
class JobState:
    next_due: float
    runs: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_started: float | None = None
    last_finished: float | None = None
    last_result: Any = None
    last_error: str | None = None


@dataclass
class _Entry:
    job: Job
    state: JobState
    lock: threading.Lock = field(default_factory=threading.Lock)  # one run of a job at a time


class Scheduler:
    """Runs jobs on their intervals: `start()` / `stop()` in threads, or `run_due(now)` from the caller's loop.

    `clock` gives the current time in seconds (monotonic by default); tests pass a fake one to `run_due`.
    """

    def __init__(self, jobs: Iterable[Job], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        now = clock()
        for job in jobs:
            if job.name in self._entries:
                raise InvalidInput(f"two scheduler jobs are named {job.name!r}")
            self._entries[job.name] = _Entry(job, JobState(next_due=now + job.first_delay_s))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- running ----------------------------------------------------------------------------------------------

    def run_due(self, now: float | None = None) -> list[str]:
        """Run (in this thread) every job that is due at `now`; returns their names."""
        now = self.clock() if now is None else now
        ran = []
        for entry in self._entries.values():
            if entry.state.next_due <= now:
                self._run(entry, now)
                ran.append(entry.job.name)
        return ran

    def run_now(self, name: str) -> JobState:
        """Run one job at once, whether due or not (the `fleetlens serve` operator's "run it now")."""
        entry = self._entry(name)
        self._run(entry, self.clock())
        return self.state(name)

    def _run(self, entry: _Entry, started: float) -> None:
        job, state = entry.job, entry.state
        with entry.lock:
            state.last_started = started
            try:
                result = job.fn()
            except Exception as exc:  # a failing job must never take the scheduler or the other jobs down
                state.failures += 1
                state.consecutive_failures += 1
                state.last_error = f"{type(exc).__name__}: {exc}"
                backoff = min(job.interval_s, job.retry_base_s * 2 ** (state.consecutive_failures - 1))
                finished = self.clock()
                state.next_due = finished + backoff
                if isinstance(exc, FleetlensError):  # the message says what to do; a traceback adds nothing
                    log.warning("%s failed (retrying in %.0f s): %s", job.name, backoff, exc)
                else:
                    log.exception("%s failed (retrying in %.0f s)", job.name, backoff)
            else:
                state.runs += 1
                state.consecutive_failures = 0
                state.last_result, state.last_error = result, None
                finished = self.clock()
                # anchored on the start, so the cadence does not drift by each run's duration
                state.next_due = max(started + job.interval_s, finished)
                log.info("%s done: %s", job.name, result)
            state.last_finished = finished

    # ---- threads ----------------------------------------------------------------------------------------------

    def start(self) -> Scheduler:
        if self._threads:
            raise RuntimeError("the scheduler is running already")
        self._stop.clear()
        for entry in self._entries.values():
            thread = threading.Thread(target=self._loop, args=(entry,), name=f"fleetlens-{entry.job.name}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _loop(self, entry: _Entry) -> None:
        while not self._stop.is_set():
            wait = entry.state.next_due - self.clock()
            if wait > 0:
                self._stop.wait(wait)  # stop() sets the event: every waiting thread wakes at once
                continue
            self._run(entry, self.clock())

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop every job thread; a job in the middle of a run finishes it first. True if all threads ended."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("scheduler jobs still running after %.0f s: %s", timeout, ", ".join(alive))
        self._threads = []
        return not alive

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # ---- state ------------------------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise InvalidInput(f"no scheduler job {name!r}; jobs: {', '.join(self._entries)}") from None

    def state(self, name: str) -> JobState:
        return replace(self._entry(name).state)

    def states(self) -> dict[str, JobState]:
        return {name: replace(entry.state) for name, entry in self._entries.items()}

    @property
    def jobs(self) -> list[Job]:
        return [entry.job for entry in self._entries.values()]


def periodic_jobs(store: Store, settings: Settings, *, speedup: float = 1.0, enforce: bool | None = None) -> list[Job]:
    """The DAGs' periodic work as scheduler jobs on one store; `speedup` divides every interval (the demo)."""
    if not speedup > 0:
        raise InvalidInput(f"speedup must be a positive number, not {speedup!r}")
    calls: dict[str, Callable[[], Any]] = {
        "fleetlens_rollup": lambda: periodic.rollup_and_retain(store, settings),
        "fleetlens_analyze": lambda: periodic.analyze(store, settings),
        "fleetlens_enforce": lambda: cycle.run_cycle(store, settings, enforce=enforce),
        "fleetlens_periodic_profile": lambda: profiles.profile_top_workflows(store, settings),
        "fleetlens_import_prometheus": lambda: import_from_settings(store, settings),
        "fleetlens_import_slurm": lambda: import_slurm_from_settings(store, settings),
    }
    jobs = [Job(name, CADENCES[name] / speedup, fn, retry_base_s=RETRY_BASE_S / speedup) for name, fn in calls.items()]
    jobs.append(Job(TRACES_JOB, TRACES_INTERVAL_S, lambda: periodic.analyze_traces(store, settings),
                    first_delay_s=TRACES_INTERVAL_S))
    return jobs
