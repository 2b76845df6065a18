"""Helpers shared by the agent tests: a small in-test device source, waiting, and reading samples back."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable

from sqlalchemy import func, select

from collector.sources.base import DeviceInfo, DeviceReading, ProcessReading
from store.models import DeviceSample, ProcessSample


class StubSource:
    """`n` devices, each showing this test process, with a device that can be made to fall off the bus."""

    name = "cpu"

    def __init__(self, n: int = 2, pids: list[int] | None = None) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.n = n
        self.pids = pids if pids is not None else [os.getpid()]
        self.lost: set[int] = set()
        self.closed = False

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(i, f"stub-{self.tag}-{i}", "stub device", 1 << 30) for i in range(self.n)]

    def sample(self) -> list[DeviceReading]:
        now = time.time()
        return [
            DeviceReading(index=i, ts=now, lost=True) if i in self.lost else
            DeviceReading(index=i, ts=now, gpu_util=0.5, mem_used=1 << 20, mem_total=1 << 30,
                          processes=[ProcessReading(pid=p, cpu_util=0.25, mem_used=4096) for p in self.pids])
            for i in range(self.n)
        ]

    def close(self) -> None:
        self.closed = True


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, every: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")


def count_samples(store, host_id: str | None = None) -> tuple[int, int]:
    with store.session() as s:
        dq = select(func.count()).select_from(DeviceSample)
        pq = select(func.count()).select_from(ProcessSample)
        if host_id is not None:
            from store.models import Device

            dq = dq.join(Device, Device.id == DeviceSample.device_id).where(Device.host_id == host_id)
            pq = pq.where(ProcessSample.host_id == host_id)
        return s.scalar(dq), s.scalar(pq)


def sample_times(store, host_id: str) -> list[float]:
    """The distinct device-sample timestamps stored for `host_id`, sorted."""
    from store.models import Device

    with store.session() as s:
        rows = s.scalars(
            select(DeviceSample.ts).distinct().join(Device, Device.id == DeviceSample.device_id)
            .where(Device.host_id == host_id).order_by(DeviceSample.ts)
        )
        return list(rows)


class Recording:
    """Wraps a real source and remembers the timestamp of every reading it handed the agent."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.ts: set[float] = set()

    def devices(self):
        return self.inner.devices()

    def sample(self):
        readings = self.inner.sample()
        self.ts.update(r.ts for r in readings if not r.lost)
        return readings

    def close(self) -> None:
        self.inner.close()


class TcpProxy:
    """A TCP relay to the database that the test can cut (refusing and dropping connections) and restore."""

    def __init__(self, target_host: str, target_port: int) -> None:
        import socket as _socket

        self.target = (target_host, target_port)
        probe = _socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener = None
        self._open: set = set()
        self._lock = __import__("threading").Lock()

    def start(self) -> TcpProxy:
        import socket as _socket
        import threading

        listener = _socket.socket()
        listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener) -> None:
        import socket as _socket
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = _socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def cut(self) -> None:
        """The database is gone: new connections are refused, open ones are dropped."""
        if self._listener is not None:
            try:
                self._listener.shutdown(2)  # wakes the blocked accept(); close() alone would not on Linux
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(2)
                except OSError:
                    pass
                s.close()
            self._open.clear()

    def restore(self) -> None:
        self.start()

    def url(self, pg_url: str) -> str:
        from sqlalchemy.engine import make_url

        return make_url(pg_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)
