"""The enforcer's command kinds an agent runs for managed jobs, by kind; the agent registers them when it starts
(importing a module registers nothing)."""

from __future__ import annotations

from collector.command_runner import HandlerFn
from collector.job_control import handle_checkpoint, handle_stop
from collector.job_start import handle_launch, handle_relaunch

JOB_COMMANDS: dict[str, HandlerFn] = {
    "launch": handle_launch,
    "relaunch": handle_relaunch,
    "checkpoint": handle_checkpoint,
    "stop": handle_stop,
}
