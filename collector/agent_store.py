"""What the agent writes to the store for a batch besides its samples: workflows first seen, the host's heartbeat,
its lost and found devices, and the processes it saw; and which device ids a batch's rows go to."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from collector.agent_batch import Batch
from collector.sources.base import DeviceSource
from store.db import Store
from store.registry import (
    DeviceSpec,
    SeenProcess,
    device_ids,
    device_ids_by_uuid,
    mark_device_lost,
    record_processes,
    register_devices,
    retire_unlisted_devices,
    touch_host,
    touch_open_processes,
    touch_workflows,
)

log = logging.getLogger(__name__)


def touch_new_workflows(store: Store, workflows: dict[str, str], known: set[str]) -> None:
    """Create the workflows this agent has not registered yet (`known`, which this adds to); mark all of them seen
    (one UPDATE)."""
    if not workflows:
        return
    now = time.time()
    new = {w: src for w, src in workflows.items() if w not in known}
    with store.session() as session:  # another host's agent may create the same workflow at once: store.rows
        touch_workflows(session, new, workflows, now)
    known.update(new)


def specs_of(source: DeviceSource, indexes: set[int]) -> list[DeviceSpec]:
    return [DeviceSpec(d.index, d.uuid, d.name, d.memory_total, d.cpu_cores)
            for d in source.devices() if d.index in indexes]


def register_new_devices(store: Store, host_id: str, source: DeviceSource, indexes: set[int],
                         device_ids: dict[int, int], uuids: dict[int, str]) -> None:
    """Register the devices the source opened since the agent registered (a MIG instance made), and those whose
    UUID at their index is not the one registered (a MIG instance made in the place of another), adding them to
    `device_ids` and `uuids` (index -> UUID registered): before the batch holding their first rows is written, which
    would drop rows of unknown devices, or write them to the device that was there before. Devices the source no
    longer lists (a GPU turned into MIG instances, an instance destroyed, MIG turned off) are retired
    (store.registry.retire_unlisted_devices) and dropped from `device_ids` and `uuids`, to be registered afresh if
    they come back."""
    listed = {d.index for d in source.devices()}
    unlisted = [i for i in device_ids if i not in listed]
    specs = [d for d in specs_of(source, listed)
             if (d.index in indexes and d.index not in device_ids) or uuids.get(d.index, d.uuid) != d.uuid]
    if specs or unlisted:
        with store.session() as session:
            if unlisted:
                retire_unlisted(session, host_id, source, listed, device_ids)
                for index in unlisted:
                    uuids.pop(index, None)
            if specs:
                device_ids.update(register_devices(session, host_id, specs, source=source.name, moved_here=True))
        uuids.update({d.index: d.uuid for d in specs})


def retire_unlisted(session: Session, host_id: str, source: DeviceSource, listed: set[int],
                    device_ids: dict[int, int]) -> None:
    """Mark gone the host's devices of this source that it no longer lists, and forget them in `device_ids`."""
    for index in retire_unlisted_devices(session, host_id, source.name, listed):
        log.warning("device %d of host %s is no longer listed by the %s source (MIG reconfigured?): nothing is "
                    "placed on it until it is listed again", index, host_id, source.name)
        device_ids.pop(index, None)
    for index in [i for i in device_ids if i not in listed]:
        device_ids.pop(index, None)


def record_host(store: Store, host_id: str, batch: Batch, source: DeviceSource, device_ids: dict[int, int],
                recorded: frozenset[tuple[int, float]] | None) -> frozenset[tuple[int, float]] | None:
    """Heartbeat, lost and returned devices (found ones added to `device_ids`), and the processes seen in this batch.
    `recorded` is the processes recorded last time; returns what is recorded now."""
    with store.session() as session:
        touch_host(session, host_id)
        for index in batch.lost:
            if index in device_ids and mark_device_lost(session, device_ids[index]):
                log.error("device %d of host %s was lost under running jobs: see their device_lost actions "
                          "(`fleetlens` dashboard, enforcement); nothing was stopped", index, host_id)
        if batch.found:
            device_ids.update(register_devices(session, host_id, specs_of(source, batch.found), source=source.name,
                                               moved_here=True))
        if not (batch.seen or batch.rows):
            return recorded
        keys = frozenset((p.pid, p.start_time) for p in batch.seen.values())
        if keys == recorded:
            # the same processes as last time: one UPDATE instead of a row-by-row reconciliation
            touch_open_processes(session, host_id)
        else:
            seen = [SeenProcess(p.pid, p.start_time, p.workflow_id, p.cmdline, p.username)
                    for p in batch.seen.values()]
            record_processes(session, host_id, seen)
            recorded = keys
    return recorded


def batch_device_ids(store: Store, payload: dict[str, Any], host_id: str, own_ids: dict[int, int],
                     uuids_now: Callable[[], dict[int, str]]) -> dict[int, int]:
    """{device index: device id} for the rows of a batch (fresh or spooled) of `host_id`'s agent, whose devices are
    `own_ids` and, numbered as the source numbers them now, `uuids_now()`."""
    batch_host = payload["host_id"]
    ids = own_ids if batch_host == host_id else {}
    indexes = {row[0] for row in payload["devices"]} | {row[0] for row in payload["processes"]}
    uuids = {int(i): u for i, u in (payload.get("device_uuids") or {}).items()}
    if uuids and not (batch_host == host_id and uuids.items() <= uuids_now().items()):
        # spooled before the devices were numbered otherwise (a reboot): each row's device is found by its UUID
        ids = _ids_by_uuid(store, batch_host, uuids)
    elif not indexes <= ids.keys():
        ids = {**ids, **_known_devices(store, batch_host)}
    return ids


def _known_devices(store: Store, host_id: str) -> dict[int, int]:
    with store.session() as session:
        return device_ids(session, host_id)


def _ids_by_uuid(store: Store, host_id: str, uuids: dict[int, str]) -> dict[int, int]:
    """{index the batch used: device id} for the batch's devices, found by UUID (one not registered is left out,
    its rows dropped and counted, rather than written to the device that has its index now)."""
    with store.session() as session:
        by_uuid = device_ids_by_uuid(session, host_id, uuids.values())
    return {i: by_uuid[u] for i, u in uuids.items() if u in by_uuid}
