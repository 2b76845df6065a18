"""Cache of parsed traces under FLEETLENS_HOME/cache/traces, keyed by path, size and mtime.

Parsing is most of an analysis; re-running the rules on a trace (a new threshold, a new rule) reads the
pickled frame back instead of the JSON.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path

from analyzer.traces.parse import ParsedTrace
from analyzer.traces.stream_read import BYTES_PER_ROW, ReadProgress, stream_trace
from store.settings import Settings

log = logging.getLogger(__name__)
CACHE_VERSION = "6"  # bump when ParsedTrace or the parse changes


@dataclass(frozen=True)
class TraceBounds:
    """How the streaming reader is bounded: the JSON it decodes at once, and the most its kept columns may hold
    (FLEETLENS_TRACE_BLOCK_MB, FLEETLENS_TRACE_MEMORY_MB; the defaults are theirs)."""

    block_bytes: int = 2 << 20
    memory_bytes: int = 1024 << 20

    @classmethod
    def from_settings(cls, settings: Settings) -> TraceBounds:
        return cls(block_bytes=settings.trace_block_mb << 20, memory_bytes=settings.trace_memory_mb << 20)


def read_trace(path: str | Path, bounds: TraceBounds, memory_budget: int | None = None,
               read_progress: ReadProgress | None = None) -> ParsedTrace:
    """The streaming reader within `bounds` (`memory_budget`, bytes, overrides its memory_bytes)."""
    budget = memory_budget if memory_budget is not None else bounds.memory_bytes
    return stream_trace(path, block_bytes=bounds.block_bytes, max_rows=max(budget // BYTES_PER_ROW, 1),
                        progress=read_progress)


def cache_key(path: str | Path) -> str:
    p = Path(path).resolve()
    st = p.stat()
    from hta.version import __version_tuple__ as hta_version  # noqa: PLC0415  (HTA only when a trace is read)

    raw = f"{p}|{st.st_size}|{st.st_mtime_ns}|{CACHE_VERSION}|{hta_version}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def load_trace(path: str | Path, cache_dir: Path | None = None, memory_budget: int | None = None,
               read_progress: ReadProgress | None = None, bounds: TraceBounds = TraceBounds()) -> ParsedTrace:
    """Parse a trace, or read it from the cache when the same file (path, size, mtime) was parsed before."""
    if cache_dir is None:
        return read_trace(path, bounds, memory_budget, read_progress)
    try:
        file = Path(cache_dir) / f"{cache_key(path)}.pkl"
    except OSError:
        return read_trace(path, bounds, memory_budget, read_progress)  # read_trace names the problem
    if file.exists():
        try:
            with file.open("rb") as fh:
                cached = pickle.load(fh)
            if isinstance(cached, ParsedTrace):
                cached.path = str(path)
                return cached
        except Exception as exc:  # a broken cache entry is only a cache miss
            log.warning("ignoring unreadable cache entry %s: %s", file, exc)
    parsed = read_trace(path, bounds, memory_budget, read_progress)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(parsed, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, file)
    except OSError as exc:
        log.warning("could not cache %s: %s", path, exc)
    return parsed
