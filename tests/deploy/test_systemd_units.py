"""deploy/systemd: each unit passes `systemd-analyze verify` (no systemd runs here: verify reads the unit files alone),
and its ExecStart is a command line the fleetlens CLI accepts.

verify checks that ExecStart's program exists and is executable; the units name /opt/fleetlens/bin/fleetlens, where
the README installs it, so each is verified as a copy that names this environment's fleetlens instead, nothing else
changed."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT

UNITS = PROJECT_ROOT / "deploy" / "systemd"
INSTALLED = "/opt/fleetlens/bin/fleetlens"


def _analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is not installed; `make systemd` installs Debian's systemd package")
    return found


def _verify(units: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([_analyze(), "verify", *map(str, units)], capture_output=True, text=True, timeout=120)


def _here(unit: Path, folder: Path) -> Path:
    """A copy of `unit` whose ExecStart is this environment's fleetlens."""
    fleetlens = Path(sys.executable).parent / "fleetlens"
    assert fleetlens.exists()
    copy = folder / unit.name
    text = unit.read_text()
    assert f"ExecStart={INSTALLED} " in text
    copy.write_text(text.replace(INSTALLED, str(fleetlens)))
    return copy


def _exec_start(unit: Path) -> list[str]:
    (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def test_the_units_verify(tmp_path: Path) -> None:
    units = sorted(UNITS.glob("*.service"))
    assert [u.name for u in units] == ["fleetlens-agent.service", "fleetlens-serve.service"]
    done = _verify([_here(u, tmp_path) for u in units])
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_a_broken_unit_does_not_verify(tmp_path: Path) -> None:
    """What the check catches: a misspelled key, a value systemd cannot parse, a program that is not there."""
    good = _here(UNITS / "fleetlens-agent.service", tmp_path)
    for name, broken in (("typo", good.read_text().replace("Restart=on-failure", "Restrat=on-failure")),
                         ("value", good.read_text().replace("KillMode=mixed", "KillMode=blend")),
                         ("program", (UNITS / "fleetlens-agent.service").read_text())):
        unit = tmp_path / f"broken-{name}.service"
        unit.write_text(broken)
        done = _verify([unit])
        assert done.returncode != 0 or done.stdout + done.stderr, name


def test_what_the_units_run(capsys) -> None:
    from ui.cli import run as cli

    agent, serve = (_exec_start(UNITS / f"fleetlens-{n}.service") for n in ("agent", "serve"))
    assert agent == [INSTALLED, "agent", "--listen-address", ":9400"]
    assert serve == [INSTALLED, "serve", "--no-agent"]
    for argv in (agent, serve):
        assert cli([*argv[1:], "--help"]) == 0  # every option is one the command has
    capsys.readouterr()
    for unit in UNITS.glob("*.service"):
        text = unit.read_text()
        assert "EnvironmentFile=/etc/fleetlens/fleetlens.env" in text and "WantedBy=multi-user.target" in text
