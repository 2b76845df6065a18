"""How long a process's threads waited for a core: the run-queue delay Linux keeps per thread in schedstat.

`/proc/<pid>/task/<tid>/schedstat` holds three numbers per thread: nanoseconds on a CPU, nanoseconds runnable but
waiting on a run queue, and timeslices run (Documentation/scheduler/sched-stats.rst). The cpu source adds the
waiting time to a process's CPU time, so a job that is ready to run all the time counts as busy even when other
tenants of its cores keep it off them (contention is their doing, not the job's idleness).

`/proc/<pid>/schedstat` is the main thread's alone, so every thread is read. A thread's figures live only as long
as the thread; a caller keeps the previous reading per thread id and adds the growth of each (a thread first seen
after a reading of its process was made since then, so all of its delay is new).
"""

from __future__ import annotations

import os

ThreadDelays = dict[int, int]  # thread id -> nanoseconds spent runnable on a run queue


def thread_delays(pid: int) -> ThreadDelays | None:
    """Run-queue delay of each live thread of `pid`, or None when the process is gone or the kernel keeps no
    schedstat (a kernel built without CONFIG_SCHED_INFO)."""
    task = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task)
    except OSError:
        return None
    delays: ThreadDelays = {}
    for tid in tids:
        try:
            with open(f"{task}/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:
            continue  # the thread ended while listed
        if len(fields) >= 2:
            delays[int(tid)] = int(fields[1])
    return delays or None


def delay_growth(before: ThreadDelays, after: ThreadDelays) -> float:
    """Seconds of run-queue delay the threads added between two readings of one process."""
    grown = 0
    for tid, ns in after.items():
        grown += max(ns - before.get(tid, 0), 0)
    return grown / 1e9
