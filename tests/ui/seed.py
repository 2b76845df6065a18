"""A small, realistic fleet written through the ORM and store.ingest, for the dashboard's tests and screenshot."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from sqlalchemy import update

from store.db import Store
from store.ingest import write_samples
from store.models import (
    Action,
    ActionEvent,
    Device,
    Finding,
    Host,
    HostStorage,
    Lane,
    Placement,
    Plan,
    Rollup,
    StepStat,
    Team,
    Trace,
    Workflow,
)

GIB = 1024**3
HOUR = 3600.0
DEVICE_MEMORY = 80 * GIB
SHARED_CHECKPOINTS = "file:///mnt/shared/checkpoints"  # a fleet's shared checkpoint location
# workflow -> (team, devices it runs on (host, index), utilisation, memory GiB)
WORKFLOWS = {
    "resnet50-train": ("vision", [("gpu-a", 0), ("gpu-a", 1)], 0.82, 61),
    "bert-finetune": ("nlp", [("gpu-a", 2)], 0.35, 22),
    "notebook-alice": ("nlp", [("gpu-b", 0)], 0.02, 9),
    "llm-eval": ("research", [("gpu-b", 1), ("gpu-b", 2)], 0.55, 70),
}
HOSTS = {"gpu-a": 4, "gpu-b": 4}


@dataclass
class Seeded:
    now: float
    device_ids: dict[tuple[str, int], int] = field(default_factory=dict)
    finding_ids: dict[str, int] = field(default_factory=dict)
    plan_ids: dict[str, int] = field(default_factory=dict)
    action_id: int = 0
    trace_id: int = 0


def seed(store: Store, now: float | None = None, raw_hours: float = 2.0, rollup_days: int = 7) -> Seeded:
    now = time.time() if now is None else now
    out = Seeded(now=now)
    with store.session() as s:
        for host in HOSTS:
            s.add(Host(id=host, hostname=f"{host}.cluster", source="nvml", agent_version="0.1.0", agent_pid=100,
                       started_at=now - 8 * 86400, last_seen=now - (5 if host == "gpu-a" else 15), labels={}))
        s.flush()
        for host, n in HOSTS.items():
            for i in range(n):
                d = Device(host_id=host, index=i, uuid=f"GPU-{host}-{i}", name="NVIDIA A100-SXM4-80GB",
                           source="nvml", memory_total=DEVICE_MEMORY, state="ok", registered_at=now - 8 * 86400,
                           last_seen=now - 8 * 86400)  # when its agent registered it: its heartbeat says it lives
                s.add(d)
                s.flush()
                out.device_ids[(host, i)] = d.id
        s.add_all([Team(name="vision", movable=True), Team(name="nlp", movable=False),
                   Team(name="research", movable=True)])
        for wid, (team, _, _, _) in WORKFLOWS.items():
            s.add(Workflow(id=wid, name=wid, team=team, owner=f"{team}-lead", labels={},
                           managed=wid != "notebook-alice",
                           movable=False, state="running", created_at=now - 8 * 86400, last_seen=now - 30,
                           gpus=1, mem_persistent=8 * GIB, mem_ephemeral=4 * GIB,
                           checkpoint_url=SHARED_CHECKPOINTS if wid != "notebook-alice" else None))
        # every host's agent has just said it can read the shared checkpoint location, so moves between hosts
        # may be planned and applied
        s.add_all([HostStorage(host_id=host, url=SHARED_CHECKPOINTS, readable=True, checked_at=now) for host in HOSTS])
        s.flush()
        _rollups(s, out, now, rollup_days)
        _steps(s, now)
        _findings(s, out, now)
        _traces(s, out, now)
        _enforcement(s, out, now)
    _raw_samples(store, out, now, raw_hours)
    return out


def _util(wid: str, ts: float) -> float:
    base = WORKFLOWS[wid][2]
    return max(0.0, min(1.0, base + 0.1 * math.sin(ts / 900.0)))


def _raw_samples(store: Store, out: Seeded, now: float, hours: float) -> None:
    on_device = {out.device_ids[dev]: wid for wid, (_, devs, _, _) in WORKFLOWS.items() for dev in devs}
    dev_rows, proc_rows = [], []
    start = now - hours * HOUR
    t = start
    while t < now:
        for (host, _), did in out.device_ids.items():
            wid = on_device.get(did)
            util = _util(wid, t) if wid else 0.0
            mem = WORKFLOWS[wid][3] * GIB if wid else 0
            dev_rows.append({"device_id": did, "ts": t, "gpu_util": util, "mem_util": util / 2, "mem_used": mem,
                             "mem_total": DEVICE_MEMORY, "power_w": 90 + 300 * util, "temperature_c": 40 + 30 * util,
                             "sm_active": util * 0.8})
            if wid:
                proc_rows.append({"device_id": did, "workflow_id": wid, "host_id": host, "pid": 1000 + did, "ts": t,
                                  "mem_used": mem, "sm_util": util})
        t += 60.0
    write_samples(store, dev_rows, proc_rows)


def _rollups(s, out: Seeded, now: float, days: int) -> None:
    on_device = {out.device_ids[dev]: wid for wid, (_, devs, _, _) in WORKFLOWS.items() for dev in devs}
    last_hour = math.floor(now / HOUR) * HOUR - HOUR
    for h in range(days * 24):
        hour = last_hour - h * HOUR
        for did in out.device_ids.values():
            wid = on_device.get(did)
            util = _util(wid, hour) if wid else 0.0
            s.add(Rollup(scope="device", subject=str(did), hour=hour, team=WORKFLOWS[wid][0] if wid else None,
                         samples=60, gpu_hours_held=1.0 if wid else 0.0, gpu_hours_active=util if wid else 0.0,
                         util_mean=util, util_p95=min(1.0, util + 0.1), sm_active_mean=util * 0.8,
                         mem_peak=WORKFLOWS[wid][3] * GIB if wid else 0, mem_total=DEVICE_MEMORY, computed_at=now))
        for wid, (team, devs, _, mem) in WORKFLOWS.items():
            util = _util(wid, hour)
            s.add(Rollup(scope="workflow", subject=wid, hour=hour, team=team, samples=60 * len(devs),
                         gpu_hours_held=float(len(devs)), gpu_hours_active=util * len(devs), util_mean=util,
                         util_p95=min(1.0, util + 0.1), sm_active_mean=util * 0.8, mem_peak=mem * GIB,
                         mem_total=DEVICE_MEMORY, computed_at=now))


def _steps(s, now: float) -> None:
    for k in range(24):
        end = now - (24 - k) * 300
        mean = 0.210 + 0.01 * math.sin(k)
        s.add(StepStat(workflow_id="resnet50-train", host_id="gpu-a", pid=1001, rank=0, ts_start=end - 300,
                       ts_end=end, first_step=k * 1000, last_step=k * 1000 + 999, n_steps=1000, mean_s=mean,
                       p50_s=mean * 0.98, p95_s=mean * 1.3, max_s=mean * 2, mem_persistent=8 * GIB,
                       mem_peak=12 * GIB))


def _findings(s, out: Seeded, now: float) -> None:
    specs = [
        ("idle_holder", "notebook-alice", "high", "telemetry", "Notebook holds a GPU at 2% utilisation",
         "Release the GPU when idle, or run the notebook on a shared lane.", 22.1),
        ("dataloader_stall", "bert-finetune", "medium", "trace", "GPU waits 41% of each step for the data loader",
         "Raise DataLoader num_workers to 8 and set pin_memory=True.", 8.4),
        ("memory_overprovisioned", "llm-eval", "low", "telemetry", "Peak memory is 70 of 80 GiB on 2 devices",
         "Pack with a small job: a 10 GiB lane fits next to it.", 1.5),
    ]
    for rule, wid, sev, src, title, fix, cost in specs:
        # what the waste function needs: a telemetry finding's device and held time, a trace finding's share of step
        device = out.device_ids[WORKFLOWS[wid][1][0]] if src == "telemetry" else None
        need = ({"held_hours": 24.0, "window_hours": 24.0} if src == "telemetry"
                else {"cost_fraction": cost / 24.0, "gpus": 1})
        f = Finding(fingerprint=f"{rule}|{wid}|", workflow_id=wid, rule=rule, source=src, severity=sev, title=title,
                    evidence={"window": "last 24 h", "util_mean": WORKFLOWS[wid][2], **need}, fix=fix,
                    device_id=device,
                    gpu_hours_per_day=cost, status="open", created_at=now - 7200, updated_at=now - 3600,
                    location="step 1200-1210" if src == "trace" else None,
                    cost_s_per_step=0.087 if src == "trace" else None)
        s.add(f)
        s.flush()
        out.finding_ids[rule] = f.id


def _traces(s, out: Seeded, now: float) -> None:
    t = Trace(workflow_id="bert-finetune", host_id="gpu-a", rank=0, path="/traces/bert-finetune/rank0.json",
              size_bytes=12_000_000, steps=10, created_at=now - 5400, status="analyzed", analyzed_at=now - 5300,
              summary=trace_summary())
    s.add(t)
    s.flush()
    out.trace_id = t.id


def _move(wid: str, src: int, dst: int, slowdown: float, lane_gib: int, rules: list[str]) -> dict:
    """A move as enforcer.planner records it (the fields of its Move dataclass)."""
    return {"workflow_id": wid, "from_device_id": src, "to_device_id": dst, "to_lane_id": None,
            "new_lane": f"{dst}:new", "lane_size": lane_gib * GIB, "p_prime": int(lane_gib * 0.6 * GIB),
            "ephemeral": int(lane_gib * 0.3 * GIB), "util": 0.3, "compute_share": 0.5,
            "expected_slowdown": slowdown, "rules": rules}


def trace_summary() -> dict:
    """One rank's summary in analyzer.traces.summary's shape (the parts the dashboard draws)."""
    steps = []
    for k in range(10):
        comp, comm, mem, idle = 61_000 + 900 * k, 9_000, 8_000, 57_000 - 600 * k
        steps.append({"step": k, "step_us": comp + comm + mem + idle, "computation_us": comp,
                      "communication_us": comm, "memory_us": mem, "idle_us": idle,
                      "dataloader_us": idle * 0.8, "sync_us": idle * 0.15})
    total = sum(r["step_us"] for r in steps)
    fractions = {p: sum(r[f"{p}_us"] for r in steps) / total for p in ("computation", "communication", "memory",
                                                                         "idle")}
    return {"path": "/traces/bert-finetune/rank0.json", "rank": 0, "n_steps": 10, "has_gpu": True,
            "breakdown": steps, "fractions": fractions,
            "top_kernels": [{"name": "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", "kind": "gemm",
                             "count": 960, "total_us": 412_000.0, "mean_us": 429.2, "max_us": 611.0, "share": 0.58},
                            {"name": "vectorized_elementwise_kernel", "kind": "elementwise", "count": 4100,
                             "total_us": 151_000.0, "mean_us": 36.8, "max_us": 90.0, "share": 0.21},
                            {"name": "reduce_kernel", "kind": "reduction", "count": 880, "total_us": 98_000.0,
                             "mean_us": 111.4, "max_us": 200.0, "share": 0.14}]}


def _enforcement(s, out: Seeded, now: float) -> None:
    dev = out.device_ids
    # every job where it runs now; the notebook was packed into a lane on gpu-b/0 by the plan applied 3 days ago
    for wid, (_, devices, _, mem) in WORKFLOWS.items():
        for host, index in devices:
            s.add(Placement(workflow_id=wid, device_id=dev[(host, index)], host_id=host, pid=1000 + dev[(host, index)],
                            mem_persistent=int(mem * 0.7 * GIB), mem_ephemeral=int(mem * 0.3 * GIB),
                            compute_share=1.0, state="active", started_at=now - 8 * 86400))
    applied = Plan(created_at=now - 3 * 86400, policy="pack", applied=True, devices_freed=2,
                   moves=[_move("notebook-alice", dev[("gpu-b", 3)], dev[("gpu-b", 0)], 1.05, 14, ["idle_holder"])],
                   summary={"moves": 1, "devices_freed": 2})
    pack = Plan(created_at=now - 600, policy="pack", applied=False, devices_freed=1, summary={"moves": 1},
                moves=[_move("bert-finetune", dev[("gpu-a", 2)], dev[("gpu-b", 0)], 1.22, 30, ["dataloader_stall"])])
    fair = Plan(created_at=now - 600, policy="fair", applied=False, devices_freed=1, summary={"moves": 1},
                moves=[_move("bert-finetune", dev[("gpu-a", 2)], dev[("gpu-b", 1)], 1.08, 30, ["dataloader_stall"])])
    # earlier cycles that freed devices, so "devices freed over time" has a history
    history = [Plan(created_at=now - hours * HOUR, policy=policy, applied=True, devices_freed=n, moves=[],
                    summary={"devices_freed": n})
               for hours, policy, n in ((30, "fair", 1), (18, "pack", 2), (9, "pack", 1), (2, "fair", 1))]
    s.add_all([applied, pack, fair, *history])
    s.flush()
    out.plan_ids = {"applied": applied.id, "pack": pack.id, "fair": fair.id}
    lane = Lane(device_id=dev[("gpu-b", 0)], size_bytes=14 * GIB, compute_share=0.5, state="open",
                created_at=now - 3 * 86400)
    spare = Lane(device_id=dev[("gpu-b", 0)], size_bytes=20 * GIB, compute_share=0.5, state="open",
                 created_at=now - 3 * 86400)
    s.add_all([lane, spare])
    s.flush()
    s.execute(update(Placement).where(Placement.workflow_id == "notebook-alice").values(
        lane_id=lane.id, compute_share=0.5))
    a = Action(plan_id=applied.id, workflow_id="notebook-alice", policy="pack", from_device_id=dev[("gpu-b", 3)],
               to_device_id=dev[("gpu-b", 0)], to_lane_id=lane.id, state="resumed", expected_slowdown=1.05,
               checkpoint_path="/ckpt/notebook-alice/step-1200.pt", checkpoint_step=1200, attempts=1,
               created_at=now - 3 * 86400, updated_at=now - 3 * 86400 + 95)
    s.add(a)
    s.flush()
    out.action_id = a.id
    states = [None, "planned", "checkpoint_requested", "checkpointed", "stopped", "relaunched", "resumed"]
    offsets = [0, 2, 31, 40, 70, 95]
    for k, offset in enumerate(offsets):
        s.add(ActionEvent(action_id=a.id, ts=a.created_at + offset, from_state=states[k], to_state=states[k + 1],
                          message=f"{states[k + 1].replace('_', ' ')}", detail={}))
