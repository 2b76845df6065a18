"""The `replay` device source: one recording played live against the wall clock, as virtual devices.

The recording is any that collector.recordings reads ("alibaba", the Alibaba trace folder, or a fleetlens
export); loading a whole recording into a store at once is collector.recordings.load.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from collector.recordings.read import read_recording
from collector.recordings.recording import Recording
from collector.sources.base import DeviceInfo, DeviceReading, ProcessReading
from store.errors import InvalidInput
from store.samples import DEVICE_METRICS, INT_METRICS


@dataclass
class _Series:
    ts: np.ndarray  # one device's sample times, sorted
    rows: list[list[Any]]  # DEVICE_METRICS values per sample, None = missing
    pts: np.ndarray  # its process samples' times, sorted
    procs: list[tuple[int, str, int | None, float | None, float | None]]  # pid, workflow, mem, sm, cpu


class ReplaySource:
    """A DeviceSource that plays a recording against the wall clock, `speedup` recorded seconds per second.

    With `host`, only that virtual host's devices are played (one agent per virtual host); without, every
    device of the recording is played as one host, numbered 0..n-1 in the recording's order. Each reading
    carries the recorded workflow id on its processes, so no /proc attribution is needed. With `loop`, the
    recording starts again when it ends; otherwise the last values are held. Device uuids are the recording's
    prefixed by `uuid_prefix` (open_source passes the agent's host id).
    """

    name = "replay"

    def __init__(
        self,
        recording: Recording | str | Path,
        *,
        speedup: float = 60.0,
        host: str | None = None,
        loop: bool = True,
        uuid_prefix: str = "live",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if speedup <= 0 or not math.isfinite(speedup):
            raise InvalidInput(f"replay speed-up must be a positive number, not {speedup}")
        self.recording = recording if isinstance(recording, Recording) else read_recording(recording)
        rec = self.recording
        keys = [(d["host_id"], int(d["index"])) for d in rec.devices]
        if host is not None:
            keys = [k for k in keys if k[0] == host]
            if not keys:
                hosts = sorted({d["host_id"] for d in rec.devices})
                raise InvalidInput(f"the recording has no host {host!r}; it has {hosts[:10]}")
        self.host = host
        self.speedup, self.loop, self._clock = float(speedup), loop, clock
        self._started = clock()
        self._rec_start, self._rec_end = rec.start, rec.end
        by_key = {(d["host_id"], int(d["index"])): d for d in rec.devices}
        wf_source = {w["id"]: w.get("id_source") or "replay" for w in rec.workflows}
        self._infos: list[DeviceInfo] = []
        self._series: list[_Series] = []
        dev_all, proc_all = rec.device_samples, rec.process_samples
        if host is not None:  # one host's rows before grouping: many agents share one parsed recording
            dev_all, proc_all = dev_all[dev_all["host_id"] == host], proc_all[proc_all["host_id"] == host]
        dev_groups = dict(tuple(dev_all.groupby(["host_id", "device_index"], sort=False)))
        proc_groups = dict(tuple(proc_all.groupby(["host_id", "device_index"], sort=False)))
        empty_dev = rec.device_samples.iloc[0:0]
        empty_proc = rec.process_samples.iloc[0:0]
        for local, key in enumerate(keys):
            d = by_key[key]
            index = key[1] if host is not None else local
            # device uuids are unique in the store: a live replay must not take the uuid of the same device
            # bulk-loaded by load_into_store, nor of another agent playing the same recording
            self._infos.append(DeviceInfo(index=index, uuid=f"{uuid_prefix}:{d['uuid']}", name=d["name"],
                                          memory_total=d.get("memory_total")))
            ds = dev_groups.get(key, empty_dev).sort_values("ts", kind="stable")
            ps = proc_groups.get(key, empty_proc).sort_values("ts", kind="stable")
            # plain Python lists per row: a sample of 143 devices must cost microseconds, not pandas lookups
            self._series.append(_Series(
                ts=ds["ts"].to_numpy(dtype=float),
                rows=[[None if v != v else v for v in row] for row in ds[list(DEVICE_METRICS)].itertuples(
                    index=False, name=None)],
                pts=ps["ts"].to_numpy(dtype=float),
                procs=[(int(pid), str(wf), None if m != m else int(m), None if su != su else float(su),
                        None if cu != cu else float(cu))
                       for pid, wf, m, su, cu in ps[["pid", "workflow_id", "mem_used", "sm_util", "cpu_util"]]
                       .itertuples(index=False, name=None)],
            ))
        self._wf_source = wf_source

    def devices(self) -> list[DeviceInfo]:
        return list(self._infos)

    def position(self) -> float:
        """The recorded time being played now."""
        played = (self._clock() - self._started) * self.speedup
        duration = self._rec_end - self._rec_start
        if self.loop and duration > 0:
            played %= duration + 1e-9
        return min(self._rec_start + played, self._rec_end)

    def sample(self) -> list[DeviceReading]:
        now = self._clock()
        at = self.position()
        readings = []
        for info, series in zip(self._infos, self._series, strict=True):
            reading = DeviceReading(index=info.index, ts=now, mem_total=info.memory_total)
            ts = series.ts
            i = int(np.searchsorted(ts, at, side="right")) - 1
            if i >= 0:
                for col, v in zip(DEVICE_METRICS, series.rows[i], strict=True):
                    if v is not None:
                        setattr(reading, col, int(v) if col in INT_METRICS else float(v))
                # the processes recorded since the device's previous row belong to this reading
                lo = ts[i - 1] if i > 0 else -math.inf
                a = int(np.searchsorted(series.pts, lo, side="right"))
                b = int(np.searchsorted(series.pts, ts[i], side="right"))
                for pid, wf, mem, sm, cpu in series.procs[a:b]:
                    reading.processes.append(ProcessReading(
                        pid=pid, mem_used=mem, sm_util=sm, cpu_util=cpu, workflow_id=wf,
                        id_source=self._wf_source.get(wf, "replay"), start_time=self._started,
                    ))
            readings.append(reading)
        return readings

    def workflows(self) -> list[dict[str, Any]]:
        """The recording's workflows (id, team, labels...) for the agent to register."""
        wanted = {p[1] for s in self._series for p in s.procs}
        return [w for w in self.recording.workflows if w["id"] in wanted]

    def close(self) -> None:
        pass


__all__ = ["ReplaySource"]
