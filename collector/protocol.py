"""The job SDK <-> agent protocol: newline-delimited JSON over the agent's unix socket, one reply per request.

Every request is one JSON object on one line with an `op` (below), the protocol version `v`, and who sent it:
`workflow`, `pid`, `rank`. Every reply is one JSON object on one line with `ok` (bool) and, when `ok` is
false, an `error` string; `retry: true` says the agent could not store the message right now (database down)
and the job should send it again later.

Requests and what their replies carry:

- `hello`  {name, total_steps, start_step, lane, id_source}: the job started. Reply: like `poll`.
- `steps`  {batches: [StepBatch...]}: step-time summaries; also a poll. Reply: like `poll`. A batch that ends at or
  below a step the agent already took from the same process (a resend after a late reply) is not taken again.
- `poll`   {}: anything for me? Reply: optional `profile` {request_id, steps, trace_dir} and optional
  `checkpoint` {request_id, directory}.
- `profile_done`   {request_id, path, steps, size_bytes, first_step}: a trace was written.
- `profile_failed` {request_id, error}.
- `checkpoint_done`   {request_id, path, step}: the job saved a checkpoint; `step` is the next step to run.
- `checkpoint_failed` {request_id, error}.
- `gate`   {lane, step, phase: "begin"|"end"|"renew", again}: the per-step lane gate; the agent answers `begin`
  when it is this job's turn (`granted: true`, and the gate's `lease_s`). `renew` keeps a long step's turn while
  its kernels run; `end` with `again: false` gives the turn up for good (the job left its loop). Outside a lane
  the job never sends it.
- `bye`    {outcome: "finished"|"failed"|"stopped", last_step}: the job is leaving.
- `serving` {minutes: [minute records], devices, slos}: a serving loop's per-application per-minute request
  histograms (collector.serving; store.serving describes a record). Reply: ok, or an error naming the bad record.

A StepBatch is {first_step, last_step, n_steps, ts_start, ts_end, mean_s, p50_s, p95_s, max_s,
mem_persistent, mem_peak, mem_source, mem_reserved}: memory in bytes (None when unknown), mem_source "cuda" or
"rss"; mem_reserved the CUDA caching allocator's reserved bytes at the batch's end (the agent pairs it with NVML's
figure for the process to measure the memory outside the allocator).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from collector import socket_server
from store.errors import InvalidInput

VERSION = 1
MAX_LINE = 4 * 1024 * 1024  # a request longer than this is refused rather than buffered without bound

HELLO = "hello"
STEPS = "steps"
POLL = "poll"
PROFILE_DONE = "profile_done"
PROFILE_FAILED = "profile_failed"
CHECKPOINT_DONE = "checkpoint_done"
CHECKPOINT_FAILED = "checkpoint_failed"
GATE = "gate"
BYE = "bye"
SERVING = "serving"

# fields every request of an op must carry, on top of op / workflow / pid
REQUIRED: dict[str, tuple[str, ...]] = {
    HELLO: (),
    STEPS: ("batches",),
    POLL: (),
    PROFILE_DONE: ("request_id", "path"),
    PROFILE_FAILED: ("request_id", "error"),
    CHECKPOINT_DONE: ("request_id", "path", "step"),
    CHECKPOINT_FAILED: ("request_id", "error"),
    GATE: ("lane", "step", "phase"),
    BYE: ("outcome",),
    SERVING: ("minutes",),
}
OPS = frozenset(REQUIRED)
BATCH_FIELDS = (
    "first_step", "last_step", "n_steps", "ts_start", "ts_end", "mean_s", "p50_s", "p95_s", "max_s",
)
# the step counts are stored as 32-bit integers, and a workflow id in 512 characters (store.models): what the database
# would refuse is refused here, to the job that sent it, rather than given up at the write
STEP_COUNT_FIELDS = ("first_step", "last_step", "n_steps")
STEP_COUNT_MAX = 2**31 - 1
WORKFLOW_ID_MAX = 512


class ProtocolError(InvalidInput):
    """A line on the agent socket that is not a valid request or reply."""


def encode(message: dict[str, Any]) -> bytes:
    """One message as one line of compact JSON (NaN refused: the other end may not be Python)."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def decode(line: bytes | str) -> dict[str, Any]:
    """One line back into a message; anything but a JSON object raises ProtocolError."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes is over the {MAX_LINE}-byte limit")
    try:
        message = socket_server.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"message is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"message is a JSON {type(message).__name__}, not an object")
    return message


def _step_count(value: int | float) -> bool:
    """A whole number the store's step columns hold (a float with no fraction too: the SDK may send 5.0)."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return whole and 0 <= value <= STEP_COUNT_MAX


def check_request(message: dict[str, Any]) -> str:
    """The request's op, after checking it names a known op and carries that op's fields."""
    op = message.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; this agent speaks {', '.join(sorted(OPS))}")
    version = message.get("v", VERSION)
    if version != VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {VERSION}; update fleetlens on one side")
    missing = [f for f in ("workflow", "pid", *REQUIRED[op]) if message.get(f) is None]
    if missing:
        raise ProtocolError(f"{op} request is missing {', '.join(missing)}")
    if not isinstance(message["workflow"], str) or not message["workflow"]:
        raise ProtocolError("workflow must be a non-empty string")
    if len(message["workflow"]) > WORKFLOW_ID_MAX:
        raise ProtocolError(f"workflow id of {len(message['workflow'])} characters is over the {WORKFLOW_ID_MAX}-"
                            "character limit (FLEETLENS_WORKFLOW)")
    if op == STEPS:
        batches = message["batches"]
        if not isinstance(batches, list):
            raise ProtocolError("steps.batches must be a list")
        for batch in batches:
            if not isinstance(batch, dict) or any(batch.get(f) is None for f in BATCH_FIELDS):
                raise ProtocolError(f"each steps batch needs {', '.join(BATCH_FIELDS)}")
            # a value the database refuses would make it refuse the step rows of every job queued with it
            wrong = [f for f in BATCH_FIELDS if isinstance(batch[f], bool) or not isinstance(batch[f], int | float)]
            if wrong:
                raise ProtocolError(f"steps batch fields {', '.join(wrong)} must be numbers")
            counts = [f for f in STEP_COUNT_FIELDS if not _step_count(batch[f])]
            if counts:
                raise ProtocolError(f"steps batch fields {', '.join(counts)} must be whole numbers from 0 to "
                                    f"{STEP_COUNT_MAX}, got {', '.join(repr(batch[f]) for f in counts)}")
    if op == SERVING and not isinstance(message["minutes"], list):
        raise ProtocolError("serving.minutes must be a list")
    return op


def error_reply(error: str, *, retry: bool = False) -> dict[str, Any]:
    reply: dict[str, Any] = {"ok": False, "error": error}
    if retry:
        reply["retry"] = True
    return reply


class AgentConnection:
    """A blocking client for the agent socket: one request, one reply, on one kept-open connection.

    Any failure (no agent, agent gone, timeout, garbled reply) closes the connection and raises OSError,
    so callers need to handle one exception type; the next `request` connects again.
    """

    def __init__(self, path: str | Path, timeout_s: float = 5.0) -> None:
        self.path = str(path)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buffer = b""

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> None:
        if self._sock is not None:
            return
        # socket_server.connect knows how to reach a socket path longer than sun_path
        self._sock, self._buffer = socket_server.connect(self.path, timeout=self.timeout_s), b""

    def request(self, message: dict[str, Any], *, wait_forever: bool = False) -> dict[str, Any]:
        """Send one request and wait for its reply; `wait_forever` waits without a timeout (the lane gate)."""
        self.connect()
        assert self._sock is not None
        try:
            self._sock.settimeout(None if wait_forever else self.timeout_s)
            self._sock.sendall(encode(message))
            while b"\n" not in self._buffer:
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("the agent closed the connection")
                self._buffer += chunk
                if len(self._buffer) > MAX_LINE:
                    raise ProtocolError("reply over the size limit")
            line, self._buffer = self._buffer.split(b"\n", 1)
            return decode(line)
        except (OSError, ProtocolError) as exc:
            self.close()
            if isinstance(exc, OSError):
                raise
            raise ConnectionError(str(exc)) from None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock, self._buffer = None, b""
