"""The job SDK's entry point for settings: a job process reads its FLEETLENS_* environment once, here."""

from __future__ import annotations

from store.settings import Settings, get_settings


def job_settings() -> Settings:
    """The settings of this job process, read from its environment (FLEETLENS_*).

    The SDK runs inside a user's job, where nothing passes settings down: its public constructors
    (`collector.job.job`, `collector.serving.serving` and `ServingRecorder`) call this once, at the top, when the caller
    gave none, as the command line reads them once in `fleetlens`; everything below takes them as a parameter.
    A job script's `main` reads them here too (collector/examples/train.py).
    """
    return get_settings()
