"""The agent's local unix-socket server for the job SDK: newline-delimited JSON, one reply line per request line.

Connections are persistent and each is served by its own thread, so a job's per-step round trip is one
`sendall` and one `readline` on each side; the handler must answer from memory (no database work here).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any, Protocol

from store.errors import ConfigError

log = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL
_MAX_PATH = 107
# a request longer than this is refused rather than buffered without bound (collector.protocol agrees)
MAX_LINE = 4 * 1024 * 1024


class MessageHandler(Protocol):
    def handle(self, msg: dict[str, Any]) -> dict[str, Any] | None: ...


class _DirRef:
    """A path short enough for sockaddr_un: the real path, or /proc/self/fd/N/name through an open folder."""

    def __init__(self, path: Path) -> None:
        self._fd: int | None = None
        raw = os.fsencode(path)
        if len(raw) <= _MAX_PATH:
            self.address = str(path)
            return
        self._fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        self.address = f"/proc/self/fd/{self._fd}/{path.name}"
        if len(os.fsencode(self.address)) > _MAX_PATH:
            self.close()
            raise ConfigError(f"the socket name {path.name!r} is too long for a unix socket")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def connect(path: Path | str, timeout: float | None = None) -> socket.socket:
    """A client connection to the agent's socket at `path` (works for paths longer than sun_path allows)."""
    ref = _DirRef(Path(path))
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(ref.address)
        except OSError:
            sock.close()
            raise
        return sock
    finally:
        ref.close()


class _Connection(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        self.server.track(sock, True)
        reader = sock.makefile("rb", buffering=65536)
        handler = self.server.message_handler
        try:
            while line := reader.readline(MAX_LINE + 1):
                if len(line) > MAX_LINE and not line.endswith(b"\n"):
                    # the rest of this line would be read as requests: answer once and hang up
                    sock.sendall(_encode({"ok": False, "error": f"a request line is over {MAX_LINE} bytes"}))
                    break
                if not line.strip():
                    continue
                sock.sendall(_reply(handler, line))
        except OSError:
            pass  # the job went away mid-reply, or the agent is shutting down
        finally:
            reader.close()
            self.server.track(sock, False)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a number, or leave the field out")


def loads(line: bytes | str) -> Any:
    """One line of JSON, refusing NaN and Infinity: Python's json reads them, but they are no JSON, and a step summary
    holding one made the agent's database write refuse every job's summaries queued with it."""
    return json.loads(line, parse_constant=_no_constant)


def _reply(handler: MessageHandler, line: bytes) -> bytes:
    try:
        msg = loads(line)
    except ValueError as exc:
        return _encode({"ok": False, "error": f"not a JSON line: {exc}"})
    if not isinstance(msg, dict):
        return _encode({"ok": False, "error": "each line must be a JSON object"})
    try:
        reply = handler.handle(msg)
    except Exception as exc:  # one bad message must not end the job's connection
        log.exception("SDK message %r failed", msg.get("type") or msg.get("op"))
        return _encode({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return _encode({"ok": True} if reply is None else reply)


def _encode(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply, separators=(",", ":"), default=str).encode() + b"\n"


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False
    # socketserver listens with a backlog of 5, and a unix socket refuses a connect past it at once (EAGAIN), which
    # the SDK takes for "no agent" until its next try: every job and rank starting together must find a place
    request_queue_size = socket.SOMAXCONN

    def __init__(self, address: str, handler: MessageHandler) -> None:
        self.message_handler = handler
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Connection)

    def track(self, sock: socket.socket, add: bool) -> None:
        with self._open_lock:
            (self._open.add if add else self._open.discard)(sock)

    def close_connections(self) -> None:
        with self._open_lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class SocketServer:
    """Serves `handler` on the unix socket at `path` from a background thread until `stop()`."""

    def __init__(self, path: Path | str, handler: MessageHandler, *, mode: int = 0o660) -> None:
        self.path = Path(path)
        self.handler = handler
        self.mode = mode
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> SocketServer:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        ref = _DirRef(self.path)
        try:
            self._server = _Server(ref.address, self.handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on the agent socket {self.path} ({exc.strerror or exc})") from None
        finally:
            ref.close()
        os.chmod(self.path, self.mode)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, name="fleetlens-sdk-socket", daemon=True
        )
        self._thread.start()
        log.info("serving the job SDK on %s", self.path)
        return self

    def _remove_stale(self) -> None:
        """A socket file left by a dead agent is removed; one a live agent answers on is an error."""
        if not self.path.exists() and not self.path.is_symlink():
            return
        try:
            probe = connect(self.path, timeout=1.0)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
                self.path.unlink(missing_ok=True)
                return
            raise ConfigError(f"the agent socket {self.path} exists and cannot be checked ({exc})") from None
        probe.close()
        raise ConfigError(
            f"another agent is already serving on {self.path}; stop it, or give this one its own FLEETLENS_HOME"
        )

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)
        self._server = None

    def __enter__(self) -> SocketServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
