"""dcgm-exporter's metric and label names, and how each maps to a column of a device sample (both directions).

NVIDIA's dcgm-exporter publishes DCGM fields as Prometheus gauges named after the field (DCGM_FI_DEV_GPU_UTIL...),
in the field's own unit (percent, MiB, W, MHz, or a 0..1 ratio for the DCGM_FI_PROF_* fields), labelled with the
GPU (gpu, UUID, device, modelName, hostname; Hostname before the 2026 rename), a MIG instance (GPU_I_ID,
GPU_I_PROFILE) and, with the Kubernetes or HPC job mapping on, the pod, namespace, container or job using it. The
importer reads these names, and the agent's /metrics writes them, so a Grafana board built for dcgm-exporter shows
fleetlens's readings unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Field:
    """One dcgm-exporter metric: the sample column it fills, and the factor from its unit to the store's."""

    name: str
    column: str
    scale: float  # store value = metric value * scale
    help: str
    counter: bool = False  # cumulative: a drop is a reset (driver reload), not fewer events


# In the order the importer prefers when two fields fill one column (GPU_UTIL before GR_ENGINE_ACTIVE: MIG
# instances have only the latter; MEM_COPY_UTIL before DRAM_ACTIVE likewise).
FIELDS: tuple[Field, ...] = (
    Field("DCGM_FI_DEV_GPU_UTIL", "gpu_util", 0.01, "GPU utilization (in %)."),
    Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gpu_util", 1.0, "Ratio of time the graphics engine is active."),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", "mem_util", 0.01, "Memory utilization (in %)."),
    Field("DCGM_FI_PROF_DRAM_ACTIVE", "mem_util", 1.0, "Ratio of cycles the device memory interface is active."),
    Field("DCGM_FI_DEV_FB_USED", "mem_used", float(MIB), "Framebuffer memory used (in MiB)."),
    Field("DCGM_FI_DEV_FB_FREE", "mem_free", float(MIB), "Framebuffer memory free (in MiB)."),
    Field("DCGM_FI_DEV_FB_RESERVED", "mem_reserved", float(MIB), "Framebuffer memory reserved (in MiB)."),
    Field("DCGM_FI_DEV_POWER_USAGE", "power_w", 1.0, "Power draw (in W)."),
    Field("DCGM_FI_DEV_GPU_TEMP", "temperature_c", 1.0, "GPU temperature (in C)."),
    Field("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz", 1.0, "SM clock frequency (in MHz)."),
    Field("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "throttle_reasons", 1.0, "Current clock throttle reasons."),
    Field("DCGM_FI_PROF_SM_ACTIVE", "sm_active", 1.0, "The ratio of cycles an SM has at least 1 warp assigned."),
    Field("DCGM_FI_PROF_SM_OCCUPANCY", "sm_occupancy", 1.0, "The ratio of number of warps resident on an SM."),
    Field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor_active", 1.0, "Ratio of cycles the tensor pipe is active."),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "ecc_errors", 1.0, "Total number of double-bit volatile ECC errors.",
          counter=True),
    # dcgm-exporter's XID field is the code of the last XID error, not a count: the importer counts the changes
    # to a non-zero code (the store's xid_errors is a count of events)
    Field("DCGM_FI_DEV_XID_ERRORS", "xid_code", 1.0, "Value of the last XID error encountered."),
    # dcgm-exporter 1.x (NVIDIA/gpu-monitoring-tools) wrote lower-case names, still scraped by older fleets; read
    # after the current names, so a fleet half-way through an upgrade keeps its current series
    Field("dcgm_gpu_utilization", "gpu_util", 0.01, "GPU utilization (in %)."),
    Field("dcgm_mem_copy_utilization", "mem_util", 0.01, "Memory utilization (in %)."),
    Field("dcgm_fb_used", "mem_used", float(MIB), "Framebuffer memory used (in MiB)."),
    Field("dcgm_fb_free", "mem_free", float(MIB), "Framebuffer memory free (in MiB)."),
    Field("dcgm_power_usage", "power_w", 1.0, "Power draw (in W)."),
    Field("dcgm_gpu_temp", "temperature_c", 1.0, "GPU temperature (in C)."),
    Field("dcgm_sm_clock", "sm_clock_mhz", 1.0, "SM clock frequency (in MHz)."),
)
LEGACY = frozenset(f.name for f in FIELDS if f.name.islower())
BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}

# labels
# dcgm-exporter writes the host as `hostname` since its 2026 rename (NVIDIA/dcgm-exporter#655), `Hostname` before
HOSTNAME, OLD_HOSTNAME, GPU, UUID, MODEL, DEVICE = "hostname", "Hostname", "gpu", "UUID", "modelName", "device"
OLD_UUID = "uuid"  # dcgm-exporter 1.x
MIG_INSTANCE, MIG_PROFILE = "GPU_I_ID", "GPU_I_PROFILE"
POD, NAMESPACE, CONTAINER = "pod", "namespace", "container"
OLD_POD, OLD_NAMESPACE, OLD_CONTAINER = "pod_name", "pod_namespace", "container_name"  # dcgm-exporter 1.x
# Prometheus with honor_labels: false (kube-prometheus-stack's ServiceMonitor default) keeps the scrape target's own
# pod, namespace and container (the dcgm-exporter pod's) and renames those dcgm-exporter wrote to exported_*
EXPORTED_PREFIX = "exported_"
WORKFLOW = "workflow"  # fleetlens's agent labels its series with the workflow (and team) it attributed
# the agent's /metrics: 1 per (device, workflow using it), apart from the device's own DCGM series (one each)
DEVICE_WORKFLOW = "fleetlens_device_workflow"
# dcgm-exporter's HPC job mapping labels a GPU with `hpc_job`; some fleets relabel it for Slurm
SLURM_JOB_LABELS = ("hpc_job", "slurm_job_id", "slurm_job")
