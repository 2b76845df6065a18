"""Incremental decode of a Kineto JSON trace: the traceEvents array in batches of whole events, nothing more held.

The decompressed text is read a block at a time; each block is cut after the last `},{` that separates two
top-level events and the part before the cut is decoded by orjson as one JSON array. A cut inside a string or a
nested object can never decode (its brackets or quotes do not balance), so a successful decode is a correct cut,
whatever the layout (pretty-printed over many lines, or one line). When that cut does not decode (a `},{` in a
label holding JSON, or in a list of objects), the trace's blocks are from then on cut where the braces outside
strings close an event (_event_end, on whole NumPy arrays); text up to such an end that does not decode is not
JSON there, and is reported so. Measured on this machine against ijson 3.6's
yajl2_c backend (`ijson.items(fh, "traceEvents.item")`) on the shared 16-rank A100 trace (25.8 MB of text, best of
five each): 0.34 s with 1 MiB blocks against 0.38 s for ijson and 0.52 s for orjson over the whole text; so no new
dependency. Memory: one block of text and the objects of one batch, bounded by `block_bytes`, not by the trace.

A file that ends early, or stops being JSON, raises TraceCut, saying how far the read got; the batches
yielded before it stay good.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
CUT = re.compile(rb"\}\s*,\s*\{")
RAW_BLOCK = 1 << 20  # compressed bytes read at a time
QUOTE, BACKSLASH, OPEN, CLOSE = b'"'[0], b"\\"[0], b"{"[0], b"}"[0]


class TraceCut(Exception):  # noqa: N818  (a condition of the file, turned into InvalidTrace by the caller)
    """The text ends early or stops being JSON; `events` whole events and `text_bytes` bytes were read."""

    def __init__(self, problem: str, events: int, text_bytes: int) -> None:
        self.problem, self.events, self.text_bytes = problem, events, text_bytes
        super().__init__(problem)


class NotKineto(Exception):  # noqa: N818
    """Whole JSON, but not a Kineto trace (no traceEvents array, or not an object)."""


def _text_blocks(path: Path, block_bytes: int, on_raw: Callable[[int], None] | None) -> Iterator[bytes]:
    """The file's JSON text in blocks of about block_bytes; gzip (also several members) decoded on the way.
    Zero bytes after a member are padding (skipped, as the gzip module does). Raises TraceCut when the compressed
    stream ends early or is not gzip, after the text before it."""
    with path.open("rb") as fh:
        if not path.name.endswith(".gz"):
            while block := fh.read(block_bytes):
                if on_raw:
                    on_raw(len(block))
                yield block
            return
        dec, fed, pending, ended = zlib.decompressobj(wbits=31), False, b"", False
        while raw := fh.read(RAW_BLOCK):
            if on_raw:
                on_raw(len(raw))
            while raw:
                if ended and not fed:  # zero bytes may pad a gzip file after a member, as gzip.open reads it
                    raw = raw.lstrip(b"\0")
                    if not raw:
                        break
                try:
                    pending += dec.decompress(raw, block_bytes)
                except zlib.error as exc:
                    if pending:
                        yield pending
                    raise TraceCut(f"is not valid gzip ({exc})", 0, 0) from None
                fed, raw = True, dec.unconsumed_tail
                if dec.eof:  # a further gzip member may follow
                    raw = dec.unused_data + raw
                    dec, fed, ended = zlib.decompressobj(wbits=31), False, True
                if len(pending) >= block_bytes:
                    yield pending
                    pending = b""
        if pending:
            yield pending
        if fed and not dec.eof:
            raise TraceCut("is truncated: the gzip stream ends early (copy it again)", 0, 0)


def _not_json(msg: str, at: int) -> str:
    """The problem of text that stops being JSON at byte `at`, in orjson's words; a lone surrogate escape named as
    such (the standard library's json, and so HTA, reads it; orjson does not)."""
    text = f"is not valid JSON ({msg} at byte {at:,} of the text)"
    if "surrogate" in msg:
        text += ": a \\uD800-\\uDFFF escape without its pair, which is no character; replace it in the file"
    return text


def _decodes(text: bytes) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def _last_cut(buf: bytearray, end: int) -> re.Match[bytes] | None:
    """The last `},{` that starts before `end`, wherever it is (maybe in a string)."""
    pos = buf.rfind(b"}", 0, end)
    while pos > 0:
        if m := CUT.match(buf, pos):
            return m
        pos = buf.rfind(b"}", 0, pos)
    return None


def _event_end(buf: bytearray, end: int) -> re.Match[bytes] | None:
    """The `},{` after the last whole top-level event before `end`: buf holds '[' and whole events from its start, so
    the braces outside strings (a string runs from a quote to the next quote not escaped by an odd run of
    backslashes) come back to depth 0 at each event's end. Scanned on whole arrays (a few ms per MiB)."""
    arr = np.frombuffer(memoryview(buf)[:end], np.uint8)
    quotes = np.flatnonzero(arr == QUOTE)
    escaped = np.zeros(len(quotes), bool)
    run = np.flatnonzero(quotes > 0)
    k = 1
    while len(run := run[arr[quotes[run] - k] == BACKSLASH]):  # quotes with k or more backslashes before them
        escaped[run] ^= True
        k += 1
        run = run[quotes[run] >= k]
    quotes = quotes[~escaped]
    braces = np.flatnonzero((arr == OPEN) | (arr == CLOSE))
    braces = braces[(np.searchsorted(quotes, braces) & 1) == 0]  # an even number of quotes before: not in a string
    closing = arr[braces] == CLOSE
    del arr  # buf can change size again
    depth = np.cumsum(np.where(closing, -1, 1))
    ends = braces[closing & (depth == 0)]
    for pos in ends[::-1][:3].tolist():  # the last event may have no `,{` after it yet
        if m := CUT.match(buf, pos):
            return m
    return None


class EventStream:
    """Read one trace file's events in batches; `meta` holds every top-level key but traceEvents once done."""

    def __init__(self, path: Path, block_bytes: int = 2 << 20,
                 on_raw: Callable[[int], None] | None = None) -> None:
        self.path = path
        self.block_bytes = max(int(block_bytes), 1 << 16)
        self.on_raw = on_raw
        self.meta: dict[str, Any] = {}
        self.events = 0  # whole events decoded so far
        self.text_bytes = 0  # JSON text consumed by those events (and the header)
        self.bad_at: int | None = None  # where in the buffer the text stopped being JSON
        self.closed = False  # the events' array is known to have ended (_tail reads the rest)
        self.scan = False  # find each block's last event end by scanning, not by trying the last `},{`

    def _cut(self, problem: str) -> TraceCut:
        return TraceCut(problem, self.events, self.text_bytes)

    def batches(self) -> Iterator[list[Any]]:
        buf = bytearray()
        in_events = False
        blocks = _text_blocks(self.path, self.block_bytes, self.on_raw)
        try:
            for block in blocks:
                buf += block
                if not in_events:
                    m = EVENTS_KEY.search(buf)
                    if m is None:
                        continue
                    self._header(bytes(buf[:m.start()]))
                    self.text_bytes += m.end() - 1
                    del buf[:m.end() - 1]  # keep the '['
                    in_events = True
                if len(buf) >= self.block_bytes:
                    batch = self._take(buf)
                    if batch:
                        yield batch
        except TraceCut as cut:
            cut.events, cut.text_bytes = self.events, self.text_bytes
            if in_events:
                # the whole events before the cut are still good
                while len(buf) > 2 and (batch := self._take(buf, final=True)):
                    yield batch
            raise
        if not in_events:
            self._no_events(bytes(buf))
        yield from self._tail(buf)

    def _header(self, head: bytes) -> None:
        text = head.rstrip()
        if text.endswith(b","):
            text = text[:-1]
        try:
            meta = orjson.loads(text + b"}")
        except orjson.JSONDecodeError as exc:
            raise self._cut(f"is not valid JSON before traceEvents ({exc})") from None
        if not isinstance(meta, dict):
            raise NotKineto("the top level is not an object")
        self.meta.update(meta)

    def _take(self, buf: bytearray, final: bool = False) -> list[Any] | None:
        """Decode the whole events at the front of buf ('[' + events...) and drop them from it."""
        if self.closed:
            return None
        end = len(buf) if self.bad_at is None else min(len(buf), self.bad_at)
        if not self.scan:
            # the last `},{` is nearly always the end of an event: one decode proves it
            m = _last_cut(buf, end)
            if m is None:
                return self._wait(buf, final)
            batch = self._decode(buf, m)
            if batch is not None:
                return batch
            self.scan = True  # a `},{` inside a string or a nested object: from now on, find the end by scanning
        m = _event_end(buf, end)
        if m is None:
            return self._wait(buf, final)
        batch = self._decode(buf, m)
        if batch is None:
            if final:
                return None
            # the text up to a balanced end of an event does not decode: it is not JSON there
            self._bad_json(bytes(memoryview(buf)[:m.start() + 1]) + b"]", growing=False)
        return batch

    def _decode(self, buf: bytearray, m: re.Match[bytes]) -> list[Any] | None:
        """The events before the cut `m` (a `},{` in buf), dropped from buf; None when that text does not decode."""
        comma = buf.index(b",", m.start())
        buf[comma] = ord("]")
        try:
            batch = orjson.loads(memoryview(buf)[:comma + 1])
        except orjson.JSONDecodeError:
            buf[comma] = ord(",")
            return None
        self.events += len(batch)
        self.text_bytes += comma + 1
        del buf[1:m.end() - 1]  # keep the '[' and the next event's '{'
        if self.bad_at is not None:
            self.bad_at -= m.end() - 2
        return batch

    def _wait(self, buf: bytearray, final: bool) -> None:
        """No whole event in buf yet: read more text, unless buf already holds far more than a block."""
        if not final and len(buf) > 8 * self.block_bytes:
            self._bad_json(bytes(buf), growing=True)

    def _bad_json(self, text: bytes, growing: bool) -> None:
        """Raise TraceCut saying where `text` (the front of the buffer) stops being JSON; `growing`: the text has
        no end of an event yet, which is no fault when it is all one event's."""
        try:
            orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            if growing and _decodes(text[:exc.pos]):
                self.closed = True  # the events' array ended before: the rest is the trace's last keys
                return
            if growing and exc.pos >= len(text) - 1:
                raise self._cut(f"has an event of more than {len(text) / 2**20:.0f} MiB of JSON text, more than the "
                                "reader holds (8 blocks of FLEETLENS_TRACE_BLOCK_MB)") from None
            self.bad_at = exc.pos
            raise self._cut(_not_json(exc.msg, self.text_bytes + exc.pos - 1)) from None
        raise self._cut("is not valid JSON")

    def _tail(self, buf: bytearray) -> Iterator[list[Any]]:
        """The last events and the keys after the array: the rest of the text is one object's end."""
        head = b'{"traceEvents":'
        try:
            rest = orjson.loads(head + bytes(buf))
        except orjson.JSONDecodeError as exc:
            # the last events may be whole: give them, then say where the text stops
            at_end = exc.pos >= len(head) + len(buf.rstrip()) - 1
            self.bad_at = max(exc.pos - len(head), 0)
            start = self.text_bytes
            while len(buf) > 2 and (batch := self._take(buf, final=True)):
                yield batch
            if not at_end:
                raise self._cut(_not_json(exc.msg, start + exc.pos - len(head) - 1)) from None
            if buf[1:].strip():
                raise self._cut(f"is truncated or not valid JSON after {self.events} events ({exc.msg})") from None
            raise self._cut(f"is truncated after {self.events} events (the text ends inside traceEvents)") from None
        events = rest.pop("traceEvents")
        self.meta.update(rest)
        if not isinstance(events, list):
            raise NotKineto("traceEvents is not a list")
        self.events += len(events)
        self.text_bytes += len(buf)
        if events:
            yield events

    def _no_events(self, text: bytes) -> None:
        if not text.strip():
            raise self._cut("holds no data (empty JSON text)")
        try:
            record = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise self._cut(f"is not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise NotKineto(f"is JSON but not a trace: the top level is a {type(record).__name__}, not an object")
        raise NotKineto("is JSON but not a Kineto trace: it has no traceEvents")
