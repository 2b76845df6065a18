"""A bounded on-disk spool for sample batches the database could not take, sent back in order when it returns.

Each batch is one segment file (zlib-compressed JSON), written to a temporary name, fsync'd, renamed and the
folder fsync'd, so a batch is either wholly on disk or absent after a crash. Names carry a sequence number
(the sending order) and the batch's row count (so dropping the oldest past the bound can say what was lost
without reading it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.errors import ConfigError, DatabaseUnavailable

log = logging.getLogger(__name__)

_SEGMENT = re.compile(r"^(\d{16})-(\d+)\.seg$")


@dataclass(frozen=True)
class Segment:
    seq: int
    rows: int
    path: Path
    size: int


class Spool:
    """Batches waiting for the database, oldest first, at most `max_bytes` on disk."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ConfigError(f"FLEETLENS_SPOOL_MAX_BYTES must be positive, not {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.dropped_batches = 0
        self.dropped_rows = 0
        self._lock = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"the spool folder {self.directory} cannot be created ({exc.strerror or exc})") from None
        for leftover in self.directory.glob(".*.tmp"):  # a write a crash interrupted: never renamed, never counted
            leftover.unlink(missing_ok=True)
        self._segments: list[Segment] = sorted(self._scan(), key=lambda s: s.seq)
        self._next_seq = self._segments[-1].seq + 1 if self._segments else 1

    def _scan(self) -> list[Segment]:
        found = []
        for path in self.directory.iterdir():
            m = _SEGMENT.match(path.name)
            if m:
                found.append(Segment(int(m.group(1)), int(m.group(2)), path, path.stat().st_size))
        return found

    @property
    def size_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._segments)

    def __len__(self) -> int:
        with self._lock:
            return len(self._segments)

    @property
    def rows(self) -> int:
        with self._lock:
            return sum(s.rows for s in self._segments)

    def put(self, batch: dict[str, Any], rows: int) -> int | None:
        """Write `batch` durably; returns its sequence number (None if the batch alone exceeds the bound, or the
        folder cannot take it: a full disk).

        Past the bound the oldest batches are dropped, and a batch that cannot be written is dropped; each drop is
        counted and logged. It never raises for the batch: a caller putting it there because the database is away
        must go on (and carry on flushing) whatever the batch holds.
        """
        try:
            data = zlib.compress(json.dumps(batch, separators=(",", ":"), allow_nan=False).encode(), 1)
        except (TypeError, ValueError) as exc:  # a NaN or a value JSON cannot hold: the writer should have said None
            with self._lock:
                self._count_drop(rows, f"a batch holds a value the spool cannot keep ({exc})")
            return None
        with self._lock:
            if len(data) > self.max_bytes:
                self._count_drop(rows, f"a batch of {len(data)} bytes is larger than the whole spool")
                return None
            total = sum(s.size for s in self._segments)
            while self._segments and total + len(data) > self.max_bytes:
                oldest = self._segments.pop(0)
                oldest.path.unlink(missing_ok=True)
                total -= oldest.size
                self._count_drop(oldest.rows, f"spool full at {self.max_bytes} bytes; dropped its oldest batch")
            seq = self._next_seq
            self._next_seq += 1
            path = self.directory / f"{seq:016d}-{rows}.seg"
            tmp = self.directory / f".{seq:016d}.tmp"
            try:
                self._write(tmp, data)
                os.replace(tmp, path)
                self._fsync_dir()
            except OSError as exc:  # a full disk, say: no half-written segment stays, and the loss is counted
                tmp.unlink(missing_ok=True)
                path.unlink(missing_ok=True)
                self._count_drop(rows, f"the spool folder {self.directory} cannot take a batch "
                                       f"({exc.strerror or exc})")
                return None
            self._segments.append(Segment(seq, rows, path, len(data)))
            return seq

    @staticmethod
    def _write(tmp: Path, data: bytes) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:  # a write may take only part of the data (the disk filling up as it goes)
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def _count_drop(self, rows: int, why: str) -> None:
        self.dropped_batches += 1
        self.dropped_rows += rows
        log.warning(
            "%s: %d rows lost (%d batches, %d rows dropped since start)", why, rows, self.dropped_batches,
            self.dropped_rows,
        )

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def oldest(self) -> tuple[Segment, dict[str, Any]] | None:
        """The oldest batch still waiting, read back; an unreadable segment is set aside as .bad and skipped."""
        while True:
            with self._lock:
                if not self._segments:
                    return None
                segment = self._segments[0]
            try:
                return segment, json.loads(zlib.decompress(segment.path.read_bytes()))
            except (OSError, zlib.error, ValueError) as exc:
                log.error("spool segment %s cannot be read (%s); moved aside, %d rows lost", segment.path, exc,
                          segment.rows)
                self._set_aside(segment)

    def ack(self, segment: Segment) -> None:
        """The batch reached the database: forget it."""
        with self._lock:
            self._segments = [s for s in self._segments if s.seq != segment.seq]
        segment.path.unlink(missing_ok=True)
        self._fsync_dir()

    def drain(
        self,
        send: Callable[[dict[str, Any]], None],
        on_poison: Callable[[dict[str, Any], BaseException], None] | None = None,
    ) -> int:
        """Send waiting batches oldest first until none is left; returns how many went.

        Stops (re-raising DatabaseUnavailable) at the first batch the database cannot take, so order holds.
        A batch the database refuses for any other reason would block the spool forever: it is set aside as
        .bad, counted as dropped, and reported to `on_poison`.
        """
        sent = 0
        while (item := self.oldest()) is not None:
            segment, batch = item
            try:
                send(batch)
            except DatabaseUnavailable:
                raise  # the batch stays, and so do those after it
            except Exception as exc:
                if on_poison is None:
                    raise
                self._set_aside(segment)
                on_poison(batch, exc)
                continue
            self.ack(segment)
            sent += 1
        return sent

    def _set_aside(self, segment: Segment) -> None:
        with self._lock:
            self._segments = [s for s in self._segments if s.seq != segment.seq]
            self.dropped_batches += 1
            self.dropped_rows += segment.rows
        if segment.path.exists():
            segment.path.rename(segment.path.with_suffix(".bad"))

