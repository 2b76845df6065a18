"""What the serving SDK (collector.serving) keeps per application and minute, and the checked request it adds.

A minute holds exact counts, sums and log-bucket histograms (store.latency_sketch): latency, execution time, and
execution time per batch-size class (store.batch_sizes: a request's execution time is its batch's, which grows with
the batch's size). `record` is the minute as the agent and the store take it (store.serving.check_minute).
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any, NamedTuple

from store import latency_sketch as ls
from store.errors import InvalidInput


class ServedRequest(NamedTuple):
    """One served request, checked: every value valid, so adding it to a minute cannot fail half-way."""

    app: str
    arrival: float
    end: float
    wait: float
    exec_s: float
    latency: float
    batch_size: int
    size_class: int
    exec_bucket: int
    latency_bucket: int


class Minute:
    """One application's requests that arrived in one minute."""

    __slots__ = ("n", "dropped", "met", "unjudged", "exec_sum", "exec_sumsq", "wait_sum", "latency_sum",
                 "batch_sum", "exec_hist", "latency_hist", "by_batch")

    def __init__(self, *, judged: bool) -> None:
        """`judged`: the application has an SLO, so `met` counts from 0 (else it stays None)."""
        self.n = self.dropped = self.batch_sum = 0
        self.met: int | None = 0 if judged else None
        self.unjudged = False  # a request recorded while its application had no SLO: met stays None
        self.exec_sum = self.exec_sumsq = self.wait_sum = self.latency_sum = 0.0
        self.exec_hist: dict[int, int] = {}
        self.latency_hist: dict[int, int] = {}
        self.by_batch: dict[int, list] = {}  # batch-size class -> [requests, their batch sizes' sum, exec histogram]

    def add(self, r: ServedRequest, slo: float | None) -> None:
        """Count one served request, judged against `slo` (None: its application has none yet)."""
        self.n += 1
        self.exec_sum += r.exec_s
        self.exec_sumsq += r.exec_s * r.exec_s
        self.wait_sum += r.wait
        self.latency_sum += r.latency
        self.batch_sum += r.batch_size
        self.exec_hist[r.exec_bucket] = self.exec_hist.get(r.exec_bucket, 0) + 1
        c = self.by_batch.get(r.size_class)
        if c is None:
            c = self.by_batch[r.size_class] = [0, 0, {}]
        c[0] += 1
        c[1] += r.batch_size
        c[2][r.exec_bucket] = c[2].get(r.exec_bucket, 0) + 1
        self.latency_hist[r.latency_bucket] = self.latency_hist.get(r.latency_bucket, 0) + 1
        if slo is None:
            self.unjudged, self.met = True, None
        elif not self.unjudged:
            self.met = (self.met or 0) + (r.latency <= slo)

    def record(self, app: str, minute: float) -> dict[str, Any]:
        return {"app": app, "minute": minute, "n": self.n, "dropped": self.dropped, "met": self.met,
                "exec_sum": self.exec_sum, "exec_sumsq": self.exec_sumsq, "wait_sum": self.wait_sum,
                "latency_sum": self.latency_sum, "batch_sum": self.batch_sum,
                "exec_hist": ls.to_json(self.exec_hist), "latency_hist": ls.to_json(self.latency_hist),
                "exec_by_batch": {str(c): {"n": k, "batch_sum": b, "hist": ls.to_json(h)}
                                  for c, (k, b, h) in sorted(self.by_batch.items())}}


def seconds(x: Any, app: str, what: str) -> float:
    """A finite number of seconds as a plain float (numpy's too: the protocol is JSON)."""
    if type(x) is not float:  # the usual case skips the slower checks below
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise InvalidInput(f"serving {app!r}: {what} {x!r} is not a number of seconds")
        try:
            x = float(x)
        except OverflowError:
            x = math.inf
    if not math.isfinite(x):
        raise InvalidInput(f"serving {app!r}: {what} {x!r} is not a finite time")
    return x


def whole(x: Any, what: str) -> int:
    """A whole number >= 1 (numpy integers too, as a plain int: the protocol is JSON)."""
    if type(x) is not int and (isinstance(x, bool) or not isinstance(x, numbers.Integral)):
        raise InvalidInput(f"serving: {what} {x!r} is not a whole number >= 1")
    if x < 1:
        raise InvalidInput(f"serving: {what} {x!r} is not a whole number >= 1")
    return int(x)


def json_size(rec: dict[str, Any]) -> int:
    """Bytes a record takes in a message (protocol.encode's compact JSON)."""
    return len(json.dumps(rec, separators=(",", ":")))
