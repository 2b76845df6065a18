"""The job SDK's serving mode: a serving loop records each request (application, arrival, queue wait, batch size,
execution time), and the SDK sends per-application per-minute histograms to the host's agent.

    from collector.serving import serving

    with serving(workflow="sd-api", slos={"txt2img": 2.0}, devices=2) as rec:
        while True:
            batch = queue.next_batch()                     # e.g. enforcer.serving.live.RequestQueue
            with rec.batch(batch.app, batch.arrivals):     # times the batch: CUDA events on a GPU, wall time else
                out = model(batch.inputs)
            rec.shed(app, arrivals_of_dropped)             # requests the scheduler dropped: counted, not lost

Per request the SDK only adds to in-memory sums and two log-bucket histograms (store.latency_sketch: quantiles to
1 %), so recording costs about a microsecond; about once a second (settings.sdk_flush_interval_s) what
accumulated goes to the agent as one `serving` message. Without an agent the sums wait (merged by minute, so
they stay small) and are sent when one answers; past MAX_PENDING_MINUTES app-minutes the oldest are given up and
counted in `lost`. Bad input raises InvalidInput: a request with no application, an execution time <= 0 or not
finite, a start before the arrival or an end before the start (a clock that goes backwards). A wall clock that
steps back between requests is counted in `clock_steps_back` and the request is filed under the latest minute.

Raw requests are opt-in (settings.serving_raw_requests): each request's [app, arrival, wait, execution, latency,
batch size] goes along too, the newest settings.serving_raw_max_rows waiting at once (those they replace are
counted in `raw_over_cap`, sent along, and counted by the store, which keeps each workflow's newest rows up to the
same cap: store.serving_raw).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from collector import protocol as p
from collector.sdk_settings import job_settings
from store import latency_sketch as ls
from store.errors import InvalidInput
from store.settings import Settings

log = logging.getLogger(__name__)

MAX_PENDING_MINUTES = 100_000
RAW_PER_MESSAGE = 5_000  # raw requests per message: ~100-400 bytes each, well under protocol.MAX_LINE


class _Minute:
    __slots__ = ("n", "dropped", "met", "exec_sum", "exec_sumsq", "wait_sum", "latency_sum", "batch_sum",
                 "exec_hist", "latency_hist")

    def __init__(self) -> None:
        self.n = self.dropped = self.batch_sum = 0
        self.met: int | None = None
        self.exec_sum = self.exec_sumsq = self.wait_sum = self.latency_sum = 0.0
        self.exec_hist: dict[int, int] = {}
        self.latency_hist: dict[int, int] = {}

    def record(self, app: str, minute: float) -> dict[str, Any]:
        return {"app": app, "minute": minute, "n": self.n, "dropped": self.dropped, "met": self.met,
                "exec_sum": self.exec_sum, "exec_sumsq": self.exec_sumsq, "wait_sum": self.wait_sum,
                "latency_sum": self.latency_sum, "batch_sum": self.batch_sum,
                "exec_hist": ls.to_json(self.exec_hist), "latency_hist": ls.to_json(self.latency_hist)}


class ServingRecorder:
    """Records a serving loop's requests (see the module's docstring). Not thread-safe: one serving loop."""

    def __init__(self, workflow: str | None = None, *, slos: dict[str, float] | None = None, devices: int = 1,
                 settings: Settings | None = None, cuda: bool | None = None) -> None:
        self.settings = settings if settings is not None else job_settings()  # the SDK's entry point
        if devices < 1:
            raise InvalidInput(f"devices={devices}: a service holds at least one device")
        self.workflow_id = workflow or self.settings.workflow or "serving"
        self.slos: dict[str, float] = {}
        for app, slo in (slos or {}).items():
            self.set_slo(app, slo)
        self.devices = devices
        self._pending: dict[tuple[str, float], _Minute] = {}
        self._conn = p.AgentConnection(self.settings.socket_path, self.settings.sdk_timeout_s)
        self._next_connect = 0.0
        self._next_flush = time.monotonic() + self.settings.sdk_flush_interval_s
        self._last_wall = -math.inf
        self._torch: Any = None
        self._cuda = cuda
        self._sent_slos: dict[str, float] = {}
        self.recorded = 0  # requests recorded (served)
        self.shed_count = 0  # requests recorded as dropped
        self.sent = 0  # requests (served + dropped) the agent took
        self.lost = 0  # requests given up (no agent for too long): counted, and logged
        self.clock_steps_back = 0
        self._raw_on = bool(self.settings.serving_raw_requests)
        self._raw: deque[list] = deque(maxlen=self.settings.serving_raw_max_rows)
        self.raw_sent = 0
        self.raw_over_cap = 0  # raw requests not kept: newer ones took their place while the agent did not take them

    # ---- lifecycle
    def __enter__(self) -> ServingRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Send what is left (waiting for the agent up to its timeout) and disconnect."""
        try:
            self.flush(force=True)
        finally:
            self._conn.close()

    def set_slo(self, app: str, slo_s: float) -> None:
        if not isinstance(app, str) or not app:
            raise InvalidInput("SLO: name the application")
        if not (isinstance(slo_s, int | float) and slo_s > 0 and math.isfinite(slo_s)):
            raise InvalidInput(f"SLO for {app!r}: {slo_s!r} is not a positive number of seconds")
        self.slos[app] = float(slo_s)

    # ---- recording
    def _minute(self, app: str, arrival: float) -> _Minute:
        key = (app, arrival - arrival % 60.0)
        m = self._pending.get(key)
        if m is None:
            if len(self._pending) >= MAX_PENDING_MINUTES:
                self._give_up_oldest()
            m = self._pending[key] = _Minute()
            if app in self.slos:
                m.met = 0
        return m

    def record(self, app: str, *, arrival: float, start: float, end: float, batch_size: int = 1,
               exec_s: float | None = None) -> None:
        """One served request: wall-clock arrival, start and end of its batch (time.time() seconds); `exec_s`
        the batch's execution time when measured otherwise than end - start (CUDA events, thread CPU time)."""
        if not isinstance(app, str) or not app:
            raise InvalidInput("serving: a request with no application")
        if not (math.isfinite(arrival) and math.isfinite(start) and math.isfinite(end)):
            raise InvalidInput(f"serving {app!r}: arrival, start and end must be finite times")
        if start < arrival:
            raise InvalidInput(f"serving {app!r}: started {arrival - start:.6f} s before it arrived (clock went "
                               "backwards?)")
        if end < start:
            raise InvalidInput(f"serving {app!r}: ended {start - end:.6f} s before it started (clock went backwards?)")
        exec_s = end - start if exec_s is None else exec_s
        if not (exec_s > 0 and math.isfinite(exec_s)):
            raise InvalidInput(f"serving {app!r}: execution time {exec_s!r} s is not positive (end before start?)")
        if batch_size < 1:
            raise InvalidInput(f"serving {app!r}: batch size {batch_size} < 1")
        if arrival < self._last_wall - 60.0:  # the wall clock was set back: keep the durations, file it late
            self.clock_steps_back += 1
            shift = self._last_wall - arrival
            arrival, start, end = arrival + shift, start + shift, end + shift
        self._last_wall = max(self._last_wall, arrival)
        wait = start - arrival
        latency = end - arrival
        m = self._minute(app, arrival)
        m.n += 1
        m.exec_sum += exec_s
        m.exec_sumsq += exec_s * exec_s
        m.wait_sum += wait
        m.latency_sum += latency
        m.batch_sum += batch_size
        ls.add(m.exec_hist, exec_s)
        ls.add(m.latency_hist, latency)
        if self._raw_on:
            if len(self._raw) == self._raw.maxlen:
                self.raw_over_cap += 1  # the oldest waiting row gives way to this one (with a cap of 0, this one)
            self._raw.append([app, arrival, wait, exec_s, latency, batch_size])
        slo = self.slos.get(app)
        if slo is not None and latency <= slo:
            m.met = (m.met or 0) + 1
        self.recorded += 1
        self._maybe_flush()

    def shed(self, app: str, arrivals: Sequence[float]) -> None:
        """Requests the scheduler dropped (overload, hopeless deadline): counted per minute, never served."""
        if not isinstance(app, str) or not app:
            raise InvalidInput("serving: a dropped request with no application")
        for a in arrivals:
            if not math.isfinite(a):
                raise InvalidInput(f"serving {app!r}: a dropped request's arrival {a!r} is not a time")
            self._minute(app, a).dropped += 1
            self.shed_count += 1
        self._maybe_flush()

    @contextmanager
    def batch(self, app: str | Sequence[str], arrivals: Sequence[float], *, cpu_time: bool = False):
        """Time one batch around the `with` body and record each member (`app` one name for all, or one per
        arrival). On a GPU the execution time is measured with CUDA events around the body's kernels (the block
        waits for them); on a CPU, wall time, or with `cpu_time` the serving thread's CPU time (a host shared with
        other busy processes stretches wall time by however long they held the core). Latency is wall time."""
        if not arrivals:
            raise InvalidInput(f"serving {app!r}: a batch holds at least one request")
        apps = [app] * len(arrivals) if isinstance(app, str) else list(app)
        if len(apps) != len(arrivals):
            raise InvalidInput(f"serving: {len(apps)} applications for {len(arrivals)} requests in one batch")
        torch = self._cuda_torch()
        start_wall = time.time()
        if torch is not None:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        t0 = time.perf_counter()
        c0 = time.thread_time()
        yield
        if torch is not None:
            ev1.record()
            ev1.synchronize()
            exec_s = ev0.elapsed_time(ev1) / 1000.0
        elif cpu_time:
            exec_s = time.thread_time() - c0
        else:
            exec_s = time.perf_counter() - t0
        exec_s = max(exec_s, 1e-9)
        end_wall = max(time.time(), start_wall + 1e-9)
        for name, a in zip(apps, arrivals, strict=True):
            self.record(name, arrival=min(a, start_wall), start=start_wall, end=end_wall,
                        batch_size=len(arrivals), exec_s=exec_s)

    def _cuda_torch(self) -> Any:
        if self._cuda is False:
            return None
        if self._torch is None:
            import sys

            self._torch = sys.modules.get("torch")  # a serving loop on torch has it imported already
        if self._torch is None or not self._torch.cuda.is_available():
            self._cuda = False
            return None
        return self._torch

    # ---- sending
    def _maybe_flush(self) -> None:
        if time.monotonic() >= self._next_flush:
            self.flush()

    def flush(self, *, force: bool = False) -> bool:
        """Send every pending minute (and raw request) to the agent; True when the agent took them (or there was
        nothing). Raw requests go RAW_PER_MESSAGE at a time, so no message passes the protocol's line limit."""
        self._next_flush = time.monotonic() + self.settings.sdk_flush_interval_s
        if not self._pending and not self._raw and not self.raw_over_cap:
            return True
        if not self._link_ready(force=force):
            return False
        items = list(self._pending.items())
        minutes = [m.record(app, minute) for (app, minute), m in items]
        raw, raw_over = self._raw_head(), self.raw_over_cap
        if not self._send(minutes, raw, raw_over):
            return False
        for key, m in items:
            self.sent += m.n + m.dropped
            del self._pending[key]
        self._took_raw(raw, raw_over)
        while self._raw:
            raw = self._raw_head()
            if not self._send([], raw, 0):
                return False
            self._took_raw(raw, 0)
        return True

    def _send(self, minutes: list[dict[str, Any]], raw: list[list], raw_over: int) -> bool:
        msg = {"op": p.SERVING, "v": p.VERSION, "workflow": self.workflow_id, "pid": _pid(), "rank": 0,
               "devices": self.devices, "slos": self.slos, "minutes": minutes}
        if raw or raw_over:
            msg["raw"], msg["raw_over_cap"] = raw, raw_over
        try:
            reply = self._conn.request(msg)
        except OSError as exc:
            self._next_connect = time.monotonic() + self.settings.sdk_retry_s
            log.info("serving: the fleetlens agent did not take %d minutes and %d raw requests (%s); kept for later",
                     len(minutes), len(raw), exc)
            return False
        if not reply.get("ok"):
            if reply.get("retry"):
                return False
            raise InvalidInput(f"serving: the agent refused the requests: {reply.get('error')}")
        return True

    def _raw_head(self) -> list[list]:
        return list(itertools.islice(self._raw, RAW_PER_MESSAGE))

    def _took_raw(self, raw: list[list], raw_over: int) -> None:
        for _ in raw:  # the serving loop's own thread flushes: nothing was appended since _raw_head
            self._raw.popleft()
        self.raw_over_cap -= raw_over
        self.raw_sent += len(raw)

    def _link_ready(self, force: bool = False) -> bool:
        if self._conn.connected:
            return True
        now = time.monotonic()
        if now < self._next_connect and not force:
            return False
        try:
            self._conn.connect()
            return True
        except OSError as exc:
            self._next_connect = now + self.settings.sdk_retry_s
            log.debug("serving: no fleetlens agent at %s (%s)", self.settings.socket_path, exc)
            return False

    def _give_up_oldest(self) -> None:
        key = min(self._pending, key=lambda k: k[1])
        m = self._pending.pop(key)
        self.lost += m.n + m.dropped
        log.warning("serving: no agent took %s's minute %s: %d requests given up (%d so far)", key[0], key[1],
                    m.n + m.dropped, self.lost)


def serving(workflow: str | None = None, **kw: Any) -> ServingRecorder:
    """A `ServingRecorder` to use as a context manager around a serving loop."""
    return ServingRecorder(workflow, **kw)


def _pid() -> int:
    import os

    return os.getpid()
