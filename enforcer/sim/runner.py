"""Entry points: read a trace by kind, and run several policies over it side by side."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

from enforcer.interference import InterferenceModel, default_model
from enforcer.sim.adapter import make_policy
from enforcer.sim.engine import Simulation
from enforcer.sim.metrics import SimResult
from enforcer.sim.model import GIB, NodeSpec, Trace, uniform_cluster
from enforcer.sim.readers.alibaba import read_alibaba
from enforcer.sim.readers.openb import read_openb
from enforcer.sim.readers.salus import read_salus
from enforcer.sim.readers.store import read_store
from store.db import Store
from store.errors import InvalidInput
from store.settings import Settings

KINDS = ("openb", "salus", "alibaba", "store")
DEFAULT_POLICIES = ("fifo", "pack", "fair", "srtf", "tiresias")


def read_trace(kind: str, path: str | Path | None = None, *, settings: Settings | None = None,
               **options: Any) -> Trace:
    """The trace of `kind` (openb | salus | alibaba | store) at `path` (a database URL for store; without one, the
    store `settings` name)."""
    kind = kind.strip().lower()
    if kind == "openb":
        return read_openb(Path(path))
    if kind == "salus":
        return read_salus(Path(path), **options)
    if kind == "alibaba":
        return read_alibaba(Path(path), **options)
    if kind == "store":
        if not path and settings is None:
            raise InvalidInput("store: give the database URL, as store:URL")
        return read_store(Store(str(path)) if path else Store.from_settings(settings))
    raise InvalidInput(f"unknown trace kind {kind!r}; use one of {', '.join(KINDS)} as KIND:PATH")


def parse_nodes(spec: str) -> list[NodeSpec]:
    """`N[xD[xGIB]]`: N nodes of D devices (default 8) of GIB GiB each (default 80)."""
    m = re.fullmatch(r"\s*(\d+)(?:x(\d+)(?:x(\d+(?:\.\d+)?))?)?\s*", spec or "")
    if not m or int(m.group(1)) <= 0:
        raise InvalidInput(f"--nodes {spec!r}: expected N[xD[xGIB]], e.g. 16x8x80 (16 nodes of 8 devices of 80 GiB)")
    n, d, g = int(m.group(1)), int(m.group(2) or 8), float(m.group(3) or 80)
    if d <= 0 or g <= 0:
        raise InvalidInput(f"--nodes {spec!r}: devices per node and GiB must be positive")
    return uniform_cluster(n, d, int(g * GIB))


def simulate(
    trace: Trace,
    policies: list[str] | tuple[str, ...] = DEFAULT_POLICIES,
    *,
    cluster: list[NodeSpec] | None = None,
    migration_cost_s: float = 30.0,
    interference: InterferenceModel | None = None,
    one_lane: bool = False,
    check: bool = False,
) -> list[SimResult]:
    """Run each policy over the trace on `cluster` (default: the trace's own). Results in the order given."""
    if not 0 <= migration_cost_s < math.inf:
        raise InvalidInput(f"a migration's cost must be a finite number of seconds, 0 or more, not {migration_cost_s} "
                           "(--migration-cost)")
    cluster = cluster or trace.cluster
    if not cluster:
        raise InvalidInput(f"the {trace.kind} trace does not say what cluster it ran on; give --nodes N[xD[xGIB]]")
    model = interference or default_model()
    results = []
    for name in policies:
        policy = make_policy(name, one_lane=one_lane, model=model)
        t0 = time.perf_counter()
        result = Simulation(trace.jobs, cluster, policy, interference=model, migration_cost_s=migration_cost_s,
                            check=check).run()
        result.metrics["wall_s"] = time.perf_counter() - t0
        results.append(result)
    return results
