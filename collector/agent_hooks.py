"""What an agent runs for managed jobs besides sampling: the SDK socket's handlers with the lane gate behind them, the
job command kinds (registered when the agent starts), the job reaper and the storage prober."""

from __future__ import annotations

import logging
import threading

from collector.agent_batch import AgentStats
from collector.command_runner import register_handler
from collector.job_commands import JOB_COMMANDS
from collector.job_reaper import REAPER, ReaperHost
from collector.sdk_handlers import SdkHandlers
from collector.storage_prober import start_prober
from enforcer.gate import LaneGate
from store.db import Store
from store.settings import Settings

log = logging.getLogger(__name__)


def make_sdk_handlers(store: Store, host_id: str, settings: Settings,
                      stats: AgentStats | None = None) -> tuple[SdkHandlers, LaneGate]:
    """The SDK socket's handlers with the enforcer's lane gate behind them (SRTF reads each job's declared steps),
    counting into the agent's `stats`."""
    handlers: SdkHandlers | None = None

    def total_steps(workflow: str) -> int | None:
        return handlers.total_steps(workflow) if handlers is not None else None

    gate = LaneGate(settings.policy, total_steps=total_steps)
    handlers = SdkHandlers(store, host_id, settings, gate=gate, stats=stats)
    return handlers, gate


def install_job_hooks(host: ReaperHost, host_id: str, stop: threading.Event) -> list[threading.Thread]:
    """Register the job command kinds, take up the jobs an earlier agent started here, start the reaper (until the
    last agent of the process stops) and the storage prober (until `stop`); returns the threads to join."""
    for kind, handler in JOB_COMMANDS.items():
        register_handler(kind, handler)
    try:
        REAPER.adopt(host.store, host_id)
    except Exception:  # taking up old jobs is no reason for an agent not to start
        log.exception("taking up the jobs already running on %s failed", host_id)
    REAPER.start(host, stop)
    return [start_prober(host.store, host.settings, host_id, stop)]
