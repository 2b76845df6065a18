"""Slurm's command line as the importer sees it, without a cluster: `squeue --json` and `sinfo --json` answers as
Slurm 22.05 prints them (openapi v0.0.38), set by the test."""

from __future__ import annotations

from typing import Any

META = {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}


class FakeSlurm:
    """A SlurmCli's `json`: `jobs` is what squeue lists now, `nodes` what sinfo does."""

    def __init__(self, nodes: list[dict[str, Any]] | None = None) -> None:
        self.jobs: list[dict[str, Any]] = []
        self.nodes = nodes if nodes is not None else [{"name": "n1", "state": "mixed", "partitions": ["gpu"],
                                                       "gres": "gpu:4,shard:8"}]

    def json(self, name: str, *args: str) -> dict[str, Any]:
        key, value = ("nodes", self.nodes) if name == "sinfo" else ("jobs", self.jobs)
        return {"meta": META, "errors": [], key: value}
