"""Reader for Alibaba's openb GPU-sharing trace (cluster-trace-gpu-v2023): the pod list and the GPU node list."""

from __future__ import annotations

from pathlib import Path

from enforcer.sim.model import GIB, NodeSpec, ReadReport, SimJob, Trace
from enforcer.sim.readers.common import numeric, read_csv

POD_COLUMNS = ("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time")
NODE_COLUMNS = ("sn", "gpu", "model")
NODE_FILE = "openb_node_list_gpu_node.csv"

# The trace gives no device memory (and anonymises two models, G2 and G3); openb pods ask for a share of a
# device (gpu_milli), never for bytes, so every device gets the same nominal memory and a pod's lane is its
# share of it: the figure changes no placement.
DEVICE_MEM = 32 * GIB


def read_openb_nodes(path: Path) -> tuple[list[NodeSpec], ReadReport]:
    """The GPU nodes of the openb node list (CPU-only nodes are not in the file)."""
    df, bad_lines = read_csv(path, "openb node list", NODE_COLUMNS)
    report = ReadReport(str(path), rows=len(df) + bad_lines)
    report.skip("malformed", bad_lines)
    df, bad = numeric(df, ["gpu"])
    report.skip("malformed", bad)
    nodes = []
    for sn, gpu, model in zip(df["sn"], df["gpu"], df["model"], strict=True):
        if gpu <= 0 or gpu != int(gpu):
            report.skip("malformed")
            continue
        nodes.append(NodeSpec(str(sn), int(gpu), DEVICE_MEM, str(model).strip()))
    report.jobs = len(nodes)
    return nodes, report


def read_openb(path: Path, nodes_path: Path | None = None) -> Trace:
    """The openb pod list as a trace: one job per GPU pod that was scheduled.

    arrival = creation_time, work = deletion_time - scheduled_time (the time it held its GPUs), a pod of one
    GPU asks for share = gpu_milli / 1000, a pod of several GPUs for whole devices. CPU-only pods
    (num_gpu = 0) and pods never scheduled (pod_phase Pending, no scheduled_time) are skipped and counted.
    The cluster is the node list next to the pod list (or `nodes_path`).
    """
    path = Path(path)
    df, bad_lines = read_csv(path, "openb pod list", POD_COLUMNS)
    report = ReadReport(str(path), rows=len(df) + bad_lines)
    report.skip("malformed", bad_lines)
    df, bad = numeric(df, ["num_gpu", "gpu_milli", "creation_time", "deletion_time"], ["scheduled_time"])
    report.skip("malformed", bad)
    jobs: list[SimJob] = []
    for name, num_gpu, milli, created, deleted, scheduled in zip(
        df["name"], df["num_gpu"], df["gpu_milli"], df["creation_time"], df["deletion_time"], df["scheduled_time"],
        strict=True,
    ):
        if num_gpu < 0 or num_gpu != int(num_gpu) or not 0 <= milli <= 1000:
            report.skip("malformed")
            continue
        if num_gpu == 0:
            report.skip("cpu_only")
            continue
        if scheduled != scheduled:  # NaN: the pod never ran
            report.skip("never_scheduled")
            continue
        work = float(deleted - scheduled)
        if work <= 0 or milli == 0:
            report.skip("zero_duration" if work <= 0 else "malformed")
            continue
        share = milli / 1000.0 if num_gpu == 1 else 1.0
        jobs.append(SimJob(str(name), float(created), work, gpus=int(num_gpu), share=share))
    report.jobs = len(jobs)
    nodes_path = Path(nodes_path) if nodes_path else path.with_name(NODE_FILE)
    cluster = None
    notes: dict = {}
    if nodes_path.is_file():
        cluster, node_report = read_openb_nodes(nodes_path)
        notes["nodes"] = node_report.as_dict()
    return Trace("openb", jobs, cluster, report, notes)
