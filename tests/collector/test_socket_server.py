"""The SDK socket server: newline-delimited JSON, one reply per line, persistent connections, clear errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from collector.socket_server import SocketServer, connect
from store.errors import ConfigError


class Echo:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def handle(self, msg: dict) -> dict | None:
        self.seen.append(msg)
        if msg.get("op") == "none":
            return None
        if msg.get("op") == "boom":
            raise RuntimeError("handler broke")
        return {"ok": True, "echo": msg}


def ask(sock, lines: list[bytes]) -> list[dict]:
    sock.sendall(b"".join(lines))
    reader = sock.makefile("rb")
    return [json.loads(reader.readline()) for _ in lines]


@pytest.fixture
def server(tmp_path: Path):
    handler = Echo()
    with SocketServer(tmp_path / "agent.sock", handler) as srv:
        yield srv, handler


def test_one_reply_per_line_on_one_connection(server):
    srv, handler = server
    with connect(srv.path, timeout=5) as sock:
        replies = ask(sock, [json.dumps({"op": "step", "n": i}).encode() + b"\n" for i in range(100)])
    assert [r["echo"]["n"] for r in replies] == list(range(100))
    assert len(handler.seen) == 100


def test_bad_lines_get_an_error_reply_and_the_connection_lives(server):
    srv, _ = server
    with connect(srv.path, timeout=5) as sock:
        replies = ask(sock, [b"{not json\n", b"[1, 2]\n", b'{"op": "boom"}\n', b'{"op": "none"}\n', b'{"op": "x"}\n'])
    assert replies[0]["ok"] is False and "not a JSON line" in replies[0]["error"]
    assert replies[1]["ok"] is False and "JSON object" in replies[1]["error"]
    assert replies[2] == {"ok": False, "error": "RuntimeError: handler broke"}
    assert replies[3] == {"ok": True}
    assert replies[4]["echo"] == {"op": "x"}


def test_many_clients_at_once(server):
    srv, handler = server
    errors = []

    def client(k: int) -> None:
        try:
            with connect(srv.path, timeout=5) as sock:
                replies = ask(sock, [json.dumps({"k": k, "n": i}).encode() + b"\n" for i in range(50)])
                assert [(r["echo"]["k"], r["echo"]["n"]) for r in replies] == [(k, i) for i in range(50)]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(handler.seen) == 400


def test_jobs_connecting_together_wait_their_turn_rather_than_being_refused(tmp_path: Path):
    handler = Echo()
    srv = SocketServer(tmp_path / "agent.sock", handler).start()
    srv._server.shutdown()  # the accept loop is held up: every connection waits in the listen queue
    socks = []
    try:
        for _ in range(32):  # a host's jobs and their ranks starting at once
            socks.append(connect(srv.path, timeout=5))  # not refused: the SDK would take that for "no agent"
        served = threading.Thread(target=srv._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        served.start()
        for k, sock in enumerate(socks):
            assert ask(sock, [json.dumps({"k": k}).encode() + b"\n"])[0]["echo"] == {"k": k}
    finally:
        for sock in socks:
            sock.close()
        srv.stop()
    assert len(handler.seen) == 32


def test_stale_socket_is_replaced_and_a_live_one_is_refused(tmp_path: Path):
    path = tmp_path / "agent.sock"
    first = SocketServer(path, Echo()).start()
    with pytest.raises(ConfigError, match="another agent is already serving"):
        SocketServer(path, Echo()).start()
    first._server.server_close()  # die without cleaning up: the file stays, nobody listens
    first._server.shutdown()
    assert path.exists()
    with SocketServer(path, Echo()) as again, connect(path, timeout=5) as sock:
        assert ask(sock, [b'{"op": "x"}\n'])[0]["ok"] is True
        assert again.path == path
    assert not path.exists()  # a clean stop removes the socket file


def test_stop_ends_open_connections(tmp_path: Path):
    srv = SocketServer(tmp_path / "agent.sock", Echo()).start()
    sock = connect(srv.path, timeout=5)
    ask(sock, [b'{"op": "x"}\n'])
    srv.stop()
    assert sock.recv(1) == b""  # the server closed its end
    sock.close()


def test_paths_longer_than_sun_path(tmp_path: Path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    with SocketServer(deep / "agent.sock", Echo()) as srv, connect(srv.path, timeout=5) as sock:
        assert len(str(srv.path)) > 108
        assert ask(sock, [b'{"op": "long"}\n'])[0]["echo"] == {"op": "long"}


def test_an_endless_line_is_refused_not_buffered(server, monkeypatch):
    import collector.socket_server as mod

    monkeypatch.setattr(mod, "MAX_LINE", 1000)
    srv, handler = server
    with connect(srv.path, timeout=5) as sock:
        sock.sendall(b'{"op": "' + b"x" * 5000)
        reply = json.loads(sock.makefile("rb").readline())
    assert reply["ok"] is False and "over 1000 bytes" in reply["error"]
    assert handler.seen == []
