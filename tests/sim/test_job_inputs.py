"""The simulator's inputs: a job or node whose numbers cannot be simulated is a clear error, never a hang or a job
silently lost; a reader skips and counts a row with a value that is not a finite number."""

from __future__ import annotations

import math

import pytest

from enforcer.sim.adapter import make_policy
from enforcer.sim.engine import Simulation
from enforcer.sim.model import GIB, NodeSpec, SimJob
from enforcer.sim.readers.openb import read_openb
from store.errors import InvalidInput
from tests.sim.invariants import assert_invariants
from tests.sim.test_readers import POD_HEADER

CLUSTER = [NodeSpec("n0", 2, 10 * GIB)]
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(("field", "value"), [
    ("arrival", NAN), ("arrival", INF), ("work", NAN), ("work", INF), ("work", -5.0), ("gpus", 0), ("gpus", 1.5),
    ("share", NAN), ("share", 0.0), ("share", -0.5), ("share", 1.5), ("mem", -GIB), ("mem_persistent", -1),
    ("mem_ephemeral", -1), ("util", NAN), ("util", -0.1), ("util", 1.5), ("steps", -1),
])
def test_a_job_that_cannot_be_simulated_is_refused_by_name(field, value):
    # NaN work or arrival used to hang the event loop (NaN times in the heap); negative work "finished" at once
    # with nothing served; gpus 0 ran without counting any device time
    with pytest.raises(InvalidInput) as exc:
        SimJob("bad-job", **{"arrival": 0.0, "work": 5.0, "mem": GIB, field: value})
    assert "bad-job" in str(exc.value) and field in str(exc.value)


def test_zero_work_and_edge_values_are_fine():
    jobs = [SimJob("a", 0.0, 0.0, mem=GIB), SimJob("b", 0.0, 5.0, share=1.0, mem=0, util=0.0),
            SimJob("c", -3.0, 5.0, share=0.25, util=1.0)]
    result = Simulation(jobs, CLUSTER, make_policy("pack"), check=True).run()
    assert_invariants(result)
    assert result.metrics["finished"] == 3


@pytest.mark.parametrize(("field", "value"), [("devices", -1), ("devices", 1.5), ("mem", -GIB)])
def test_a_node_that_cannot_exist_is_refused(field, value):
    with pytest.raises(InvalidInput) as exc:
        NodeSpec("bad-node", **{"devices": 1, "mem": GIB, field: value})
    assert "bad-node" in str(exc.value)


@pytest.mark.parametrize("policy", ["fifo", "pack", "tiresias"])
def test_two_jobs_of_one_id_are_refused(policy):
    # the second used to take the first's place in the simulator's index: the first started and never finished,
    # with nothing served, and its device time went uncounted
    jobs = [SimJob("a", 0.0, 5.0, mem=GIB), SimJob("a", 1.0, 5.0, mem=GIB)]
    with pytest.raises(InvalidInput) as exc:
        Simulation(jobs, CLUSTER, make_policy(policy))
    assert "'a'" in str(exc.value)


def test_openb_rows_with_infinite_times_are_skipped_and_counted(tmp_path):
    f = tmp_path / "pods.csv"
    f.write_text(POD_HEADER
                 + "p0,1000,1024,1,500,,LS,Running,0,100,10\n"
                 + "p1,1000,1024,1,500,,LS,Running,0,inf,10\n"  # a deletion time that is no time
                 + "p2,1000,1024,1,500,,LS,Running,-inf,100,10\n"
                 + "p3,1000,1024,1,500,,LS,Running,0,100,10\n")
    tr = read_openb(f)
    assert [j.id for j in tr.jobs] == ["p0", "p3"]
    assert tr.report.skipped == {"malformed": 2}



def test_a_job_of_no_work_has_no_stretch():
    # with no job finished, the finish column held only None (objects), and a zero-work job's stretch was a
    # Python division by zero: the summary failed after the whole simulation
    (alone,) = simulate_jobs([SimJob("huge", 0.0, 0.0, mem=100 * GIB)])
    assert alone.metrics["unplaceable"] == 1 and alone.metrics["stretch_mean"] == 0.0
    (mixed,) = simulate_jobs([SimJob("none", 0.0, 0.0, mem=GIB), SimJob("some", 0.0, 4.0, mem=GIB)])
    stretch = dict(zip(mixed.jobs["id"], mixed.jobs["stretch"], strict=True))
    assert math.isnan(stretch["none"]) and stretch["some"] == 1.0  # not inf, not counted in the mean
    assert mixed.metrics["stretch_mean"] == 1.0


def simulate_jobs(jobs):
    result = Simulation(jobs, CLUSTER, make_policy("fifo"), check=True).run()
    assert_invariants(result)
    return [result]
