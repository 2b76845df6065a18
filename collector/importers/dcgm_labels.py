"""dcgm-exporter's labels read as fleetlens's hosts, devices and workflows.

The labels are first put back as dcgm-exporter wrote them (`as_written`): the host in `hostname` (today) or
`Hostname` (before dcgm-exporter's 2026 rename); under kube-prometheus-stack (a ServiceMonitor without honorLabels,
so Prometheus's honor_labels: false) the workload's pod, namespace and container in `exported_pod`,
`exported_namespace` and `exported_container`, while `pod`, `namespace` and `container` are the dcgm-exporter pod's
own; and dcgm-exporter 1.x's `uuid`, `pod_name`, `pod_namespace` and `container_name`. A series whose pod is the
exporter's own (a GPU no workload uses, scraped through kube-prometheus) has no workflow.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from collector.dcgm_names import (
    CONTAINER,
    DEVICE,
    EXPORTED_PREFIX,
    GPU,
    HOSTNAME,
    MIG_INSTANCE,
    MIG_PROFILE,
    MODEL,
    NAMESPACE,
    OLD_CONTAINER,
    OLD_HOSTNAME,
    OLD_NAMESPACE,
    OLD_POD,
    OLD_UUID,
    POD,
    SLURM_JOB_LABELS,
    UUID,
    WORKFLOW,
)
from store.settings import Settings

SOURCE = "prometheus"  # the source of imported hosts and devices, and the id source of a workflow an agent named
PID_BASE = 1 << 30  # synthetic pids (dcgm-exporter sees no processes), above any real pid_max
MIG_INDEX_BASE = 1000  # a MIG instance's device index: (gpu + 1) * 1000 + GPU_I_ID, apart from whole GPUs
# a GPU known by its UUID alone (no gpu label) gets an index from the UUID's hash, above any GPU's index (and its MIG
# instances' below 2**31): two such GPUs of a host share one with odds of 1 in 900,000 a pair
UUID_INDEX_BASE, UUID_INDEX_SPAN = 1_000_000, 900_000
K8S_LABELS = (POD, NAMESPACE, CONTAINER)
# the pod of dcgm-exporter itself (gpu-operator's nvidia-dcgm-exporter-xxxxx, the Helm chart's dcgm-exporter-xxxxx):
# a series labelled with it is a GPU no workload uses, labelled by Prometheus with its scrape target's pod
# (and fleetlens's own agent, deploy/kubernetes)
EXPORTER_POD = re.compile(r"dcgm-exporter|fleetlens-agent")


def target_of(labels: dict[str, str]) -> tuple[str, str]:
    """The scrape target a series came from."""
    return labels.get("job", ""), labels.get("instance", "")


def renamed_labels(labels: dict[str, str]) -> frozenset[str]:
    """Which of pod, namespace and container Prometheus renamed to exported_* on this series (honor_labels: false):
    the scrape target has a label of that name."""
    return frozenset(k for k in K8S_LABELS if EXPORTED_PREFIX + k in labels)


def as_written(labels: dict[str, str], target_labels: frozenset[str] = frozenset()) -> dict[str, str]:
    """The labels as dcgm-exporter wrote them (see the module's doc). `target_labels`: those of pod, namespace and
    container the scrape target has (renamed_labels of any of its series): on a series without exported_<name>,
    <name> is then the target's own, not the workload's."""
    out = dict(labels)
    for old, new in ((OLD_HOSTNAME, HOSTNAME), (OLD_UUID, UUID), (OLD_POD, POD), (OLD_NAMESPACE, NAMESPACE),
                     (OLD_CONTAINER, CONTAINER)):
        if not out.get(new) and out.get(old):
            out[new] = out[old]
    target_labels = target_labels | renamed_labels(labels)
    for name in K8S_LABELS:
        written = labels.get(EXPORTED_PREFIX + name)
        if written:
            out[name] = written
        elif name in target_labels:
            out.pop(name, None)  # the scrape target's, not the workload's
    if EXPORTER_POD.search(out.get(POD) or "") or EXPORTER_POD.search(out.get(CONTAINER) or ""):
        for name in K8S_LABELS:
            out.pop(name, None)
    return out


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
    """The device a series belongs to (labels as_written), or why it has none."""
    host = labels.get(HOSTNAME) or (labels.get("instance") or "").rsplit(":", 1)[0]
    if not host:
        return "without a hostname, Hostname or instance label"
    gpu, uuid = labels.get(GPU), labels.get(UUID)
    if gpu is None and not uuid:
        return "without a gpu or UUID label"
    try:
        index = int(gpu) if gpu is not None else \
            UUID_INDEX_BASE + int(hashlib.sha1(uuid.encode()).hexdigest()[:8], 16) % UUID_INDEX_SPAN
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
    """The workflow using the device in this series (labels as_written): the workflow a fleetlens agent named, else
    its HPC (Slurm) job, else its Kubernetes pod, else none."""
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


