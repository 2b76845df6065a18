"""`fleetlens` given bad input: one line naming what was wrong, exit code 2, and nothing stored lost or half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from collector.recordings.load import load_into_store
from store.findings import FindingSpec, upsert_finding
from store.models import Action, DeviceSample, Finding, Host, ProcessSample, ProfileRequest, Workflow
from store.workflows import upsert_workflow
from tests.conftest import FLEET, TRACES
from ui.cli import run

FLEETLENS = str(Path(sys.executable).with_name("fleetlens"))
SALUS = f"salus:{FLEET / 'salus_workloads.csv'}"


def _refused(argv: list[str], capsys, expected: str) -> str:
    """Run the command; it must exit 2 with one line on stderr that says `expected`."""
    assert run(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert expected in " ".join(err.split()), err
    assert "Traceback" not in err and err.startswith("fleetlens: ")
    return captured.out


def _samples(store) -> tuple[int, int]:
    with store.session() as s:
        return (s.scalar(select(func.count()).select_from(DeviceSample)),
                s.scalar(select(func.count()).select_from(ProcessSample)))


def _open_findings(store) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(Finding).where(Finding.status == "open"))


@pytest.mark.parametrize("command", ["rollup", "detect", "rank"])
def test_a_now_in_the_future_is_refused_and_changes_nothing(cli_store, capsys, command):
    load_into_store(cli_store, FLEET, containers=10, end_at=time.time())
    assert run(["detect"]) == 0
    before = _samples(cli_store), _open_findings(cli_store)
    assert before[0][0] > 0 and before[1] > 0
    # epoch milliseconds for seconds: the rollup's retention deleted every raw sample, and the detectors resolved
    # every open finding (each device silent for ages by then)
    _refused([command, "--now", str(time.time() * 1000)], capsys, "is in the future")
    assert (_samples(cli_store), _open_findings(cli_store)) == before
    assert run([command, "--now", str(time.time() - 60)]) == 0  # the present still does


@pytest.mark.parametrize(("argv", "expected"), [
    (["findings", "--workflow", "no-such-workflow"], "no workflow 'no-such-workflow' in the store"),
    (["findings", "--json", "--workflow", "no-such-workflow"], "no workflow 'no-such-workflow' in the store"),
    (["findings", "--team", "no-such-team"], "no workflow of team 'no-such-team'"),
    (["rank", "--team", "no-such-team"], "no workflow of team 'no-such-team'"),
    (["findings", "--rule", "idle_holdr"], "no rule 'idle_holdr'; did you mean 'idle_holder'?"),
    (["findings", "--rule", "host_bound"], "no rule 'host_bound'; did you mean 'trace.host_bound'?"),
    (["findings", "--json", "--rule", "nonsense"], "no rule 'nonsense'; the rules are idle_holder,"),
])
def test_a_filter_naming_nothing_recorded_is_an_error_not_an_empty_list(cli_store, capsys, argv, expected):
    load_into_store(cli_store, FLEET, containers=2, end_at=time.time())
    assert _refused(argv, capsys, expected) == ""
    with cli_store.session() as s:
        known = s.scalars(select(Workflow)).first()
    assert run(["findings", "--workflow", known.id]) == 0  # a known workflow without findings still lists none
    # a rule of the analyzer's with no findings yet lists none, as does a rule a stored finding carries
    assert run(["findings", "--rule", "serving.slo_misses"]) == 0
    assert "no findings match" in capsys.readouterr().out
    with cli_store.session() as s:
        upsert_finding(s, FindingSpec(rule="an_older_rule", workflow_id=known.id, source="telemetry", severity="low",
                                      title="t", fix="f", evidence={}))
    assert run(["findings", "--rule", "an_older_rule"]) == 0
    assert "an_older_rule" in capsys.readouterr().out


def test_export_into_a_folder_or_of_an_unknown_host_writes_nothing(cli_store, tmp_path, capsys):
    load_into_store(cli_store, FLEET, containers=2, end_at=time.time())
    folder = tmp_path / "exports"
    folder.mkdir()
    _refused(["export", str(folder)], capsys, "it is a folder")
    with cli_store.session() as s:
        host = s.scalars(select(Host.id)).first()
    target = folder / "out.jsonl.gz"
    _refused(["export", str(target), "--host", host, "--host", "hots-typo"], capsys,
             "no host 'hots-typo' in the store")
    assert list(folder.iterdir()) == []  # no file and no partial one
    _refused(["export", "/proc/fleetlens-export.jsonl"], capsys, "cannot write /proc/fleetlens-export.jsonl")


@pytest.mark.parametrize(("options", "expected"), [
    (["--jobs", "0"], "at least one job, not 0"),
    (["--jobs", "-3"], "at least one job, not -3"),
    (["--jobs", "5", "--load", "-1"], "offered load must be a positive number, not -1.0"),
    (["--jobs", "5", "--load", "nan"], "offered load must be a positive number, not nan"),
    (["--jobs", "5", "--migration-cost", "nan"], "migration's cost must be a finite number"),
    (["--jobs", "5", "--migration-cost", "-5"], "migration's cost must be a finite number"),
    (["--jobs", "5", "--html", "/"], "is a folder"),
    (["--jobs", "5", "--seed", "-1"], "the random seed must be 0 or more, not -1"),
])
def test_simulate_refuses_bad_numbers(fleet_home, capsys, options, expected):
    assert _refused(["simulate", "--trace", SALUS, *options], capsys, expected) == ""


@pytest.mark.parametrize("gib", ["nan", "-1", "0"])
def test_simulate_consolidate_refuses_a_device_size_that_is_not_positive(fleet_home, capsys, gib):
    argv = ["simulate", "--trace", f"alibaba:{FLEET}", "--consolidate", "--device-gib", gib]
    assert _refused(argv, capsys, f"--device-gib must be a positive number of GiB, not {float(gib)}") == ""


@pytest.mark.parametrize("host_id", ["", "  "])
def test_agent_refuses_a_blank_host_id(cli_store, capsys, host_id):
    _refused(["agent", "--once", "--source", "cpu", "--no-socket", "--host-id", host_id], capsys,
             "is blank; give this host's name")
    with cli_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Host)) == 0  # no host '' with samples of its own


@pytest.mark.parametrize("mem", ["nan", "inf", "-5"])
def test_run_refuses_a_memory_that_is_not_a_positive_number(cli_store, capsys, mem):
    _refused(["run", "--mem-mb", mem, "--", "true"], capsys, f"--mem-mb must be a positive number of MB, not {mem}")
    with cli_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Workflow)) == 0  # nothing registered, nothing started


@pytest.mark.parametrize(("argv", "expected"), [
    (["drive", "--plan", "9999"], "no plan 9999 in the store"),
    (["drive", "--timeout", "nan"], "--timeout must be a finite number of seconds, 0 or more, not nan"),
    (["drive", "--timeout", "-1"], "--timeout must be a finite number of seconds, 0 or more, not -1.0"),
    (["move", "some-job", "--to-device", "1", "--timeout", "nan"], "--timeout must be a finite number"),
    (["profile", "some-job", "--timeout", "nan"], "--timeout must be a positive number of seconds, not nan"),
    (["profile", "some-job", "--timeout", "inf"], "--timeout must be a positive number of seconds, not inf"),
    (["serving", "show", "--window", "-1"], "--window must be a positive number of seconds, not -1.0"),
    (["serving", "show", "--window", "nan"], "--window must be a positive number of seconds, not nan"),
    (["serving", "rightsize", "some-job", "--window", "0"], "--window must be a positive number of seconds"),
    (["serving", "rightsize", "some-job", "--k", "nan"], "--k must be a positive number"),
    (["serving", "rightsize", "some-job", "--k", "-1"], "--k must be a positive number"),
    (["metrics-serve", "--port", "99999", "--duration", "1"], "--port 99999 is not a TCP port"),
    (["metrics-serve", "--port", "0", "--duration", "nan"], "--duration must be a positive number of seconds"),
    (["metrics-serve", "--port", "0", "--duration", "-1"], "--duration must be a positive number of seconds"),
])
def test_bad_numbers_and_ids_are_refused_before_anything_is_recorded(cli_store, capsys, argv, expected):
    assert _refused(argv, capsys, expected) == ""
    with cli_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Action)) == 0


def test_analyze_refuses_a_folder_as_the_html_report_before_analysing(fleet_home, tmp_path, capsys):
    out = _refused(["analyze", str(TRACES / "a100_triton_kernel.json.gz"), "--html", str(tmp_path)], capsys,
                   "is a folder")
    assert out == ""  # refused before the analysis, not after its report


def test_ctrl_c_while_profile_waits_says_so_and_withdraws_the_request(cli_store, fleet_home):
    with cli_store.session() as s:
        upsert_workflow(s, "train-1")
    env = {"PATH": os.environ["PATH"], "HOME": str(fleet_home), "FLEETLENS_HOME": str(fleet_home),
           "FLEETLENS_DB_URL": os.environ["FLEETLENS_DB_URL"], "FLEETLENS_SECRET": "test-secret"}
    if "PYTHONPATH" in os.environ:  # the code under test, not the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    # as a terminal's Ctrl-C: SIGINT to a process that did not inherit it ignored
    proc = subprocess.Popen([FLEETLENS, "profile", "train-1", "--timeout", "60"], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "profile request #1" in proc.stderr.readline()  # the request is stored; the command waits for a job
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "fleetlens: interrupted" and "Traceback" not in err
    with cli_store.session() as s:
        request = s.get(ProfileRequest, 1)
        assert request.status == "expired" and "withdrawn" in request.error  # no job traces steps nobody awaits


_SLOW_CLI_IMPORT = '''
import sys, time

class _SlowCli:
    """Holds the import of ui.cli for a while, after saying so, as a cold machine's slow imports do."""
    def find_spec(self, name, path=None, target=None):
        if name == "ui.cli":
            sys.stderr.write("loading ui.cli\\n")
            sys.stderr.flush()
            time.sleep(30)
        return None

sys.meta_path.insert(0, _SlowCli())
'''


def test_ctrl_c_while_the_command_line_loads_says_so_without_a_traceback(fleet_home, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SLOW_CLI_IMPORT)
    env = {"PATH": os.environ["PATH"], "HOME": str(fleet_home), "FLEETLENS_HOME": str(fleet_home),
           "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([FLEETLENS, "status"], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr.readline() == "loading ui.cli\n"  # the signal lands inside the import, not after it
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip() == "fleetlens: interrupted"
