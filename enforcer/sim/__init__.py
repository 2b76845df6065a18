"""The fleet simulator: replay a job trace on a cluster under the enforcer's policies and measure the outcome."""

from enforcer.sim.metrics import SimResult
from enforcer.sim.model import NodeSpec, ReadReport, SimJob, Trace
from enforcer.sim.runner import DEFAULT_POLICIES, KINDS, parse_nodes, read_trace, simulate

__all__ = ["DEFAULT_POLICIES", "KINDS", "NodeSpec", "ReadReport", "SimJob", "SimResult", "Trace", "parse_nodes",
           "read_trace", "simulate"]
