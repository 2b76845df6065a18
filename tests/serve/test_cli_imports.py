"""The `fleetlens` command loads every command module at start: none of them may pull in the dashboard, Airflow,
HTA or torch, so `fleetlens agent` on a GPU host starts light and runs without those installed."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("streamlit", "airflow", "hta", "torch")


def _heavy_after_import(module: str) -> list[str]:
    code = (
        f"import json, sys, {module}\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_command_line_imports_no_heavy_library():
    assert _heavy_after_import("ui.cli") == []


def test_the_check_sees_a_heavy_import():
    # the dashboard's pages do import Streamlit: the same check must report it
    assert _heavy_after_import("ui.dashboard.common") == ["streamlit"]
