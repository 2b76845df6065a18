"""Fake Slurms at the command line's boundary, without a cluster. `SlurmAnswers` answers `squeue --json` and
`sinfo --json` with the jobs and nodes a test sets (the importer's view). `FakeSlurm`, for the actuator's steps, prints
Slurm 22.05's JSON (openapi v0.0.38, the fields fleetlens reads, as the real cluster prints them)
of the jobs a test sets, and the commands a move sends are recorded and carried out on those jobs as slurmctld does
(requeuehold: pending, held, one restart more; update: the new request; release: no longer held). What Slurm does on
its own (starting a released job, someone else's release) the test does with `start`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from store.slurm_cli import SlurmCli

META = {"plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"},
        "Slurm": {"version": {"major": 22, "micro": 8, "minor": 5}, "release": "22.05.8"}}
NODE = "gpu01"


@dataclass(frozen=True)
class FakeSlurm(SlurmCli):
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)
    node_gres: str = "gpu:4,shard:16"
    sent: list[tuple[str, ...]] = field(default_factory=list)
    # the node's state as sinfo --json gives it (a test drains it or sets it down by changing these)
    node_state: dict[str, Any] = field(default_factory=lambda: {"state": "mixed", "state_flags": [], "reason": ""})

    def submit(self, job_id: int, gres: str, *, gpu: int = 0, restart: int = 0, submit_time: float = 1000.0) -> None:
        """A running job that opted in by its comment, on GPU `gpu` of the node."""
        self.jobs[job_id] = {"job_id": job_id, "job_state": "PENDING", "state_reason": "None", "name": "t",
                             "user_name": "root", "account": "", "partition": "debug", "requeue": True,
                             "comment": "fleetlens:movable", "tres_per_node": f"gres:{gres}", "restart_cnt": restart,
                             "submit_time": submit_time, "time_limit": None, "nodes": "", "batch_host": "",
                             "gres_detail": []}
        self.start(job_id, gpu=gpu)

    def start(self, job_id: int, *, gpu: int = 0) -> None:
        """Slurm starts the job (after a release, its own or someone else's) on GPU `gpu`."""
        job = self.jobs[job_id]
        gres = job["tres_per_node"].removeprefix("gres:")
        job.update(job_state="RUNNING", state_reason="None", nodes=NODE, batch_host=NODE,
                   gres_detail=[f"{gres}(IDX:{gpu})"])

    def run(self, name: str, *args: str) -> str:
        if name in ("squeue", "sinfo"):
            if name == "sinfo":
                return json.dumps({"meta": META, "errors": [], "nodes": [
                    {"name": NODE, **self.node_state, "gres": self.node_gres, "partitions": ["debug"]}]})
            return json.dumps({"meta": META, "errors": [], "jobs": list(self.jobs.values())})
        self.sent.append((name, *args))
        if name == "scontrol" and args[0] in ("requeuehold", "hold", "release"):
            job = self.jobs[int(args[1])]
            if args[0] == "requeuehold":
                job.update(restart_cnt=job["restart_cnt"] + 1, nodes="", batch_host="", gres_detail=[])
            job.update(job_state="PENDING", state_reason="None" if args[0] == "release" else "JobHeldUser")
        elif name == "scontrol" and args[0] == "update":
            opts = dict(a.split("=", 1) for a in args[1:])
            self.jobs[int(opts["jobid"])]["tres_per_node"] = f"gres:{opts['gres']}"
        return ""

    def json(self, name: str, *args: str) -> dict[str, Any]:
        return json.loads(self.run(name, *args, "--json"))


class SlurmAnswers:
    """A SlurmCli's `json` for the importer: `jobs` is what squeue lists now, `nodes` what sinfo does (Slurm 22.05's
    JSON, openapi v0.0.38)."""

    def __init__(self, nodes: list[dict[str, Any]] | None = None) -> None:
        self.jobs: list[dict[str, Any]] = []
        self.nodes = nodes if nodes is not None else [{"name": "n1", "state": "mixed", "partitions": ["gpu"],
                                                       "gres": "gpu:4,shard:8"}]

    def json(self, name: str, *args: str) -> dict[str, Any]:
        key, value = ("nodes", self.nodes) if name == "sinfo" else ("jobs", self.jobs)
        return {"meta": META, "errors": [], key: value}
