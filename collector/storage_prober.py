"""The storage prober: says in the store, every `storage_probe_s`, which checkpoint locations this host can read and
write, so the planner moves a job to this host only when it could resume here."""

from __future__ import annotations

import logging
import threading

from store.checkpoints import locations_to_probe, probe, record_probes
from store.db import Store
from store.errors import DatabaseUnavailable
from store.settings import Settings

log = logging.getLogger(__name__)


def probe_storage(store: Store, settings: Settings, host_id: str) -> dict[str, str | None]:
    """Say in the store which checkpoint locations this host can read and write ({url: None, or why not}): the
    planner moves a job to this host only when its checkpoint location, or the fleet's root above it, is among
    them. One listing and one small write per location (store.checkpoints.locations_to_probe says which)."""
    with store.session() as session:
        urls = locations_to_probe(session, settings.checkpoint_url)
    results = {url: probe(url, write_as=host_id) for url in urls}
    if results:
        with store.session() as session:
            record_probes(session, host_id, results.items())
    return results


def start_prober(store: Store, settings: Settings, host_id: str, stop: threading.Event) -> threading.Thread:
    """Probe every `storage_probe_s` until `stop` is set (then no probe runs: the store may be gone by then)."""
    def loop() -> None:
        while not stop.is_set():
            try:
                probe_storage(store, settings, host_id)
            except DatabaseUnavailable:
                pass  # the agent's flusher reports the outage; the next round says it again
            except Exception:
                log.exception("probing checkpoint locations failed")
            stop.wait(settings.storage_probe_s)

    thread = threading.Thread(target=loop, name="fleetlens-storage-probe", daemon=True)
    thread.start()
    return thread
