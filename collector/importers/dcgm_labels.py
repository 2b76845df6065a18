"""dcgm-exporter's labels read as fleetlens's hosts, devices and workflows."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from collector.dcgm_names import (
    CONTAINER,
    DEVICE,
    GPU,
    HOSTNAME,
    MIG_INSTANCE,
    MIG_PROFILE,
    MODEL,
    NAMESPACE,
    POD,
    SLURM_JOB_LABELS,
    UUID,
    WORKFLOW,
)
from store.settings import Settings

SOURCE = "prometheus"  # the source of imported hosts and devices, and the id source of a workflow an agent named
PID_BASE = 1 << 30  # synthetic pids (dcgm-exporter sees no processes), above any real pid_max
MIG_INDEX_BASE = 1000  # a MIG instance's device index: (gpu + 1) * 1000 + GPU_I_ID, apart from whole GPUs


@dataclass(frozen=True)
class DeviceKey:
    host: str
    index: int
    uuid: str
    name: str


@dataclass(frozen=True)
class WorkflowKey:
    id: str
    id_source: str
    team: str | None
    labels: tuple[tuple[str, str], ...]


def device_of(labels: dict[str, str]) -> DeviceKey | str:
    """The device a series belongs to, or why it has none."""
    host = labels.get(HOSTNAME) or (labels.get("instance") or "").rsplit(":", 1)[0]
    if not host:
        return "without a Hostname or instance label"
    gpu, uuid = labels.get(GPU), labels.get(UUID)
    if gpu is None and not uuid:
        return "without a gpu or UUID label"
    try:
        index = int(gpu) if gpu is not None else int(hashlib.sha1(uuid.encode()).hexdigest()[:6], 16) % 900
    except ValueError:
        return "with a gpu label that is not a number"
    model = labels.get(MODEL) or "GPU (dcgm-exporter)"
    uuid = uuid or f"{host}:{labels.get(DEVICE) or f'gpu{index}'}"
    instance = labels.get(MIG_INSTANCE)
    if instance not in (None, ""):
        try:
            gi = int(instance)
        except ValueError:
            return "with a GPU_I_ID label that is not a number"
        profile = labels.get(MIG_PROFILE) or f"instance {gi}"
        return DeviceKey(host, (index + 1) * MIG_INDEX_BASE + gi, f"{uuid}/gi{gi}", f"{model} MIG {profile}")
    return DeviceKey(host, index, uuid, model)


def workflow_of(labels: dict[str, str], settings: Settings) -> WorkflowKey | None:
    """The workflow using the device in this series: the workflow a fleetlens agent named, else its HPC (Slurm) job,
    else its Kubernetes pod, else none."""
    team_value = labels.get(settings.prometheus_team_label) or None
    team = settings.prometheus_teams.get(team_value, team_value) if team_value else None
    if labels.get(WORKFLOW):  # a fleetlens agent's /metrics: its own name and team
        kept = tuple((k, labels[k]) for k in (NAMESPACE, POD) if labels.get(k))
        return WorkflowKey(labels[WORKFLOW], SOURCE, labels.get("team") or team, kept)
    for name in SLURM_JOB_LABELS:
        if labels.get(name):
            return WorkflowKey(f"slurm-{labels[name]}", "slurm", team, ((name, labels[name]),))
    pod = labels.get(POD)
    if pod:
        namespace = labels.get(NAMESPACE) or "default"
        kept = tuple((k, labels[k]) for k in (NAMESPACE, POD, CONTAINER) if labels.get(k))
        return WorkflowKey(f"k8s-{namespace}/{pod}", "k8s", team, kept)
    return None


def synthetic_pid(workflow_id: str, uuid: str) -> int:
    digest = hashlib.sha1(f"{workflow_id}\0{uuid}".encode()).hexdigest()
    return PID_BASE + int(digest[:7], 16) % (1 << 29)


