"""The fleet cut into groups of devices for the detectors to read one at a time, so the analyzer's memory stays
bounded whatever the fleet's size. Every device a workflow used in the window falls in the same group (groups are
unions of the connected components of the workflow-device pairs), so each workflow is judged on all its samples."""

from __future__ import annotations

from sqlalchemy import select

from store.db import Store
from store.models import Device, ProcessSample


def device_chunks(store: Store, start: float, end: float, max_devices: int) -> list[list[int]]:
    """Groups of device ids of at most `max_devices` each (a workflow spanning more devices than that gets one
    group of its own), in device id order; the pairs are found by the database (one DISTINCT over the window)."""
    ts = ProcessSample.ts
    with store.session() as session:
        devices = list(session.scalars(select(Device.id).order_by(Device.id)))
        pairs = session.execute(select(ProcessSample.workflow_id, ProcessSample.device_id)
                                .where(ts >= start, ts < end).distinct()).all()
    parent: dict[int, int] = {int(d): int(d) for d in devices}

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    first_device: dict[str, int] = {}
    for workflow, device in pairs:
        device = int(device)
        parent.setdefault(device, device)
        if workflow in first_device:
            a, b = root(first_device[workflow]), root(device)
            if a != b:
                parent[max(a, b)] = min(a, b)
        else:
            first_device[workflow] = device
    components: dict[int, list[int]] = {}
    for d in sorted(parent):
        components.setdefault(root(d), []).append(d)
    chunks: list[list[int]] = []
    current: list[int] = []
    for members in components.values():
        if current and len(current) + len(members) > max_devices:
            chunks.append(current)
            current = []
        current = current + members
    if current:
        chunks.append(current)
    return chunks


def device_groups(store: Store, start: float, end: float, max_devices: int) -> list[list[int] | None]:
    """device_chunks for a reader: [None] (the whole fleet, read at once) when `max_devices` is 0 or the fleet fits
    one group."""
    groups: list[list[int] | None] = list(device_chunks(store, start, end, max_devices)) if max_devices > 0 else []
    return groups if len(groups) > 1 else [None]
