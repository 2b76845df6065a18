"""Device sources behind one interface: `nvml` (GPUs), `cpu` (groups of cores), `replay` (recorded telemetry).

`open_source(settings)` picks one from FLEETLENS_SOURCE: "auto" tries NVML and falls back to the cpu source
when NVML cannot start (no library, no driver, no GPU), so a laptop or CI runs the whole loop on its cores.
"""

from __future__ import annotations

import logging

from collector.sources.base import DeviceInfo, DeviceReading, DeviceSource, ProcessReading, SourceUnavailable
from collector.sources.cpu import CpuSource
from collector.sources.nvml import GpusUnreadable, NvmlSource
from collector.sources.replay import ReplaySource
from store.errors import ConfigError
from store.settings import Settings

log = logging.getLogger(__name__)

SOURCES = ("auto", "nvml", "cpu", "replay")


def _cpu(settings: Settings) -> DeviceSource:
    return CpuSource(cores_per_device=settings.cpu_cores_per_device, host_id=settings.host_id,
                     top_n=settings.cpu_top_processes)


def _nvml() -> DeviceSource:
    return NvmlSource()


def _replay(settings: Settings) -> DeviceSource:
    if not settings.replay_path:
        raise ConfigError(
            "FLEETLENS_SOURCE=replay needs FLEETLENS_REPLAY_PATH: 'alibaba', the Alibaba trace folder, "
            "or a file written by `fleetlens export`"
        )
    path = settings.fleet_data_dir if settings.replay_path == "alibaba" else settings.replay_path
    return ReplaySource(path, speedup=settings.replay_speedup, host=settings.replay_host,
                        uuid_prefix=settings.host_id)


def open_source(settings: Settings) -> DeviceSource:
    """The device source FLEETLENS_SOURCE names; "auto" = NVML if it starts and sees a GPU, else cpu."""
    kind = (settings.source or "auto").strip().lower()
    if kind == "auto":
        try:
            source = _nvml()
        except SourceUnavailable as exc:
            # a driver that started yet could not list its GPUs is a broken GPU host, not a CPU host: said loudly
            level = logging.WARNING if isinstance(exc, GpusUnreadable) else logging.INFO
            log.log(level, "no NVIDIA GPU usable here (%s); sampling CPU cores instead", exc.__cause__ or exc)
            return _cpu(settings)
        if not source.devices():  # a driver without GPUs (a GPU node with all of them lost, a container)
            source.close()
            log.info("NVML sees no GPU; sampling CPU cores instead")
            return _cpu(settings)
        return source
    if kind == "nvml":
        return _nvml()
    if kind == "cpu":
        return _cpu(settings)
    if kind == "replay":
        return _replay(settings)
    raise ConfigError(f"FLEETLENS_SOURCE={settings.source!r} is not a device source; use one of {', '.join(SOURCES)}")


__all__ = [
    "DeviceInfo", "DeviceReading", "DeviceSource", "ProcessReading", "SOURCES", "SourceUnavailable", "open_source",
]
