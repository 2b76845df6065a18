"""Read a Kineto trace of any size into the columns the questions need, in memory bounded by settings.

The events come in batches from analyzer.traces.stream_json (one block of text at a time) and go straight into
NumPy columns, names and categories as codes of one symbol table: no Python object is kept per event. Kept in
columns: the device's kernels, copies and memsets, and the CPU calls the questions look at one by one (profiler
steps, synchronisations, DataLoader spans, arithmetic operators). Every other event only updates whole-trace facts
(count, first and last time, categories, CPU call names, launch calls' CPU time). The CPU calls that carry a
correlation id go to a temporary file (32 bytes each) and are joined to the device events after the read, with
HTA's rule (transform_correlation_to_index: the last CPU event of a correlation id wins), so that each device
event knows when and for how long its launch ran. How each event's fields are read (and a malformed one named) is
analyzer.traces.stream_fields; what of a trace cut short can still be analysed, analyzer.traces.stream_cut.

The frame built from the columns has the reference reader's (analyzer.traces.parse) values for every row it
holds; tests/analyzer/test_trace_streaming.py holds the summaries and findings equal on every shared trace.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analyzer.traces.errors import InvalidTrace
from analyzer.traces.memory import release_freed_memory
from analyzer.traces.names import COPY_CATS, issuing_calls
from analyzer.traces.parse import GPU_CATS, ParsedTrace, check_file_only, finish, rank_of
from analyzer.traces.stream_cut import complete_part
from analyzer.traces.stream_fields import (
    COPY_CALL,
    KEEP,
    LAUNCH,
    MATH_ONLY,
    SPILL,
    correlation_id,
    malformed,
    name_flags,
    number_array,
    stream_number,
)
from analyzer.traces.stream_json import EventStream, NotKineto, TraceCut

GPU_CAT_SET = frozenset(GPU_CATS)
GPU_SIDE_NAMES = ("Event Sync", "Context Sync")  # HTA counts these as device events whatever their stream
SPILL_CHUNK = 1 << 16  # spilled records read back at a time (2 MiB)
BYTES_PER_ROW = 96  # a kept event's columns, with the frame built from them
ReadProgress = Callable[[int, int, int], None]  # (file bytes read, file size, events read)


class TruncatedTrace(InvalidTrace):
    """A trace cut short (or corrupt part way): `partial` is the analysis of its complete steps, when it has any."""

    def __init__(self, path: str, problem: str, partial: ParsedTrace | None) -> None:
        super().__init__(path, problem)
        self.partial = partial


NARROW = frozenset({"name", "cat", "stream"})


class _Columns:
    """Columns grown one batch at a time (a list of arrays per column, joined once at the end)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
        self.rows = 0

    def add(self, lists: tuple[list[Any], ...]) -> None:
        if not lists[0]:
            return
        for n, values in zip(self.names, lists, strict=True):
            arr = number_array(values)
            if n in NARROW and arr.dtype.kind == "i" and len(arr) and -2**31 < arr.min() and arr.max() < 2**31:
                arr = arr.astype(np.int32)  # symbol codes and streams: half the memory while the read goes on
            self.parts[n].append(arr)
        self.rows += len(lists[0])

    def column(self, name: str) -> np.ndarray:
        parts = self.parts.pop(name)
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


GPU_COLS = ("index", "name", "cat", "ts", "dur", "stream", "correlation", "bytes")
CPU_COLS = ("index", "name", "cat", "ts", "dur", "stream", "correlation")


class StreamedColumns:
    """The state of one streaming read: columns, symbol table, whole-trace facts, the spilled correlations."""

    def __init__(self, spill_dir: str | None, max_rows: int | None, path: Path) -> None:
        self.path = path
        self.symbols: dict[Any, int] = {}
        self.table: list[str] = []
        self.flags: list[int] = []
        self.gpu = _Columns(GPU_COLS)
        self.cpu = _Columns(CPU_COLS)
        self.copy_calls = _Columns(("correlation", "name"))  # the copy calls' ids, to name who issued each copy
        self.launch_codes: set[int] = set()
        self.cat_codes: set[int] = set()
        self.cpu_codes: set[int] = set()
        self.events = 0  # kept events (HTA's frame rows)
        self.position = 0  # events read, kept or not
        self.float_ts = False
        self.t0 = math.inf
        self.t_end = -math.inf
        self.max_rows = max_rows
        self.spill = tempfile.TemporaryFile(dir=spill_dir, prefix="fleetlens-corr-")
        self.spilled = 0

    def code(self, name: Any) -> int:
        c = self.symbols.get(name)
        if c is None:
            c = self.symbols[name] = len(self.table)
            text = str(name)
            self.table.append(text)
            self.flags.append(name_flags(text))
        return c

    def add(self, batch: list[Any]) -> None:
        """Take one batch of events; InvalidTrace naming the first malformed event when a field has the wrong type
        (a time or size that is no number, a name or category that is no string, a correlation id that is no
        integer). A null correlation id or stream is none, as in HTA's frame."""
        base = self.position
        try:
            self._add(batch)
        except (TypeError, ValueError):
            raise InvalidTrace(str(self.path), f"has malformed events ({malformed(batch, base)})") from None

    def _add(self, batch: list[Any]) -> None:  # noqa: C901, PLR0912, PLR0915  (one pass per event, kept flat for speed)
        symbols, flags, code = self.symbols, self.flags, self.code
        gi, gn, gc, gt, gd, gs, gr, gb = [], [], [], [], [], [], [], []
        ci, cn, cc, ct, cd, cs, cr = [], [], [], [], [], [], []
        si, sr, st, sd = [], [], [], []
        sl = []
        qr, qn = [], []
        all_ts, kept_dur, kept_ts = [], [], []
        cpu_codes, cat_codes = self.cpu_codes, self.cat_codes
        side = {symbols.get(n) for n in GPU_SIDE_NAMES} - {None}
        base = self.position
        for i, e in enumerate(batch):
            if e.__class__ is not dict:
                raise InvalidTrace(str(self.path), f"has malformed events (event {base + i} is not an object)")
            ts = e.get("ts")
            all_ts.append(ts)
            dur = e.get("dur")
            cat = e.get("cat")
            if dur is None or cat is None or cat == "Trace":
                continue
            kept_ts.append(ts)
            kept_dur.append(dur)
            name = e.get("name")
            n = symbols.get(name)
            if n is None:
                if name.__class__ is not str:
                    raise TypeError("a name that is no string")
                n = code(name)
                side = {symbols.get(x) for x in GPU_SIDE_NAMES} - {None}
            k = symbols.get(cat)
            if k is None:
                if cat.__class__ is not str:
                    raise TypeError("a category that is no string")
                k = code(cat)
            cat_codes.add(k)
            a = e.get("args")
            if a.__class__ is dict:
                stream = a.get("stream", -1)
                corr = a.get("correlation", -1)
                if stream.__class__ is not int:
                    stream = stream_number(stream)
                if corr.__class__ is not int:
                    corr = correlation_id(corr)
            else:
                stream = corr = -1
            idx = base + i
            if stream >= 0:
                if cat in GPU_CAT_SET:
                    gi.append(idx)
                    gn.append(n)
                    gc.append(k)
                    gt.append(ts)
                    gd.append(dur)
                    gs.append(stream)
                    gr.append(corr)
                    gb.append(a.get("bytes", -1) if a.__class__ is dict else -1)
                elif corr < -1 and n not in side:
                    si.append(idx), sr.append(corr), st.append(ts), sd.append(dur), sl.append(0)
                continue
            cpu_codes.add(n)
            f = flags[n]
            if f:
                if f & KEEP:
                    ci.append(idx)
                    cn.append(n)
                    cc.append(k)
                    ct.append(ts)
                    cd.append(dur)
                    cs.append(stream)
                    cr.append(corr)
                if f & COPY_CALL and corr >= 0:
                    qr.append(corr)
                    qn.append(n)
            launch = f & LAUNCH
            if launch:
                self.launch_codes.add(n)
            # to the file: CPU calls with a correlation id (for the join), and every launch call (their count and
            # CPU time are whole-trace facts)
            if launch or (corr != -1 and n not in side):
                si.append(idx)
                sr.append(corr if n not in side else -1)
                st.append(ts)
                sd.append(dur)
                sl.append(1 if launch else 0)
        self.position += len(batch)
        self.events += len(kept_ts)
        if number_array(all_ts).dtype.kind != "i":
            self.float_ts = True
        if kept_ts:
            kt, kd = number_array(kept_ts), number_array(kept_dur)
            self.t0 = min(self.t0, float(np.nanmin(kt)))
            self.t_end = max(self.t_end, float(np.nanmax(kt + kd)))
        self.gpu.add((gi, gn, gc, gt, gd, gs, gr, gb))
        self.cpu.add((ci, cn, cc, ct, cd, cs, cr))
        self.copy_calls.add((qr, qn))
        if si:
            rec = np.empty(len(si), SPILL)
            rec["idx"], rec["corr"], rec["ts"], rec["dur"] = si, sr, number_array(st), number_array(sd)
            rec["launch"] = sl
            rec.tofile(self.spill)
            self.spilled += len(si)
        if self.max_rows is not None and self.gpu.rows + self.cpu.rows > self.max_rows:
            raise InvalidTrace(
                str(self.path),
                f"has more device events than the memory limit allows ({self.gpu.rows + self.cpu.rows:,} kept after "
                f"{self.position:,} events); raise FLEETLENS_TRACE_MEMORY_MB or capture fewer steps")

    # -- after the read ------------------------------------------------------------------------------------------

    def _round(self, ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """HTA's nanosecond rounding (round_down_time_stamps) when the trace has fractional or missing times."""
        if self.float_ts:
            ts = ts.astype(np.float64)
            end = np.floor(ts + dur)
            ts = np.ceil(ts)
            if not (np.isnan(ts).any() or np.isnan(end).any()):
                ts, end = ts.astype(np.int64), end.astype(np.int64)
            return ts, end - ts, end
        return ts, dur, ts + dur

    def spilled_chunks(self) -> Iterator[np.ndarray]:
        """The spilled records, SPILL_CHUNK at a time."""
        self.spill.flush()
        self.spill.seek(0)
        while len(rec := np.fromfile(self.spill, SPILL, count=SPILL_CHUNK)):
            yield rec

    def launch_facts(self) -> tuple[int, float]:
        """How many launch calls the trace has, and their CPU time (rounded as the frame's times are)."""
        calls, total = 0, 0.0
        for rec in self.spilled_chunks():
            rec = rec[rec["launch"] == 1]
            _, dur, _ = self._round(rec["ts"], rec["dur"])
            calls += len(rec)
            total += float(np.sum(dur, dtype=np.float64))
        return calls, total

    def _launches(self, gpu_corr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each device event: the index, start and CPU time of its launch (HTA's correlation join), -1/NaN else."""
        n = len(gpu_corr)
        link, lts, ldur = np.full(n, -1, np.int64), np.full(n, np.nan), np.full(n, np.nan)
        wanted = np.unique(gpu_corr[gpu_corr >= 0])
        if not len(wanted) or not self.spilled:
            return link, lts, ldur
        # per wanted id: the last CPU event read with it (HTA's merge lets the last one win), filled a chunk at a
        # time, so that nothing larger than the device events' own ids is held
        w_idx = np.full(len(wanted), -1, np.int64)
        w_ts, w_dur = np.full(len(wanted), np.nan), np.full(len(wanted), np.nan)
        for rec in self.spilled_chunks():
            # a sorted search, not np.isin: its lookup table spans the whole id range (tens of MB on a large trace)
            at = np.clip(np.searchsorted(wanted, rec["corr"]), 0, len(wanted) - 1)
            hit = np.flatnonzero(wanted[at] == rec["corr"])
            if not len(hit):
                continue
            _, first_from_end = np.unique(at[hit][::-1], return_index=True)
            last = hit[len(hit) - 1 - first_from_end]  # the last record of each id in this chunk
            w_idx[at[last]], w_ts[at[last]], w_dur[at[last]] = rec["idx"][last], rec["ts"][last], rec["dur"][last]
        found = w_idx >= 0
        pos = np.clip(np.searchsorted(wanted, gpu_corr), 0, len(wanted) - 1)
        hit = (gpu_corr >= 0) & (wanted[pos] == gpu_corr) & found[pos]
        ts, dur, _ = self._round(w_ts[pos[hit]], w_dur[pos[hit]])
        link[hit] = w_idx[pos[hit]]
        lts[hit], ldur[hit] = ts, dur
        return link, lts, ldur

    def frame(self) -> tuple[pd.DataFrame, dict[str, Any]]:
        """The kept events as one frame in file order, built a column at a time (each column's parts freed as it
        is joined), with the whole-trace facts."""
        self.gpu_rows = self.gpu.rows
        g_corr = self.gpu.column("correlation").astype(np.int64)
        link, lts, ldur = self._launches(g_corr)
        n_cpu = self.cpu.rows
        none = np.full(n_cpu, -1, np.int64)

        def both(name: str) -> np.ndarray:
            return np.concatenate([self.gpu.column(name), self.cpu.column(name)])

        index = both("index")
        names = both("name")
        # a trace with device events judges arithmetic on the device: its CPU arithmetic calls are not needed
        keep = (np.ones(len(index), bool) if not self.gpu.rows else
                np.r_[np.ones(self.gpu.rows, bool), (np.asarray(self.flags, np.int8)[names[self.gpu.rows:]]
                                                     & MATH_ONLY) == 0])
        order = np.flatnonzero(keep)[np.argsort(index[keep], kind="stable")]
        # rows by position: no question looks an event up by its place in the file (HTA's index is not kept)
        df = pd.DataFrame(index=pd.RangeIndex(len(order)))
        del index
        ts, dur, end = self._round(both("ts"), both("dur"))
        df["ts"], df["dur"], df["end"] = ts[order], dur[order], end[order]
        del ts, dur, end
        name = names[order]
        del names
        df["stream"] = both("stream")[order]
        cat = both("cat")[order]
        # the correlation ids stay beside the frame, for the device events only (a cut file's complete steps are
        # judged by them); no question reads them once each device event carries its launch
        self.cpu.column("correlation")
        self.gpu_corr = g_corr
        nbytes = np.concatenate([self.gpu.column("bytes"), none])[order]
        if nbytes.dtype.kind == "i" and (not len(nbytes) or nbytes.max() < 2**31):
            nbytes = nbytes.astype(np.int32)  # only copies have sizes; the questions sum them as int64
        df["bytes"] = nbytes
        del nbytes
        df["launch_ts"] = np.concatenate([lts, np.full(n_cpu, np.nan)])[order]
        df["launch_dur"] = np.concatenate([ldur, np.full(n_cpu, np.nan)])[order]
        del order, link, lts, ldur
        table = pd.Index(self.table)
        gpu = df["stream"].to_numpy() >= 0  # the device rows, in the order of the ids beside the frame
        copies = np.isin(cat[gpu], [self.symbols[c] for c in COPY_CATS if c in self.symbols])
        copy_calls = issuing_calls(name[gpu][copies], g_corr[copies], self.copy_calls.column("name"),
                                   self.copy_calls.column("correlation"), self.table)
        df["s_name"] = pd.Categorical.from_codes(name, categories=table)
        df["s_cat"] = pd.Categorical.from_codes(cat, categories=table)
        launch_calls, launch_us = self.launch_facts()
        t0, t_end = self.t0, self.t_end
        if self.float_ts:
            t0, t_end = float(math.ceil(t0)), float(math.floor(t_end))
        facts = {"events": self.events, "t0": t0, "t_end": t_end,
                 "cats": {self.table[c] for c in self.cat_codes}, "cpu_names": {self.table[c] for c in self.cpu_codes},
                 "launch_calls": launch_calls, "launch_us": launch_us,
                 "launch_names": sorted(self.table[c] for c in self.launch_codes), "copy_calls": copy_calls}
        return df, facts


def stream_trace(path: str | Path, *, block_bytes: int = 2 << 20, max_rows: int | None = None,
                 spill_dir: str | None = None, progress: ReadProgress | None = None) -> ParsedTrace:
    """Read one trace file with the streaming reader; raises InvalidTrace (TruncatedTrace for a cut file)."""
    p = Path(path)
    size = check_file_only(p)
    done = [0]

    def on_raw(n: int) -> None:
        done[0] += n

    stream = EventStream(p, block_bytes, on_raw)
    cols = StreamedColumns(spill_dir, max_rows, p)
    try:
        return _read(p, size, stream, cols, done, progress)
    finally:
        cols.spill.close()


def _read(p: Path, size: int, stream: EventStream, cols: StreamedColumns, done: list[int],
          progress: ReadProgress | None) -> ParsedTrace:
    cut: TraceCut | None = None
    try:
        for batch in stream.batches():
            cols.add(batch)
            if progress:
                progress(done[0], size, stream.events)
    except TraceCut as exc:
        cut = exc
    except NotKineto as exc:
        msg = str(exc)
        raise InvalidTrace(str(p), msg if msg.startswith("is ") else f"is JSON but not a trace: {msg}") from None
    if progress:
        progress(done[0], size, stream.events)
    if cut is None and cols.events == 0:
        if cols.position:
            raise InvalidTrace(str(p), "has no complete ('X') events with a duration")
        raise InvalidTrace(str(p), "has no events (traceEvents is empty)")
    if cut is not None and cols.events == 0:
        raise TruncatedTrace(str(p), f"{cut.problem}; the read stopped before the first whole event", None)
    df, facts = cols.frame()
    release_freed_memory()  # the read's buffers and column parts, before the analysis needs room
    warnings: list[str] = []
    rank = rank_of(stream.meta, p, warnings)
    if cut is None:
        return finish(p, rank, stream.meta, df, facts, warnings)
    where = (f"after {cut.events:,} whole events ({cut.text_bytes / 2**20:.1f} MiB of JSON text, "
             f"{done[0] / 2**20:.1f} of {size / 2**20:.1f} MiB of the file read)")
    problem = f"{cut.problem}; the read stopped {where}"
    part = complete_part(cols, df, stream.meta)
    if part is None:
        raise TruncatedTrace(str(p), f"{problem}; no profiler step is complete before the cut", None)
    kept, n = part
    warnings.append(f"truncated: only the {n} complete steps read are analysed (the read stopped {where})")
    partial = finish(p, rank, stream.meta, kept.copy(), facts, warnings)
    raise TruncatedTrace(str(p), f"{problem}; the {n} complete step{'s' if n != 1 else ''} read before the cut "
                                 "were analysed", partial)
