"""The job SDK's serving mode: a serving loop records each request (application, arrival, queue wait, batch size,
execution time), and the SDK sends per-application per-minute histograms to the host's agent.

    from collector.serving import serving

    with serving(workflow="sd-api", slos={"txt2img": 2.0}, devices=2) as rec:
        while True:
            batch = queue.next_batch()                     # e.g. enforcer.serving.live.RequestQueue
            with rec.batch(batch):                         # times the batch: CUDA events on a GPU, wall time else
                out = model(batch.inputs)                  # may give the batch up: queue.stop(batch)
            for r in queue.dropped():                      # requests the scheduler dropped or gave up
                rec.shed(r.app, [r.arrival])               # counted, not lost

Per request the SDK only adds to in-memory sums and log-bucket histograms (store.latency_sketch: quantiles to 1 %):
latency, execution time, and execution time in the request's batch-size class (store.batch_sizes: a batch's time
grows with its size, so only within one size does it show the model's own variation). Recording costs a few
microseconds; about once a second (settings.sdk_flush_interval_s) what accumulated goes to the agent in `serving`
messages (at most MINUTES_PER_MESSAGE minutes and MESSAGE_BYTES of them each; a minute larger than that on its own,
which only times spread over many orders of magnitude in many batch-size classes make, goes without its batch-size
classes, so no message reaches protocol.MAX_LINE), each with the recorder's `sender` token and a `seq`: a message the
agent did not answer in time is sent again unchanged, before anything newer, and the agent merges it once. Without
an agent the sums wait (merged by minute, so they stay small) and are sent when one answers; past MAX_PENDING_MINUTES
app-minutes the oldest are given up and counted in `lost`, as are the requests of a message the agent refuses (logged
with its reason; never sent again) and what no agent took by close().

Bad input raises InvalidInput before anything of the call is counted: a request with no application (or a name the
store would refuse: store.serving.check_app), a time that is not a finite number, a start before the arrival, an end
before the start, an execution time <= 0 or longer than start to end (beyond the wall clock's resolution), a batch
size that is not a whole number >= 1. A request's latency is at least its wait plus its execution time, so a wall
clock too coarse to tick during a batch still gives a positive latency. A wall clock that steps back (a request ending
over STEP_BACK_TOLERANCE_S before the latest end recorded) is counted once in `clock_steps_back`, and from then on the
step is added to every time recorded, so the minutes stay in order. A minute holding a request recorded before its
application's SLO was known sends met=None (not judged), not a count of part of its requests.

Raw requests are opt-in (settings.serving_raw_requests): each request's [app, arrival, wait, execution, latency, batch
size] goes too, in messages of their own, the newest settings.serving_raw_max_rows waiting at once (those they replace
are counted in `raw_over_cap`, sent along, and counted by the store, which keeps each workflow's newest rows up to the
same cap: store.serving_raw).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, NamedTuple

from collector import protocol as p
from collector.sdk_settings import job_settings
from collector.serving_minute import Minute, ServedRequest, json_size, seconds, whole
from store import batch_sizes as bs
from store import latency_sketch as ls
from store.errors import InvalidInput
from store.serving import check_app, check_slo
from store.settings import Settings

log = logging.getLogger(__name__)

MAX_PENDING_MINUTES = 100_000
RAW_PER_MESSAGE = 5_000  # raw requests per message: ~100-400 bytes each, well under protocol.MAX_LINE
# Minutes per message: at most MINUTES_PER_MESSAGE (a refused message gives up no more) and MESSAGE_BYTES of them. A
# histogram holds at most ~1,750 buckets for times from 1 ns to ten days (2 % wide), ~22 KB; a minute has two plus up
# to len(bs.CLASSES) = 21 batch-size classes, so one minute may be ~0.5 MB and fifty no longer fit protocol.MAX_LINE
# (4 MiB): messages are sized by what their minutes hold. A minute over MESSAGE_BYTES on its own (times over many more
# orders of magnitude) goes without its classes: its two histograms alone stay under MAX_LINE (~73,000 buckets each at
# most, every positive double).
MINUTES_PER_MESSAGE = 50
MESSAGE_BYTES = p.MAX_LINE // 4
# Requests are recorded when their batch ends, so ends come nearly in order; arrivals do not (a long queue wait).
# An end this far before the latest one is the wall clock set back, not requests recorded out of order.
STEP_BACK_TOLERANCE_S = 60.0
# An execution time measured on another clock (CUDA events, perf_counter, thread time) may exceed the wall clock's
# start to end by the wall clock's resolution, the float spacing of epoch times (~0.24 us) and a rate difference
# (NTP slews the wall clock by up to 500 ppm).
_WALL_RESOLUTION = time.get_clock_info("time").resolution
_CLOCK_RATE_SLACK = 1e-3


class _Message(NamedTuple):
    """A message for the agent, as built once and sent (again) unchanged, with what it carries for the counts."""

    msg: dict[str, Any]
    requests: int  # served + dropped
    raw: int  # raw request rows
    raw_over: int  # raw requests counted over the cap


class ServingRecorder:
    """Records a serving loop's requests (see the module's docstring). Not thread-safe: one serving loop."""

    def __init__(self, workflow: str | None = None, *, slos: dict[str, float] | None = None, devices: int = 1,
                 settings: Settings | None = None, cuda: bool | None = None) -> None:
        self.settings = settings if settings is not None else job_settings()  # the SDK's entry point
        self.devices = whole(devices, "devices (a service holds at least one device)")
        self.workflow_id = workflow or self.settings.workflow or "serving"
        self.slos: dict[str, float] = {}
        for app, slo in (slos or {}).items():
            self.set_slo(app, slo)
        self._pending: dict[tuple[str, float], Minute] = {}
        # each message carries this recorder's sender token and a sequence number; one the agent did not answer is
        # sent again exactly as it was, under its number, before any newer one, so the agent merges it once
        self._sender = uuid.uuid4().hex
        self._seq = 0
        self._in_flight: _Message | None = None
        self._conn = p.AgentConnection(self.settings.socket_path, self.settings.sdk_timeout_s)
        self._next_connect = 0.0
        self._next_flush = time.monotonic() + self.settings.sdk_flush_interval_s
        self._last_end = -math.inf  # the latest end recorded, on the corrected clock
        self._wall_shift = 0.0  # added to every time recorded: the sum of the wall clock's steps back
        self._torch: Any = None
        self._cuda = cuda
        self.recorded = 0  # requests recorded (served)
        self.shed_count = 0  # requests recorded as dropped
        self.sent = 0  # requests (served + dropped) the agent took
        self.lost = 0  # requests given up (no agent for too long, or refused by it): counted, and logged
        self.refused = 0  # messages the agent refused as invalid (their requests are in `lost`)
        self.clock_steps_back = 0
        self._raw_on = bool(self.settings.serving_raw_requests)
        self._raw: deque[list] = deque(maxlen=self.settings.serving_raw_max_rows)
        self.raw_sent = 0
        self.raw_over_cap = 0  # raw requests not kept: newer ones took their place while the agent did not take them
        self.raw_refused = 0  # raw requests (rows, and counts over the cap) in messages the agent refused
        self.raw_lost = 0  # raw requests no agent took before the recorder closed

    # ---- lifecycle
    def __enter__(self) -> ServingRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Send what is left (waiting for the agent up to its timeout) and disconnect; what no agent took is
        counted in `lost` (and `raw_lost`) and logged."""
        try:
            self.flush(force=True)
        finally:
            self._conn.close()
            self._give_up_unsent()

    def set_slo(self, app: str, slo_s: float) -> None:
        app, slo_s = check_slo(app, slo_s)  # the store's rule, so the agent never refuses what the SDK took
        self.slos[app] = slo_s

    # ---- recording
    def record(self, app: str, *, arrival: float, start: float, end: float, batch_size: int = 1,
               exec_s: float | None = None) -> None:
        """One served request: wall-clock arrival, start and end of its batch (time.time() seconds); `exec_s`
        the batch's execution time when measured otherwise than end - start (CUDA events, thread CPU time). Its
        latency is end - arrival, and at least its wait plus `exec_s` (a coarse wall clock may not have ticked)."""
        self._add([self._check(app, arrival, start, end, batch_size, exec_s)])
        self._maybe_flush()

    def shed(self, app: str, arrivals: Sequence[float]) -> None:
        """Requests the scheduler dropped (overload, hopeless deadline): counted per minute, never served."""
        app = check_app(app, "serving: a dropped request")
        times = [seconds(a, app, "a dropped request's arrival") for a in arrivals]  # all checked before any counts
        self._add_shed([app] * len(times), times)
        self._maybe_flush()

    @contextmanager
    def batch(self, app: Any, arrivals: Sequence[float] | None = None, *, cpu_time: bool = False) -> Iterator[None]:
        """Time one batch around the `with` body and record each member: `rec.batch(app, arrivals)`, `app` one name
        for all or one per arrival, or `rec.batch(b)` with a request queue's batch (`enforcer.serving.live`:
        its `apps`, `arrivals` and `given_up`). On a GPU the execution time is measured with CUDA events around the
        body's kernels (the block waits for them); on a CPU, wall time, or with `cpu_time` the serving thread's CPU
        time (a host shared with other busy processes stretches wall time by however long they held the core).
        Latency is wall time, measured on the monotonic clock from the batch's start.

        A queue's batch given up in the body (`RequestQueue.stop`) records nothing: the queue hands its requests
        back through `dropped()`, to be shed once. When the body raises, its members are counted as dropped (they
        were not served) and the exception goes on."""
        live = None
        if arrivals is None:
            live = app
            try:
                app, arrivals = list(live.apps), list(live.arrivals)
            except (AttributeError, TypeError):
                raise InvalidInput("serving: rec.batch takes (applications, arrivals) or a request queue's batch "
                                   f"(with apps and arrivals), not {live!r}") from None
        try:
            arrivals = list(arrivals)
            apps = [app] * len(arrivals) if isinstance(app, str) else list(app)
        except TypeError:
            raise InvalidInput(f"serving: a batch of applications {app!r} and arrivals {arrivals!r}: "
                               "each must be a name or a list") from None
        if not arrivals:
            raise InvalidInput(f"serving {app!r}: a batch holds at least one request")
        if len(apps) != len(arrivals):
            raise InvalidInput(f"serving: {len(apps)} applications for {len(arrivals)} requests in one batch")
        apps = [check_app(a, "serving: a request") for a in apps]
        times = [seconds(a, name, "arrival") for name, a in zip(apps, arrivals, strict=True)]
        torch = self._cuda_torch()
        start_wall = time.time()
        t0 = time.perf_counter()
        c0 = time.thread_time()
        if torch is not None:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        try:
            yield
            if torch is not None:
                ev1.record()
                ev1.synchronize()
                exec_s = ev0.elapsed_time(ev1) / 1000.0
            elif cpu_time:
                exec_s = time.thread_time() - c0
            else:
                exec_s = time.perf_counter() - t0
            elapsed = time.perf_counter() - t0
        except BaseException:
            if not (live is not None and getattr(live, "given_up", False)):
                self._add_shed(apps, times)
            raise
        if live is not None and getattr(live, "given_up", False):
            return
        exec_s = exec_s if exec_s > 1e-9 else 1e-9  # a thread clock too coarse to tick (NaN too)
        # the end on the monotonic clock: a wall clock stepped during the batch does not change its latency, and
        # the latency is never shorter than the execution time measured on another clock
        end_wall = start_wall + max(elapsed, exec_s)
        try:
            reqs = [self._check(name, min(a, start_wall), start_wall, end_wall, len(times), exec_s)
                    for name, a in zip(apps, times, strict=True)]
        except InvalidInput:  # not expected from these measurements; if it happens, the requests are still counted
            self._add_shed(apps, times)
            raise
        self._add(reqs)
        self._maybe_flush()

    def _check(self, app: Any, arrival: Any, start: Any, end: Any, batch_size: Any, exec_s: Any) -> ServedRequest:
        """One served request checked and its derived values computed; InvalidInput says what is wrong."""
        app = check_app(app, "serving: a request")
        arrival, start, end = seconds(arrival, app, "arrival"), seconds(start, app, "start"), seconds(end, app, "end")
        if start < arrival:
            raise InvalidInput(f"serving {app!r}: started {arrival - start:.6f} s before it arrived (clock went "
                               "backwards?)")
        if end < start:
            raise InvalidInput(f"serving {app!r}: ended {start - end:.6f} s before it started (clock went backwards?)")
        exec_s = end - start if exec_s is None else seconds(exec_s, app, "execution time")
        if not exec_s > 0:
            raise InvalidInput(f"serving {app!r}: execution time {exec_s!r} s is not positive (end before start?)")
        slack = (end - start) * _CLOCK_RATE_SLACK + _WALL_RESOLUTION + 2 * math.ulp(max(abs(start), abs(end)))
        if exec_s > end - start + slack:
            raise InvalidInput(f"serving {app!r}: execution time {exec_s:.6f} s is longer than its batch's start to "
                               f"end, {end - start:.6f} s")
        batch_size = whole(batch_size, f"{app!r}: batch size")
        wait = start - arrival
        latency = max(end - arrival, wait + exec_s)  # >= each: a wall clock that did not tick still gives latency
        if not (math.isfinite(latency) and math.isfinite(exec_s * exec_s)):
            raise InvalidInput(f"serving {app!r}: times too far apart (latency {latency!r} s, execution {exec_s!r} s)")
        return ServedRequest(app, arrival, end, wait, exec_s, latency, batch_size, bs.size_class(batch_size),
                        ls.bucket(exec_s), ls.bucket(latency))

    def _corrected(self, end: float) -> float:
        """The shift to add to a request ending at `end` (wall clock): a step back is counted once, and the running
        correction then carries every later time past it."""
        end += self._wall_shift
        if end < self._last_end - STEP_BACK_TOLERANCE_S:
            self.clock_steps_back += 1
            self._wall_shift += self._last_end - end
            end = self._last_end
        self._last_end = max(self._last_end, end)
        return self._wall_shift

    def _minute(self, app: str, arrival: float) -> Minute:
        key = (app, arrival - arrival % 60.0)
        m = self._pending.get(key)
        if m is None:
            if len(self._pending) >= MAX_PENDING_MINUTES:
                self._give_up_oldest()
            m = self._pending[key] = Minute(judged=app in self.slos)
        return m

    def _add(self, reqs: Sequence[ServedRequest]) -> None:
        """Add checked requests to their minutes (nothing here can fail half-way)."""
        for r in reqs:
            arrival = r.arrival + self._corrected(r.end)
            self._minute(r.app, arrival).add(r, self.slos.get(r.app))
            if self._raw_on:
                if len(self._raw) == self._raw.maxlen:
                    self.raw_over_cap += 1  # the oldest waiting row gives way to this one (with a cap of 0, this one)
                self._raw.append([r.app, arrival, r.wait, r.exec_s, r.latency, r.batch_size])
            self.recorded += 1

    def _add_shed(self, apps: Sequence[str], arrivals: Sequence[float]) -> None:
        for app, a in zip(apps, arrivals, strict=True):
            self._minute(app, a + self._wall_shift).dropped += 1
            self.shed_count += 1

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
        """Send every pending minute (and raw request) to the agent; True when the agent took them or refused them
        (or there was nothing), False when it is away (what it did not take waits). Minutes go up to
        MINUTES_PER_MESSAGE and MESSAGE_BYTES at a time, raw requests RAW_PER_MESSAGE at a time, in messages of their
        own, so no message passes the protocol's line limit and a refused message gives up no more than itself. A
        message leaves the pending minutes when it is first sent: one the agent did not answer (away, or too slow to
        reply) is sent again as it was, under its `seq`, before anything newer, and requests recorded meanwhile go in
        new messages."""
        self._next_flush = time.monotonic() + self.settings.sdk_flush_interval_s
        if self._in_flight is None and not self._pending and not self._raw and not self.raw_over_cap:
            return True
        if not self._link_ready(force=force):
            return False
        while True:
            if self._in_flight is None:
                self._in_flight = self._next_message()
                if self._in_flight is None:
                    return True
            if not self._deliver(self._in_flight):
                return False
            self._in_flight = None

    def _next_message(self) -> _Message | None:
        """The next message, taken off the pending minutes (or raw requests): None when nothing waits."""
        if self._pending:
            minutes: list[dict[str, Any]] = []
            size = requests = 0
            for (app, minute), m in self._pending.items():
                rec = m.record(app, minute)
                rec_size = json_size(rec)
                if rec_size > MESSAGE_BYTES:  # times over many orders of magnitude in many classes: sent without
                    log.warning("serving: %s's minute %s holds %d bytes of histograms; sent without its batch-size "
                                "classes", app, minute, rec_size)
                    rec["exec_by_batch"] = None
                    rec_size = json_size(rec)
                if minutes and (len(minutes) == MINUTES_PER_MESSAGE or size + rec_size > MESSAGE_BYTES):
                    break
                minutes.append(rec)
                size += rec_size
                requests += m.n + m.dropped
            for rec in minutes:
                del self._pending[(rec["app"], rec["minute"])]
            self._seq += 1
            return _Message(self._message(minutes, [], 0), requests, 0, 0)
        if self._raw or self.raw_over_cap:
            raw = [self._raw.popleft() for _ in range(min(RAW_PER_MESSAGE, len(self._raw)))]
            raw_over, self.raw_over_cap = self.raw_over_cap, 0
            self._seq += 1
            return _Message(self._message([], raw, raw_over), 0, len(raw), raw_over)
        return None

    def _message(self, minutes: list[dict[str, Any]], raw: list[list], raw_over: int) -> dict[str, Any]:
        msg = {"op": p.SERVING, "v": p.VERSION, "workflow": self.workflow_id, "pid": _pid(), "rank": 0,
               "devices": self.devices, "slos": dict(self.slos), "minutes": minutes, "sender": self._sender,
               "seq": self._seq}
        if raw or raw_over:
            msg["raw"], msg["raw_over_cap"] = raw, raw_over
        return msg

    def _deliver(self, m: _Message) -> bool:
        """Send one message: True when the agent took it (or had taken it: a resend it acknowledges as merged
        already) or refused it as invalid (given up and counted), False when it is away or asks to be sent it
        again later."""
        try:
            reply = self._conn.request(m.msg)
        except OSError as exc:
            self._next_connect = time.monotonic() + self.settings.sdk_retry_s
            log.info("serving: the fleetlens agent did not answer a message of %d requests and %d raw requests (%s);"
                     " kept to be sent again", m.requests, m.raw, exc)
            return False
        if reply.get("ok"):
            self.sent += m.requests
            self.raw_sent += m.raw
            return True
        if reply.get("retry"):
            return False
        self._give_up_refused(m, str(reply.get("error")))
        return True

    def _give_up_refused(self, m: _Message, error: str) -> None:
        """A message the agent refused would be refused again: its requests are counted in `lost` and its raw
        requests in `raw_refused`, once, with the agent's reason."""
        self.refused += 1
        self.lost += m.requests
        self.raw_refused += m.raw + m.raw_over
        log.warning("serving: the agent refused %d minutes (%d requests) and %d raw requests: %s; given up "
                    "(%d requests lost so far)", len(m.msg["minutes"]), m.requests, m.raw + m.raw_over, error,
                    self.lost)

    def _give_up_unsent(self) -> None:
        """At close, what no agent took: counted in `lost` (raw requests in `raw_lost`) and logged once."""
        unsent = sum(m.n + m.dropped for m in self._pending.values())
        raw = len(self._raw)
        if self._in_flight is not None:
            unsent += self._in_flight.requests
            raw += self._in_flight.raw + self._in_flight.raw_over
        if unsent or raw:
            self.lost += unsent
            self.raw_lost += raw
            log.warning("serving: closed with %d requests and %d raw requests no agent took: given up (%d requests "
                        "lost in all)", unsent, raw, self.lost)
        self._pending.clear()
        self._raw.clear()
        self._in_flight = None

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
