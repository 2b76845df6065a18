"""`fleetlens init` / `status`, and the one-line errors for bad settings: exit 2, no traceback, nothing half-written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from store.db import Store
from store.migrations import current_revision, head_revision
from ui.cli import run

FLEETLENS = str(Path(sys.executable).with_name("fleetlens"))


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], "HOME": env.get("HOME", "/tmp"), **env}
    if "PYTHONPATH" in os.environ:  # the code under test (a checkout run from its own folder), not the installed one
        full["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run([FLEETLENS, *args], env=full, capture_output=True, text=True, timeout=120)


def test_init_creates_home_and_schema_then_status_counts(fleet_home, capsys):
    assert run(["init"]) == 0
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    assert current_revision(store) == head_revision()
    assert (fleet_home / "fleetlens.db").exists()
    assert run(["init"]) == 0  # idempotent
    capsys.readouterr()
    assert run(["status"]) == 0
    out = capsys.readouterr().out
    assert head_revision() in out
    for label in ("hosts", "devices", "workflows", "device samples", "findings"):
        assert label in out


@pytest.mark.pg
def test_status_masks_the_password(pg_url, capsys, fleet_home, monkeypatch):
    url = pg_url.replace("postgres@", "postgres:hunter2@")
    monkeypatch.setenv("FLEETLENS_DB_URL", url)
    assert run(["init"]) == 0
    assert run(["status"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "***" in out


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"FLEETLENS_DB_URL": "not a url"}, "is not a database URL"),
        ({"FLEETLENS_DB_URL": "mysql://root@127.0.0.1/x"}, "fleetlens runs on sqlite or postgresql"),
        ({"FLEETLENS_DB_URL": "postgresql://u:secretpw@127.0.0.1:1/x"}, "cannot reach the database"),
        ({"FLEETLENS_HOME": "/proc/fleetlens-cannot-write"}, "cannot be written"),
        ({"FLEETLENS_UI_PORT": "abc"}, "FLEETLENS_UI_PORT is 'abc'"),
        ({"FLEETLENS_DB_POOL_SIZE": "-1"}, "FLEETLENS_DB_POOL_SIZE is '-1'"),
        ({"RANK": "first"}, "FLEETLENS_RANK or RANK is 'first'"),
        ({"FLEETLENS_HOST_ID": "  "}, "FLEETLENS_HOST_ID is '  '"),
        ({"FLEETLENS_PROMETHEUS_TEAMS": "ml=search"}, "FLEETLENS_PROMETHEUS_TEAMS must be JSON"),
    ],
)
def test_bad_settings_give_one_line_and_exit_2(tmp_path, env, expected):
    env = {"FLEETLENS_HOME": str(tmp_path / "home"), **env}
    result = _cli(["init"], env)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 3
    assert "secretpw" not in result.stderr


def test_database_at_newer_revision_is_refused_and_left_untouched(fleet_home, capsys):
    assert run(["init"]) == 0
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    capsys.readouterr()
    assert run(["init"]) == 2
    err = capsys.readouterr().err
    assert "newer than this fleetlens" in err and "upgrade fleetlens" in err
    assert current_revision(store) == "9999_from_the_future"


def test_status_without_schema_says_to_init(fleet_home, capsys):
    fleet_home.mkdir(parents=True)
    Store(f"sqlite:///{fleet_home / 'fleetlens.db'}").ping()
    assert run(["status"]) == 0
    assert "fleetlens init" in capsys.readouterr().out


def test_help_lists_commands():
    result = _cli(["--help"], {})
    assert result.returncode == 0
    assert "init" in result.stdout and "status" in result.stdout


def test_help_shows_what_the_commands_say_whole():
    env = {"COLUMNS": "200"}
    # square brackets and angle brackets are text, not markup: rich's markup used to eat "[xGIB]"
    assert "cluster N[xD[xGIB]] instead of the trace's own" in _cli(["simulate", "--help"], env).stdout
    assert "workflows slurm-ID (request" in _cli(["slurm-import", "--help"], env).stdout
    # a docstring's paragraph is one paragraph, not broken where the source wraps
    assert "enforcement stays a dry run unless FLEETLENS_ENFORCE=true" in _cli(["serve", "--help"], env).stdout


@pytest.mark.parametrize("lane_mb", ["nan", "inf", "0", "-5"])
def test_move_refuses_a_lane_size_that_is_not_a_positive_number(fleet_home, capsys, lane_mb):
    assert run(["init"]) == 0
    capsys.readouterr()
    assert run(["move", "job", "--to-device", "1", "--lane-mb", lane_mb]) == 2
    err = capsys.readouterr().err
    assert "--lane-mb must be a positive number of MB" in err and "Traceback" not in err
