"""`make gpu-check`'s runner, exercised here without a GPU: it says why this machine cannot run the gpu tests, and
when made to run them anyway it reads pytest's outcomes (all skipped here: none passed, so not ok) and keeps to
its time limit."""

from __future__ import annotations

import json

import pytest

import tests.gpu.check as check


def test_without_a_gpu_the_summary_says_why_and_exits_2(tmp_path, capsys) -> None:
    out = tmp_path / "gpu-check.json"
    assert check.main(["--timeout", "60", "--out", str(out)]) == 2
    summary = json.loads(capsys.readouterr().out.strip())
    assert summary == json.loads(out.read_text())
    assert summary["ok"] is False and "cannot run the gpu tests" in summary["reason"]
    assert summary["host"]["python"] and "torch" in summary["host"]


@pytest.mark.slow
def test_the_runner_reads_each_outcome_and_a_run_of_skips_is_not_ok(monkeypatch) -> None:
    monkeypatch.setattr(check, "gpu_unavailable_reason", lambda: None)  # the tests themselves still skip here
    summary, code = check.run(300, ["-k", "memory_share_is_enforced or falls_to_its_persistent_cap"])
    assert code == 1 and summary["ok"] is False and not summary["timed_out"]
    assert summary["passed"] == 0 and summary["failed"] == [] and len(summary["skipped"]) == 2
    assert all(t["outcome"] == "skipped" and "needs a GPU host" in t["message"] for t in summary["tests"].values())


def test_the_runner_stops_at_its_time_limit(monkeypatch) -> None:
    monkeypatch.setattr(check, "gpu_unavailable_reason", lambda: None)
    summary, code = check.run(0.5, [])
    assert code == 1 and summary["timed_out"] is True and summary["ok"] is False
