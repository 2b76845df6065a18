"""The per-host agent: samples its devices, attributes processes to workflows, batches writes, spools through
database outages, runs the signed commands addressed to its host, and serves the job SDK on a unix socket.

Three threads keep each concern on time whatever the others do: the sampler reads the source every
interval into memory; the flusher writes a batch every flush interval (or spools it when the database
is away); the commander polls and runs commands. A database that hangs can therefore never stall sampling.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from collector.agent_batch import (
    AgentStats,
    Batch,
    KnownProcess,
    device_row,
    finite,
    process_metrics,
    sample_rows,
)
from collector.agent_hooks import install_job_hooks, make_sdk_handlers
from collector.agent_procs import Attribute, ProcessCache
from collector.agent_store import (
    batch_device_ids,
    record_host,
    register_new_devices,
    retire_unlisted,
    touch_new_workflows,
)
from collector.command_runner import CommandRunner, Outcome
from collector.job_fence import Fencer
from collector.job_reaper import REAPER, ReaperHost
from collector.metrics import serve_agent_metrics
from collector.mps import MpsSupervisor
from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer
from collector.sources.base import DeviceReading, DeviceSource
from collector.spool import Spool
from enforcer.gate import LaneGate
from store.db import Store
from store.errors import DatabaseBusy, DatabaseUnavailable
from store.ingest import write_samples, write_samples_once
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
STOP_THREADS_S = 8.0  # after SIGTERM/SIGINT the threads get this long; the last flush follows (all within 15 s)


class Agent:
    """One host's collector. `run()` blocks until SIGTERM/SIGINT (or `duration`); `start()`/`stop()` for tests."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        source: DeviceSource,
        *,
        host_id: str | None = None,
        sample_interval_s: float | None = None,
        flush_interval_s: float | None = None,
        command_interval_s: float | None = None,
        spool: Spool | None = None,
        sdk_handler: Any = None,
        serve_socket: bool = True,
        attribute: Attribute | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.source = source
        self.host_id = host_id or settings.host_id
        self.sample_interval_s = sample_interval_s or settings.sample_interval_s
        self.flush_interval_s = flush_interval_s or settings.flush_interval_s
        self.command_interval_s = command_interval_s or max(self.sample_interval_s, 0.2)
        if self.sample_interval_s <= 0 or self.flush_interval_s <= 0:
            raise ValueError("the sample and flush intervals must be positive seconds")
        settings.ensure_home()
        # the spool given, even empty (an empty Spool is falsy: `spool or ...` put another folder's in its place)
        self.spool = (spool if spool is not None else
                      Spool(settings.spool_dir / _safe(self.host_id), settings.spool_max_bytes))
        # the SDK socket's handlers and the lane gate behind them, built here and handed to who uses them
        self.gate: LaneGate | None = None
        self.stats = AgentStats()
        if sdk_handler is None and serve_socket:
            sdk_handler, self.gate = make_sdk_handlers(store, self.host_id, settings, self.stats)
        elif isinstance(sdk_handler, SdkHandlers):
            sdk_handler.stats = self.stats  # what the database refuses of its rows is counted with the agent's
        self.runner = CommandRunner(store, settings, self.host_id, agent=self,
                                    sdk=sdk_handler if isinstance(sdk_handler, SdkHandlers) else None, gate=self.gate)
        self.fencer = Fencer(store, self.host_id, self.gate)  # stops stale copies of jobs placed elsewhere
        self._serve_socket = serve_socket
        self._sdk_handler = sdk_handler
        self._socket_server = None
        self._batch = Batch()
        self._batch_lock = threading.Lock()
        self._procs = ProcessCache(self.host_id, attribute)  # each process's workflow, by pid (collector.agent_procs)
        self._lost: set[int] = set()
        self._device_ids: dict[int, int] = {}
        self._registered_uuids: dict[int, str] = {}  # device index -> the UUID registered for it
        self._registered = False
        self._known_workflows: set[str] = set()  # workflows this agent has created or found in the store
        self._recorded: frozenset[tuple[int, float]] | None = None  # processes the store last heard of
        self._db_up: bool | None = None
        self._db_lock = threading.Lock()  # one flush at a time (the final flush races the flusher otherwise)
        self._stop = threading.Event()
        self.stop_signal: int | None = None  # the signal that stopped run(), if one did
        self._threads: list[threading.Thread] = []
        self._started = False
        self.latest: list[DeviceReading] = []  # the last round's readings, for /metrics
        self._metrics_server: Any = None
        self.metrics_port: int | None = None  # the port /metrics is served on (settings.metrics_port, 0: any free)
        self.mps: MpsSupervisor | None = None
        if settings.mps:
            self.mps = MpsSupervisor(settings.mps_binary, settings.mps_pipe_dir, settings.mps_log_dir,
                                     store=store, host_id=self.host_id, exclusive=settings.mps_exclusive)

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> Agent:
        if self._started:
            return self
        self._started = True
        self._try_register()
        if self._serve_socket:
            self._start_socket()
        self._install_enforcer_hooks()
        if self.settings.metrics_port is not None:
            self._metrics_server, _ = serve_agent_metrics(self, self.settings.metrics_port,
                                                          addr=self.settings.metrics_host)
            self.metrics_port = self._metrics_server.server_address[1]
            log.info("agent %s serves /metrics on port %d", self.host_id, self.metrics_port)
        loops: list[tuple[str, Callable[[], None]]] = [
            ("sampler", self._sample_loop), ("flusher", self._flush_loop), ("commander", self._command_loop)]
        if self.mps is not None:
            mps = self.mps
            loops.append(("mps", lambda: mps.run(self._stop, self.settings.mps_check_interval_s)))
        for name, target in loops:
            thread = threading.Thread(target=target, name=f"fleetlens-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("agent %s sampling %s every %.3g s, writing every %.3g s", self.host_id, self.source.name,
                 self.sample_interval_s, self.flush_interval_s)
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop sampling, write (or spool) what is buffered, and release the socket and the source.

        The jobs the agent launched go on: they live in sessions of their own, and the next agent on this host
        takes them up again (collector.job_reaper adopts them). With `timeout_s`, the threads get that
        long in all to finish what they are doing (a command half-run is re-sent by the enforcer); they are
        daemons, so one still busy does not keep the process alive."""
        self._stop.set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            wait = max(30.0, 3 * self.flush_interval_s) if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(timeout=wait)
        self._threads.clear()
        # the reaper's thread ends with the last agent of the process (many virtual hosts share one process in
        # benchmarks/agents_load.py), and is waited for then
        REAPER.join_if_idle(30.0 if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._socket_server is not None:
            self._socket_server.stop()
            self._socket_server = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if self._started:
            try:
                self.flush()
                self.flush_sdk()
            except Exception:  # the batch is spooled (see flush); stopping must still release everything
                log.exception("the last flush failed")
        close = getattr(self._sdk_handler, "close", None)
        if callable(close):
            close()
        self.source.close()
        self._started = False
        log.info("agent %s stopped (%d rounds, %d batches spooled, %d resent)", self.host_id, self.stats.rounds,
                 self.stats.batches_spooled, self.stats.batches_resent)

    @property
    def sdk_handler(self) -> Any:
        """The object answering the job SDK (collector.sdk_handlers.SdkHandlers unless one was given), or None."""
        return self._sdk_handler

    def request_stop(self, signum: int | None = None, _frame: object = None) -> None:
        """Ask `run()` to stop (also the SIGTERM/SIGINT handler: the first signal is kept in `stop_signal`)."""
        if signum is not None and self.stop_signal is None:
            self.stop_signal = int(signum)
        self._stop.set()

    def run(self, duration: float | None = None) -> AgentStats:
        """Run until SIGTERM/SIGINT or `duration` seconds, then stop cleanly (the last batch is flushed).

        The handlers replace an inherited SIG_IGN too (an agent started in the background by a script)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self.request_stop)
        try:
            self.start()
            self._stop.wait(timeout=duration)
        finally:
            self.stop(timeout_s=STOP_THREADS_S)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.stats

    def run_once(self) -> AgentStats:
        """One sample, one write, the pending commands: what `fleetlens agent --once` does."""
        self._try_register()
        self.sample_once()
        self.flush()
        self.poll_commands()
        self.source.close()
        return self.stats

    # ---- registration ----------------------------------------------------------------------------------

    def _try_register(self) -> bool:
        if self._registered:
            return True
        try:
            specs = [DeviceSpec(d.index, d.uuid, d.name, d.memory_total, d.cpu_cores) for d in self.source.devices()]
            with self.store.session() as session:
                register_host(session, self.host_id, hostname=socket.gethostname(), source=self.source.name,
                              agent_version=AGENT_VERSION, agent_pid=os.getpid())
                self._device_ids = register_devices(session, self.host_id, specs, source=self.source.name,
                                                    moved_here=True)
                # what the source listed before and no longer does (MIG turned on or off since) is no device now
                retire_unlisted(session, self.host_id, self.source, {s.index for s in specs}, self._device_ids)
            self._registered_uuids = {spec.index: spec.uuid for spec in specs}
            self.runner.recover()
        except DatabaseUnavailable as exc:
            self._db_down(exc)
            return False
        self._registered = True
        self._db_back()
        log.info("host %s registered with %d devices", self.host_id, len(self._device_ids))
        return True

    def _db_down(self, exc: BaseException) -> None:
        if isinstance(exc, DatabaseBusy):  # the server is up; another writer held rows this write needed
            self.stats.busy_writes += 1
            log.info("a write of host %s waited on another writer's locks and was rolled back; kept for the next "
                     "flush: %s", self.host_id, exc)
            return
        if self._db_up is not False:
            log.warning("database unavailable, spooling samples to %s: %s", self.spool.directory, exc)
        self._db_up = False
        self.fencer.outage()  # a move may have ended meanwhile with a job of ours placed elsewhere: fence first

    def _db_back(self) -> None:
        if self._db_up is False:
            log.warning("database reachable again; sending %d spooled batches", len(self.spool))
        self._db_up = True

    # ---- sampling --------------------------------------------------------------------------------------

    def _sample_loop(self) -> None:
        start = time.monotonic()
        tick = 0
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # a source must not raise, but one that does must not end the agent
                self.stats.sample_errors += 1
                log.exception("sampling %s failed", self.source.name)
            tick += 1
            next_at = start + tick * self.sample_interval_s
            now = time.monotonic()
            if next_at < now:  # overran (a slow source): skip the missed ticks rather than burst
                tick = int((now - start) / self.sample_interval_s) + 1
                next_at = start + tick * self.sample_interval_s
            self._stop.wait(next_at - now)

    def sample_once(self) -> int:
        """Read every device once into the current batch; returns the number of device readings."""
        readings = self.source.sample()
        now = time.time()
        device_rows: list[list[Any]] = []
        process_rows: list[list[Any]] = []
        seen: dict[int, KnownProcess] = {}
        lost: set[int] = set()
        found: set[int] = set()
        nonfinite = 0
        for reading in readings:
            if reading.lost:
                if reading.index not in self._lost:
                    log.warning("device %d of host %s is lost (fell off the bus)", reading.index, self.host_id)
                    self._lost.add(reading.index)
                    lost.add(reading.index)
                continue
            if reading.index in self._lost:
                self._lost.discard(reading.index)
                found.add(reading.index)
            elif self._registered and reading.index not in self._device_ids:
                found.add(reading.index)  # a device the source opened since (a MIG instance made): register it
            row, bad = device_row(reading)
            device_rows.append(row)
            nonfinite += bad
            for p in reading.processes:
                proc = self._procs.lookup(p, now)
                if proc is None:
                    continue
                seen[proc.pid] = proc
                metrics, bad = finite(process_metrics(p))
                process_rows.append([reading.index, proc.workflow_id, p.pid, reading.ts, *metrics])
                nonfinite += bad
        if nonfinite:
            if not self.stats.nonfinite_values:
                log.warning("%s reported %d NaN or infinite metric values on host %s; stored as not reported (the "
                            "agent's nonfinite_values counts them)", self.source.name, nonfinite, self.host_id)
            self.stats.nonfinite_values += nonfinite
        self.latest = readings
        self._procs.note_listed(seen, self.stats.rounds)
        if isinstance(self._sdk_handler, SdkHandlers):  # NVML's half of each process's context measurement
            self._sdk_handler.note_process_memory(
                [(p.pid, p.mem_used, r.ts) for r in readings if not r.lost for p in r.processes])
        with self._batch_lock:
            batch = self._batch
            batch.devices.extend(device_rows)
            batch.processes.extend(process_rows)
            batch.seen.update(seen)
            for proc in seen.values():
                batch.workflows[proc.workflow_id] = proc.id_source
            batch.lost |= lost
            batch.found |= found
        self.stats.rounds += 1
        self.stats.device_rows += len(device_rows)
        self.stats.process_rows += len(process_rows)
        return len(readings)

    # ---- writing ---------------------------------------------------------------------------------------

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
                self.flush_sdk()
            except Exception:
                log.exception("flush failed")

    def flush(self) -> bool:
        """Write the current batch (after any spooled ones), or spool it; True when the database took it."""
        with self._batch_lock:
            batch, self._batch = self._batch, Batch()
        with self._db_lock:
            self.stats.flushes += 1
            payload = batch.to_json(self.host_id, self._uuids()) if batch.rows else None
            try:
                if not self._try_register():
                    raise DatabaseUnavailable("not registered yet")
                register_new_devices(self.store, self.host_id, self.source, batch.found, self._device_ids,
                                     self._registered_uuids)
                self.stats.batches_resent += self.spool.drain(self._resend, on_poison=self._poisoned)
                if payload is not None:
                    t0 = time.perf_counter()
                    self._send(payload)
                    self.stats.write_s.append(time.perf_counter() - t0)
                    payload = None  # written: from here on a failure must not spool it a second time
                    self.stats.batches_written += 1
                try:
                    self._recorded = record_host(self.store, self.host_id, batch, self.source, self._device_ids,
                                                 self._recorded)
                except DatabaseUnavailable:
                    raise
                except Exception:  # bookkeeping only: the samples are in; log it and reconcile next time
                    self._recorded = None
                    self._carry_devices(batch)
                    log.exception("recording host %s's processes failed", self.host_id)
            except DatabaseUnavailable as exc:
                self._db_down(exc)
                if payload is not None and self.spool.put(payload, batch.rows) is not None:
                    self.stats.batches_spooled += 1  # (one the spool could not take, it counted as dropped)
                self._carry_devices(batch)
                return False
            except Exception:
                # not an outage: keep the batch on disk (a batch that fails again is set aside by the
                # spool's drain) rather than lose it, and let the loop log what went wrong
                if payload is not None and self.spool.put(payload, batch.rows) is not None:
                    self.stats.batches_spooled += 1
                self._carry_devices(batch)
                raise
            self._db_back()
            return True

    def _carry_devices(self, batch: Batch) -> None:
        """The devices lost or back in a batch whose flush did not record them are marked at the next flush that
        does (a device is reported lost once, so a mark dropped here would never be made)."""
        with self._batch_lock:
            self._batch.lost |= batch.lost
            self._batch.found |= batch.found

    def _poisoned(self, batch: dict[str, Any], exc: BaseException) -> None:
        log.error("a spooled batch of host %s cannot be written and is set aside: %s", self.host_id, exc)

    def _resend(self, payload: dict[str, Any]) -> None:
        """Write a spooled batch, which may be in the store already (written, then the agent died before the spool
        forgot it, or the commit's answer was lost): what the store holds of it is not written twice."""
        self._send(payload, once=True)

    def _uuids(self) -> dict[int, str]:
        """{device index: UUID} as the source numbers its devices now."""
        return {d.index: d.uuid for d in self.source.devices()}

    def _send(self, payload: dict[str, Any], *, once: bool = False) -> None:
        """Write one batch (fresh or spooled) in one transaction; `once`: leave out the rows the store holds."""
        host_id = payload["host_id"]
        ids = batch_device_ids(self.store, payload, self.host_id, self._device_ids, self._uuids)
        touch_new_workflows(self.store, payload["workflows"], self._known_workflows)
        device_rows, process_rows, dropped = sample_rows(payload, ids)
        if dropped:
            self.stats.rows_dropped += dropped
            log.error("%d sample rows name devices host %s never registered; dropped", dropped, host_id)
        (write_samples_once if once else write_samples)(self.store, device_rows, process_rows)

    def flush_sdk(self) -> None:
        """Write the step statistics the jobs reported over the socket (an outage leaves them buffered)."""
        flush = getattr(self._sdk_handler, "flush", None)
        if callable(flush):
            try:
                flush()
            except DatabaseUnavailable as exc:
                self._db_down(exc)

    # ---- commands --------------------------------------------------------------------------------------

    def _command_loop(self) -> None:
        while not self._stop.wait(self.command_interval_s):
            try:  # with the database away too: a start it never took must not outlive its relaunch
                self.stats.fenced.extend(self.fencer.lapsed(self.runner))
            except Exception:
                log.exception("fencing the unreported starts on %s failed", self.host_id)
            if self._db_up is False:
                continue  # the flusher finds out when it is back; no need to hammer a dead server from here
            try:
                self.poll_commands()
            except Exception:
                log.exception("running commands failed")

    def poll_commands(self) -> list[Outcome]:
        """Fence when due (collector.job_fence: at the first round, after an outage, every FENCE_EVERY_S), then run
        the pending commands. The same thread does both, so no relaunch runs here while a fence decides."""
        try:
            self._fence()
            outcomes = self.runner.poll()
        except DatabaseUnavailable as exc:
            self._db_down(exc)
            return []
        self.stats.commands.extend(outcomes)
        return outcomes

    def _fence(self) -> None:
        try:
            self.stats.fenced.extend(self.fencer.maybe())
        except DatabaseUnavailable:
            raise
        except Exception:  # fencing must not keep the commands from running
            log.exception("fencing the managed jobs on %s failed", self.host_id)

    def _install_enforcer_hooks(self) -> None:
        """The enforcer's command kinds (launch, checkpoint, stop, relaunch), the job reaper (it takes up the jobs an
        earlier agent started here), and the storage prober (a thread of this agent's: it stops with the agent)."""
        jobs = self._sdk_handler if isinstance(self._sdk_handler, SdkHandlers) else None
        self._threads.extend(install_job_hooks(ReaperHost(self.store, self.settings, jobs, self.gate, self.flush_sdk),
                                               self.host_id, self._stop))

    # ---- job SDK socket --------------------------------------------------------------------------------

    def _start_socket(self) -> None:
        self._socket_server = SocketServer(self.settings.socket_path, self._sdk_handler).start()


def _safe(host_id: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in host_id)
