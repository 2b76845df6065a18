"""The distribution-aware scheduler live: an in-process request queue a serving loop calls.

    q = RequestQueue(dists, slos={"short": 0.05, "long": 0.2}, alpha=0.1, groups={"short": "m", "long": "m"})
    q.submit("short", x)              # any thread: a request arrives (its deadline = now + its app's SLO)
    batch = q.next_batch(timeout=1)   # the serving loop: the policy's next batch (one batching group), or None
    ...run the model on batch.payloads...
    q.dropped()                       # requests the policy shed since the last call (count them: never lost)

With `stop_running`, a batch carries `stop_at` (the queue's clock): an iterative model checks it between steps
and, once past it, gives the batch up with `q.stop(batch)`; its requests are shed like dropped ones.

The same `DistributionAware.select` the simulator replays decides here; the queue only keeps the waiting requests'
applications, arrivals and deadlines in arrays the policy reads (its `RequestView`), one slot a waiting request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from enforcer.serving.distribution import Distributions
from enforcer.serving.policy import DEFAULT_EPS, DEFAULT_MAX_BATCH, ArrayRequestView, DistributionAware
from store.errors import InvalidInput


@dataclass
class LiveRequest:
    id: int
    app: str
    payload: Any
    arrival: float
    deadline: float


@dataclass
class LiveBatch:
    group: str
    requests: list[LiveRequest]
    predicted_cdf: np.ndarray | None
    stop_at: float | None = None  # when the serving loop should give the batch up unfinished (None: never)
    given_up: bool = False

    @property
    def payloads(self) -> list[Any]:
        return [r.payload for r in self.requests]

    @property
    def apps(self) -> list[str]:
        return [r.app for r in self.requests]

    @property
    def arrivals(self) -> list[float]:
        return [r.arrival for r in self.requests]


class _View(ArrayRequestView):
    """Arrays indexed by slot (the policy's RequestView): a request holds a slot while it waits in the queue, and
    the slot is reused once the request is batched or dropped, so the arrays grow only with the most requests ever
    waiting at once, not with every request ever submitted."""

    def __init__(self) -> None:
        self.app = np.zeros(64, dtype=np.int64)
        self.group = np.zeros(64, dtype=np.int64)
        self.arrival = np.zeros(64)
        self.deadline = np.zeros(64)
        self._free: list[int] = []
        self._used = 0  # slots below it have been handed out at least once

    def put(self, app: int, group: int, arrival: float, deadline: float) -> int:
        """A free slot filled with the request's fields."""
        if self._free:
            i = self._free.pop()
        else:
            i = self._used
            self._used += 1
            if i >= len(self.app):
                for name in ("app", "group", "arrival", "deadline"):
                    arr = getattr(self, name)
                    setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
        self.app[i], self.group[i], self.arrival[i], self.deadline[i] = app, group, arrival, deadline
        return i

    def free(self, slots: list[int]) -> None:
        """The requests in `slots` left the queue: their slots take new requests."""
        self._free.extend(slots)


class RequestQueue:
    """Thread-safe: producers `submit`, one serving loop takes `next_batch`."""

    def __init__(self, dists: Distributions, slos: Mapping[str, float], alpha: float, *,
                 groups: Mapping[str, str] | None = None, eps: float = DEFAULT_EPS,
                 max_batch: int = DEFAULT_MAX_BATCH, stop_running: bool = False, stop_eps: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        missing = [a for a in slos if a not in dists.index_of]
        if missing:
            raise InvalidInput(f"request queue: no execution-time distribution for {missing}")
        for app, slo in slos.items():
            if not slo > 0:
                raise InvalidInput(f"request queue: the SLO of {app!r} must be positive, not {slo!r}")
        self.dists = dists
        self.slos = dict(slos)
        group_names = {a: (groups or {}).get(a, a) for a in slos}
        self._group_index = {g: i for i, g in enumerate(sorted(set(group_names.values())))}
        self._group_names = {i: g for g, i in self._group_index.items()}
        self._app_group = {a: self._group_index[g] for a, g in group_names.items()}
        self.policy = DistributionAware(dists, alpha, eps=eps, max_batch=max_batch, stop_running=stop_running,
                                        stop_eps=stop_eps)
        self.clock = clock
        self._view = _View()
        self._queues: dict[int, list[int]] = {}  # group -> slots of its waiting requests, in arrival order
        self._requests: dict[int, LiveRequest] = {}  # slot -> the request waiting in it
        self._dropped: list[LiveRequest] = []
        self._next_id = 0
        self._cond = threading.Condition()
        self.submitted = 0
        self.served = 0
        self.shed = 0
        self.stopped = 0

    def submit(self, app: str, payload: Any = None) -> LiveRequest:
        if app not in self.slos:
            raise InvalidInput(f"request queue: unknown application {app!r}; known: {sorted(self.slos)}")
        with self._cond:
            now = self.clock()
            i = self._next_id
            self._next_id += 1
            req = LiveRequest(i, app, payload, now, now + self.slos[app])
            g = self._app_group[app]
            slot = self._view.put(self.dists.index_of[app], g, now, req.deadline)
            self._queues.setdefault(g, []).append(slot)
            self._requests[slot] = req
            self.submitted += 1
            self._cond.notify()
        return req

    def pending(self) -> int:
        with self._cond:
            return len(self._requests)

    def dropped(self) -> list[LiveRequest]:
        """The requests the policy shed since the last call."""
        with self._cond:
            out, self._dropped = self._dropped, []
            return out

    def past_stop(self, batch: LiveBatch) -> bool:
        """Whether the queue's clock has reached `batch.stop_at` (never, for a batch with none): what an iterative
        model asks between its steps."""
        return batch.stop_at is not None and self.clock() >= batch.stop_at

    def stop(self, batch: LiveBatch) -> None:
        """The serving loop gave `batch` up unfinished (past its `stop_at`): its requests are shed, not served. A
        batch is given up once; a second call raises InvalidInput rather than count its requests twice."""
        with self._cond:
            if batch.given_up:
                raise InvalidInput(f"request queue: the batch of requests {[r.id for r in batch.requests]} was "
                                   "already given up")
            batch.given_up = True
            self._dropped.extend(batch.requests)
            self.served -= len(batch.requests)
            self.shed += len(batch.requests)
            self.stopped += len(batch.requests)

    def next_batch(self, timeout: float | None = None) -> LiveBatch | None:
        """The policy's next batch, waiting up to `timeout` seconds for one (None: nothing to run by then)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                now = self.clock()
                sel = self.policy.select(now, self._queues, self._view)
                if sel.drop:
                    dropped = set(sel.drop)
                    for g, q in self._queues.items():
                        self._queues[g] = [r for r in q if r not in dropped]
                    for r in sel.drop:
                        self._dropped.append(self._requests.pop(r))
                    self._view.free(sel.drop)
                    self.shed += len(dropped)
                if sel.batch:
                    g = int(self._view.group[sel.batch[0]])
                    taken = set(sel.batch)
                    self._queues[g] = [r for r in self._queues[g] if r not in taken]
                    reqs = [self._requests.pop(r) for r in sel.batch]
                    self._view.free(sel.batch)
                    self.served += len(reqs)
                    stop_at = None if sel.stop_after is None else now + sel.stop_after
                    return LiveBatch(self._group_names[g], reqs, sel.predicted_cdf, stop_at)
                wait = None if end is None else end - time.monotonic()
                if wait is not None and wait <= 0:
                    return None
                self._cond.wait(wait)
