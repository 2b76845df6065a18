"""The batch-serving event loop: requests arrive into one queue per batching group, `n_gpus` devices each run one
batch at a time for g(|B|) * max(member times), and a policy (enforcer.serving.policy.BatchPolicy) picks what
runs whenever a device is free. Every request ends in exactly one bucket: on time, late, dropped by the policy,
or still queued when the trace ends (both of the last two are counted, never lost)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from enforcer.serving.distribution import TimeGrid, batch_cost
from enforcer.serving.policy import ArrayRequestView, BatchPolicy
from store.errors import InvalidInput


@dataclass
class Workload(ArrayRequestView):
    """Requests sorted by arrival (seconds from 0); `app` and `group` are indices; `time` is each request's true
    execution time alone; `deadline` is arrival + its application's SLO."""

    arrival: np.ndarray
    app: np.ndarray
    group: np.ndarray
    time: np.ndarray
    deadline: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if any(len(a) != n for a in (self.app, self.group, self.time, self.deadline)):
            raise InvalidInput("workload: arrival, app, group, time and deadline must have one entry per request")
        if n and np.any(np.diff(self.arrival) < 0):
            raise InvalidInput("workload: arrivals must be sorted (a clock that goes backwards)")
        if np.any(~(self.time > 0)):
            raise InvalidInput("workload: every execution time must be positive")


@dataclass
class SimResult:
    policy: str
    n: int
    on_time: int = 0
    late: int = 0
    dropped: int = 0  # by the policy, from the queue or stopped while running
    stopped: int = 0  # of which stopped while running
    left_queued: int = 0
    busy_gpu_s: float = 0.0
    batches: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    batch_times: list[float] = field(default_factory=list)
    ks_pred_sum: np.ndarray | None = None  # sum over batches of the predicted batch-time CDF on `ks_grid` (a batch
    # with a stop time: the CDF of its time cut there, as its observed time is)
    ks_grid: np.ndarray | None = None
    finished_at: np.ndarray | None = None  # per request: completion time, NaN if dropped or left

    @property
    def finish_rate(self) -> float:
        return self.on_time / self.n if self.n else 0.0

    def ks_batch_time(self) -> float:
        """Largest gap between the mean predicted batch-time CDF and the simulated batch times' empirical CDF."""
        if self.ks_pred_sum is None or not self.batch_times:
            return float("nan")
        pred = self.ks_pred_sum / len(self.batch_times)
        emp = np.searchsorted(np.sort(self.batch_times), self.ks_grid, side="right") / len(self.batch_times)
        return float(np.max(np.abs(pred - emp)))


def simulate(work: Workload, policy: BatchPolicy, n_gpus: int, alpha: float,
             grid: TimeGrid | None = None) -> SimResult:
    """Replay `work` under `policy` on `n_gpus` devices. With `grid`, batches whose policy gave a predicted CDF
    feed the predicted-vs-simulated batch-time comparison (ks_batch_time)."""
    if n_gpus < 1:
        raise InvalidInput(f"n_gpus={n_gpus}: at least one device")
    n = len(work.arrival)
    res = SimResult(policy.name, n)
    res.finished_at = np.full(n, np.nan)
    queues: dict[int, list[int]] = {}
    state = np.zeros(n, dtype=np.int8)  # 0 waiting/unseen, 1 running, 2 on time, 3 late, 4 dropped
    running: list[tuple[float, int, int, list[int], float, bool]] = []
    seq = 0
    free = n_gpus
    wake: float | None = None
    i = 0
    max_g = batch_cost(64, alpha)
    if grid is not None:
        res.ks_grid = np.arange(grid.cells) * grid.step * max_g / 4
        res.ks_pred_sum = np.zeros(grid.cells)
    arrival, group_of, deadline, true_time = work.arrival, work.group, work.deadline, work.time
    while True:
        t_arr = arrival[i] if i < n else np.inf
        t_done = running[0][0] if running else np.inf
        t_wake = wake if wake is not None else np.inf
        now = min(t_arr, t_done, t_wake)
        if now == np.inf:
            break
        if t_wake <= now:
            wake = None
        while running and running[0][0] <= now:
            end, _, grp, batch, exec_time, stopped = heapq.heappop(running)
            free += 1
            if stopped:
                res.stopped += len(batch)
                res.dropped += len(batch)
                state[batch] = 4
                continue
            for r in batch:
                ok = end <= deadline[r] + 1e-9
                state[r] = 2 if ok else 3
                res.finished_at[r] = end
                if ok:
                    res.on_time += 1
                else:
                    res.late += 1
            policy.completed(grp, batch, exec_time, work)
        while i < n and arrival[i] <= now:
            queues.setdefault(int(group_of[i]), []).append(i)
            i += 1
        while free > 0:
            sel = policy.select(now, queues, work)
            if sel.drop:
                dropped = set(sel.drop)
                res.dropped += len(dropped)
                state[list(dropped)] = 4
                for g in {int(group_of[r]) for r in dropped}:
                    queues[g] = [r for r in queues[g] if r not in dropped]
            if not sel.batch:
                wake = sel.wake_at if sel.wake_at is not None and sel.wake_at > now else wake
                break
            batch = sel.batch
            grp = int(group_of[batch[0]])
            if any(int(group_of[r]) != grp for r in batch):
                raise InvalidInput(f"{policy.name}: a batch mixes batching groups (models)")
            q = queues[grp]
            if q[: len(batch)] == batch:
                del q[: len(batch)]
            else:
                taken = set(batch)
                queues[grp] = [r for r in q if r not in taken]
            g = batch_cost(len(batch), alpha)
            exec_time = g * float(true_time[batch].max())
            stopped = sel.stop_after is not None and sel.stop_after < exec_time
            if stopped:
                exec_time = max(0.0, sel.stop_after)
            seq += 1
            heapq.heappush(running, (now + exec_time, seq, grp, batch, exec_time, stopped))
            state[batch] = 1
            free -= 1
            res.busy_gpu_s += exec_time
            res.batches += 1
            res.batch_sizes.append(len(batch))
            if grid is not None and sel.predicted_cdf is not None:
                # what is observed of a batch is its time cut at its stop: compare the prediction cut there too
                res.batch_times.append(exec_time)
                pred = sel.predicted_cdf[grid.indices(res.ks_grid / g)]
                if sel.stop_after is not None:
                    pred = np.where(res.ks_grid >= sel.stop_after, 1.0, pred)
                res.ks_pred_sum += pred
    res.left_queued = int(sum(len(q) for q in queues.values()))
    if res.on_time + res.late + res.dropped + res.left_queued != n:
        raise AssertionError(f"{policy.name}: requests unaccounted for")
    return res
