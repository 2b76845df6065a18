"""The job SDK against real parts: real torch training jobs in subprocesses, the real socket server and the
agent's SDK handlers on a real SQLite store; step stats, checkpoints on request, resume, the lane gate hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

from collector import protocol as p
from collector.job import job
from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer
from store.db import Store
from store.errors import DatabaseUnavailable
from store.migrations import upgrade
from store.models import StepStat, Workflow
from store.settings import Settings, get_settings
from tests.collector.agent_helpers import wait_for
from tests.conftest import PROJECT_ROOT

TRAIN = ["-m", "collector.examples.train"]


class Served:
    """The agent's SDK side in this test: SdkHandlers behind the real socket server, on the home's SQLite."""

    def __init__(self, settings: Settings) -> None:
        settings.ensure_home()
        self.settings = settings
        self.store = Store.from_settings(settings)
        upgrade(self.store)
        self.handlers = SdkHandlers(self.store, "test-host", settings, sync_interval_s=0.1)
        self.server = SocketServer(settings.socket_path, self.handlers).start()

    def stop(self) -> None:
        self.server.stop()
        self.handlers.close()

    def step_rows(self, workflow: str) -> list[StepStat]:
        with self.store.session() as s:
            query = select(StepStat).where(StepStat.workflow_id == workflow).order_by(StepStat.first_step)
            return list(s.scalars(query))

    def workflow(self, workflow: str) -> Workflow | None:
        with self.store.session() as s:
            return s.get(Workflow, workflow)


@pytest.fixture
def served(fleet_home: Path) -> Iterator[Served]:
    agent = Served(get_settings(fresh=True))
    yield agent
    agent.stop()
    agent.store.dispose()


def train_env(workflow: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "FLEETLENS_WORKFLOW": workflow, "FLEETLENS_SDK_FLUSH_INTERVAL_S": "0.1",
           "PYTHONPATH": str(PROJECT_ROOT)}
    env.update(extra)
    return env


def run_train(workflow: str, *args: str, timeout: float = 120, **env: str) -> tuple[dict[str, Any], Any]:
    proc = subprocess.run([sys.executable, *TRAIN, *args], env=train_env(workflow, **env), cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def start_train(workflow: str, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *TRAIN, *args], env=train_env(workflow, **env), cwd=PROJECT_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def job_at_step(served: Served, workflow: str, step: int) -> bool:
    return any(j["workflow"] == workflow and j.get("step", -1) >= step for j in served.handlers.jobs())


# ---- the SDK without an agent ------------------------------------------------------------------------------

def test_training_without_an_agent_runs_to_the_end(fleet_home: Path) -> None:
    assert not get_settings(fresh=True).socket_path.exists()
    summary, _ = run_train("no-agent", "--mode", "tiny", "--steps", "200")
    assert (summary["start_step"], summary["end_step"], summary["steps_run"]) == (0, 200, 200)
    assert summary["connected"] is False


def test_agent_going_away_mid_run_does_not_stop_training(served: Served) -> None:
    settings = served.settings.model_copy(update={"workflow": "agent-goes", "sdk_flush_interval_s": 0.02})
    seen = []
    with job("agent-goes", total_steps=60, settings=settings) as j:
        for step in j.steps():
            seen.append(step)
            if step == 20:
                wait_for(lambda: served.step_rows("agent-goes"), timeout=10)
                served.server.stop()
            time.sleep(0.002)
    assert seen == list(range(60))
    assert served.step_rows("agent-goes")[0].first_step == 0


# ---- step stats ---------------------------------------------------------------------------------------------

def test_step_stats_rows_cover_every_step_of_a_real_training_loop(served: Served) -> None:
    summary, _ = run_train("stats-wf", "--steps", "300", "--step-sleep", "0.002")
    assert summary["connected"] is True
    rows = wait_for(lambda: (r := served.step_rows("stats-wf")) and sum(x.n_steps for x in r) == 300 and r)
    expected_first = 0
    for row in rows:
        assert row.first_step == expected_first
        assert row.n_steps == row.last_step - row.first_step + 1
        assert 0 < row.p50_s <= row.p95_s <= row.max_s
        assert row.ts_start <= row.ts_end
        assert row.host_id == "test-host" and row.rank == 0
        assert row.mem_source == "rss" and row.mem_persistent > 0 and row.mem_peak >= row.mem_persistent
        expected_first = row.last_step + 1
    assert expected_first == 300
    # the last flush's memory count may land just after the goodbye: wait for it rather than read it once
    workflow = wait_for(lambda: (w := served.workflow("stats-wf")) and w.state == "finished"
                        and (w.labels or {}).get("mem_steps") == 300 and w)
    assert workflow.declared_steps == 300 and workflow.name == "train-healthy"
    assert workflow.mem_persistent > 0 and workflow.mem_ephemeral is not None
    assert workflow.labels["mem_source"] == "rss" and workflow.labels["mem_steps"] == 300  # seen for every step


# ---- checkpoints and resume ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_checkpoint_on_request_then_resume_continues_bit_exact(served: Served, tmp_path: Path) -> None:
    proc = start_train("ckpt-wf", "--steps", "300", "--step-sleep", "0.01")
    try:
        wait_for(lambda: job_at_step(served, "ckpt-wf", 20), timeout=60)
        served.handlers.request_checkpoint("ckpt-wf", "ck-1", tmp_path / "ckpts")
        result = wait_for(lambda: served.handlers.checkpoint_result("ck-1"), timeout=30)
    finally:
        first = finish(proc)
    assert result["status"] == "done" and result["error"] is None
    path = Path(result["path"])
    assert path.parent == tmp_path / "ckpts" and path.is_file()
    assert 20 <= result["step"] < 300
    state = torch.load(path, weights_only=False)
    assert state["step"] == result["step"] and {"model", "optimizer", "rng"} <= set(state)
    assert first["end_step"] == 300
    assert {"path": str(path), "step": result["step"]} in first["checkpoints"]
    assert not list(path.parent.glob(".*.tmp"))  # written whole, then renamed

    resumed, _ = run_train("ckpt-wf", "--steps", "300", FLEETLENS_RESUME_FROM=str(path))
    assert resumed["start_step"] == result["step"] and resumed["end_step"] == 300
    assert resumed["steps_run"] == 300 - result["step"]
    assert resumed["loss"] == first["loss"]  # the same batches and state: not one step lost or repeated
    rows = wait_for(lambda: [r for r in served.step_rows("ckpt-wf") if r.first_step >= result["step"]
                             and r.ts_start > state["saved_at"]])
    assert min(r.first_step for r in rows) == result["step"]


def test_checkpoint_request_without_callback_or_with_failing_callback_is_answered(served: Served) -> None:
    settings = served.settings.model_copy(update={"sdk_flush_interval_s": 0.02})

    def broken(directory: str) -> str:
        raise OSError(f"disk full under {directory}")

    for workflow, callback, expected in (("no-cb", None, "no checkpoint callback"), ("bad-cb", broken, "disk full")):
        with job(workflow, total_steps=400, checkpoint=callback, workflow=workflow, settings=settings) as j:
            for step in j.steps():
                if step == 5:
                    served.handlers.request_checkpoint(workflow, f"{workflow}-1", "/tmp/nowhere")
                time.sleep(0.002)
        assert j.step == 400  # training went on
        result = served.handlers.checkpoint_result(f"{workflow}-1")
        assert result["status"] == "failed" and expected in result["error"] and result["path"] is None


def test_resume_from_a_missing_checkpoint_is_one_clear_error(fleet_home: Path) -> None:
    proc = subprocess.run([sys.executable, *TRAIN, "--steps", "10"], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=60, env=train_env("resume-bad", FLEETLENS_RESUME_FROM="/no/such/ckpt"))
    assert proc.returncode == 2
    assert "FLEETLENS_RESUME_FROM names /no/such/ckpt" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_step_without_restore_callback(fleet_home: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "state.bin"
    ckpt.write_bytes(b"x")
    settings = get_settings(fresh=True).model_copy(update={"resume_from": ckpt, "resume_step": 7})
    with job("r", total_steps=10, workflow="r", settings=settings) as j:
        assert j.resume_from == ckpt
        assert list(j.steps()) == [7, 8, 9]


# ---- lane gate hook, memory fraction ------------------------------------------------------------------------

class RecordingGate:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((msg["phase"], msg["step"], msg["lane"]))
        return {"ok": True, "granted": True}


def test_gate_runs_around_each_step_in_a_lane_and_never_outside(served: Served) -> None:
    gate = RecordingGate()
    served.handlers.gate = gate
    outside = served.settings.model_copy(update={"memory_fraction": 0.5})
    with job("free", total_steps=3, workflow="free", settings=outside) as j:
        assert list(j.steps()) == [0, 1, 2]
        assert j.memory_fraction_applied is None  # no CUDA here: nothing to cap, nothing broken
    assert gate.calls == []
    inside = served.settings.model_copy(update={"lane": "lane-7"})
    with job("laned", total_steps=3, workflow="laned", settings=inside) as j:
        assert list(j.steps()) == [0, 1, 2]
    assert gate.calls == [(phase, step, "lane-7") for step in range(3) for phase in ("begin", "end")]


def test_in_a_lane_the_turn_is_handed_on_only_after_the_step_done_waiter_returns(served: Served) -> None:
    gate = RecordingGate()
    served.handlers.gate = gate
    inside = served.settings.model_copy(update={"lane": "lane-3"})

    def step_done() -> None:  # stands where the CUDA event's synchronize stands on a GPU
        gate.calls.append(("done", len(gate.calls), "waiter"))

    with job("waited", total_steps=3, workflow="waited", settings=inside, step_done=step_done) as j:
        assert list(j.steps()) == [0, 1, 2]
    phases = [c[0] for c in gate.calls]
    assert phases == ["begin", "done", "end"] * 3  # every end reached the gate after its step's waiter returned
    assert [c[1] for c in gate.calls if c[0] == "end"] == [0, 1, 2]


def test_on_a_cpu_device_a_lane_job_waits_on_nothing(served: Served) -> None:
    assert not torch.cuda.is_available()  # torch is real here; the device is the CPU
    served.handlers.gate = RecordingGate()
    inside = served.settings.model_copy(update={"lane": "lane-4"})
    with job("cpu-lane", total_steps=2, workflow="cpu-lane", settings=inside) as j:
        assert list(j.steps()) == [0, 1]
        assert j.step_waiter is None and j.step_wait_s == 0.0


# ---- protocol and handler robustness ------------------------------------------------------------------------

def test_protocol_round_trip_and_bad_lines() -> None:
    msg = {"op": p.POLL, "v": p.VERSION, "workflow": "w", "pid": 1}
    assert p.decode(p.encode(msg)) == msg
    for bad in (b"not json", b"[1, 2]", b'"text"'):
        with pytest.raises(p.ProtocolError):
            p.decode(bad)
    with pytest.raises(ValueError):
        p.encode({"x": float("nan")})


def test_handler_answers_bad_requests_with_errors(served: Served) -> None:
    handle = served.handlers.handle
    assert "unknown op" in handle({"op": "launch_missiles", "workflow": "w", "pid": 1})["error"]
    assert "missing batches" in handle({"op": "steps", "workflow": "w", "pid": 1})["error"]
    assert "version" in handle({"op": "poll", "v": 99, "workflow": "w", "pid": 1})["error"]
    bad_batch = {"op": "steps", "workflow": "w", "pid": 1, "batches": [{"first_step": 0}]}
    assert handle(bad_batch)["ok"] is False
    assert handle({"op": "poll", "workflow": "w", "pid": 1}) == {"ok": True}
    assert "no checkpoint request" in handle(
        {"op": "checkpoint_done", "workflow": "w", "pid": 1, "request_id": "x", "path": "/p", "step": 1})["error"]


def test_handler_keeps_step_stats_while_the_database_is_down(served: Served) -> None:
    down = Store("postgresql+psycopg://nobody@127.0.0.1:1/none", connect_timeout_s=1)
    handlers = SdkHandlers(down, "h", served.settings, sync_interval_s=3600)
    batch = {"first_step": 0, "last_step": 9, "n_steps": 10, "ts_start": 1.0, "ts_end": 2.0, "mean_s": 0.1,
             "p50_s": 0.1, "p95_s": 0.1, "max_s": 0.2, "mem_persistent": 100, "mem_peak": 150, "mem_source": "cuda"}
    reply = handlers.handle({"op": "steps", "v": 1, "workflow": "down-wf", "pid": 5, "batches": [batch]})
    assert reply == {"ok": True}  # answered from memory
    with pytest.raises(DatabaseUnavailable):
        handlers.flush()
    handlers.store = served.store  # the database is back
    handlers.flush()
    handlers.close()
    rows = served.step_rows("down-wf")
    assert [(r.first_step, r.last_step, r.pid, r.mem_source) for r in rows] == [(0, 9, 5, "cuda")]
    workflow = served.workflow("down-wf")
    assert (workflow.mem_persistent, workflow.mem_ephemeral, workflow.labels["mem_source"]) == (100, 50, "cuda")
    assert workflow.labels["mem_steps"] == 10


def test_the_steps_a_jobs_memory_was_seen_for_survive_a_restart(served: Served) -> None:
    batch = {"first_step": 0, "last_step": 9, "n_steps": 10, "ts_start": 1.0, "ts_end": 2.0, "mean_s": 0.1,
             "p50_s": 0.1, "p95_s": 0.1, "max_s": 0.2, "mem_persistent": 100, "mem_peak": 150, "mem_source": "cuda"}
    handlers = served.handlers
    for pid, n in ((5, 10), (6, 4)):  # the job, then the same job restarted (moved) as another process
        handlers.handle({"op": "steps", "v": 1, "workflow": "restarted", "pid": pid,
                         "batches": [{**batch, "n_steps": n, "last_step": n - 1}]})
        handlers.flush()
    assert served.workflow("restarted").labels["mem_steps"] == 10  # never fewer than were seen before


def test_a_step_summary_the_agent_answered_too_late_is_sent_again_and_taken_once(served: Served) -> None:
    settings = served.settings.model_copy(update={
        "sdk_timeout_s": 0.3, "sdk_retry_s": 0.001, "sdk_flush_interval_s": 3600.0, "sdk_flush_steps": 5})
    handlers = served.handlers
    answer, late = handlers.handle, []

    def slow_first_steps(msg: dict[str, Any]) -> dict[str, Any] | None:
        reply = answer(msg)  # taken...
        if msg.get("op") == p.STEPS and not late:
            late.append(msg)
            time.sleep(1.0)  # ...but answered after the job's timeout: the job keeps the summary and sends it again
        return reply

    handlers.handle = slow_first_steps  # what the socket server calls
    with job(workflow="resent", settings=settings) as j:
        for _ in j.steps(range(10)):
            time.sleep(0.01)
    assert late
    handlers.flush()
    rows = served.step_rows("resent")
    assert [(r.first_step, r.last_step) for r in rows] == [(0, 4), (5, 9)]  # each step once
    assert handlers.duplicate_batches == 1
    # a new process under the same pid, resuming from an earlier step, is a new count
    hello = {"op": p.HELLO, "v": p.VERSION, "workflow": "resent", "pid": j.pid, "start_step": 3}
    batch = {**{f: 0.1 for f in p.BATCH_FIELDS}, "first_step": 3, "last_step": 7, "n_steps": 5}
    assert answer(hello)["ok"]
    assert answer({"op": p.STEPS, "v": p.VERSION, "workflow": "resent", "pid": j.pid, "batches": [batch]})["ok"]
    handlers.flush()
    assert [(r.first_step, r.last_step) for r in served.step_rows("resent")] == [(0, 4), (3, 7), (5, 9)]


def test_a_step_summary_sent_after_the_loop_keeps_the_time_its_steps_ran(served: Served) -> None:
    with job(workflow="evaluated", settings=served.settings) as j:
        for _ in j.steps(range(5)):
            pass
        loop_ended = time.time()
        time.sleep(0.3)  # an evaluation after training, inside the job: the summary goes at close, after it
    served.handlers.flush()
    rows = served.step_rows("evaluated")
    assert [(r.first_step, r.last_step) for r in rows] == [(0, 4)]
    assert rows[0].ts_start <= rows[0].ts_end <= loop_ended + 0.05  # not the time it was sent
