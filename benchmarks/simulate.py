"""Simulator figures, one JSON line per case: Salus SRTF vs FIFO, openb PACK vs exclusive, Alibaba devices, speed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FLEET = ROOT.parent / "shared" / "data" / "fleet"

from enforcer.interference import holdout_error  # noqa: E402
from enforcer.sim.runner import DEFAULT_POLICIES, read_trace, simulate  # noqa: E402


def emit(case: dict) -> None:
    print(json.dumps(case), flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    log("salus: SRTF vs FIFO on one shared device")
    for load in (1.0, 1.5):
        tr = read_trace("salus", FLEET / "salus_workloads.csv", n_jobs=100, seed=0, load=load)
        fifo, srtf = simulate(tr, ["fifo", "srtf"], one_lane=True)
        emit({
            "case": "salus_srtf_vs_fifo", "jobs": 100, "seed": 0, "offered_load": load,
            "fifo_mean_jct_s": round(fifo.metrics["jct_mean_s"], 1),
            "srtf_mean_jct_s": round(srtf.metrics["jct_mean_s"], 1),
            "ratio": round(fifo.metrics["jct_mean_s"] / srtf.metrics["jct_mean_s"], 2), "anchor_salus": 3.19,
            "note": "Salus's 3.19x is on its production-trace workload and arrivals on a real GPU; ours draws 100 "
                    "jobs from Salus's workloads file (1-11 min each) with Poisson arrivals at the offered load shown, "
                    "SRTF preempts at iteration granularity with no switching cost, FIFO runs one job at a time. "
                    "The ratio depends on the load (1.46x at 1.0, 1.31x at 1.5 here) "
                    "and on the spread of job lengths: this file spans only 1-11 min.",
        })
    log("openb: PACK vs exclusive")
    tr = read_trace("openb", FLEET / "openb_pod_list_default.csv")
    fifo, pack = simulate(tr, ["fifo", "pack"])
    emit({
        "case": "openb_pack_vs_exclusive", "pods_read": tr.report.rows, "gpu_pods_simulated": len(tr.jobs),
        "skipped": dict(tr.report.skipped), "gpus": fifo.metrics["devices"],
        "exclusive_device_hours": round(fifo.metrics["device_hours"], 1),
        "pack_device_hours": round(pack.metrics["device_hours"], 1),
        "ratio": round(fifo.metrics["device_hours"] / pack.metrics["device_hours"], 3),
        "exclusive_devices_needed": fifo.metrics["devices_needed"],
        "pack_devices_needed": pack.metrics["devices_needed"],
        "pack_fragmentation": round(pack.metrics["fragmentation"], 4),
        "pack_frag_gpus": round(pack.metrics["frag_gpus"], 3),
        "exclusive_fragmentation": round(fifo.metrics["fragmentation"], 4),
        "note": "replayed in time (creation -> arrival, deletion - scheduled -> run time); fragmentation = "
                "unallocated share on partially allocated devices over allocated device-time",
    })
    log("alibaba: devices needed")
    tr = read_trace("alibaba", FLEET)
    fifo, pack = simulate(tr, ["fifo", "pack"])
    emit({
        "case": "alibaba_pack_devices", "containers": len(tr.jobs), "one_device_per_container": len(tr.jobs),
        "exclusive_peak_devices": fifo.metrics["devices_needed"], "pack_devices_needed": pack.metrics["devices_needed"],
        "ratio": round(len(tr.jobs) / pack.metrics["devices_needed"], 2),
        "pack_device_hours": round(pack.metrics["device_hours"], 1),
        "exclusive_device_hours": round(fifo.metrics["device_hours"], 1),
        "pack_stretch_mean": round(pack.metrics["stretch_mean"], 3),
        "note": "per container: p95 utilisation and peak memory; 80 GiB devices; PACK's lanes keep Salus's "
                "1.1 x 1.05 memory headroom and its slowdown cap 1.5",
    })
    log("interference estimate held-out error")
    err = holdout_error(FLEET)
    emit({"case": "interference_holdout", **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in err.items()}})
    log("speed: the whole openb trace under each policy")
    tr = read_trace("openb", FLEET / "openb_pod_list_default.csv")
    for name in DEFAULT_POLICIES:
        t0 = time.perf_counter()
        (r,) = simulate(tr, [name])
        wall = time.perf_counter() - t0
        emit({"case": "openb_speed", "policy": name, "pods": tr.report.rows, "gpu_pods": len(tr.jobs),
              "gpus": r.metrics["devices"], "events": r.metrics["events"], "seconds": round(wall, 2),
              "target_s": 10, "ratio": round(wall / 10, 2)})


if __name__ == "__main__":
    main()
