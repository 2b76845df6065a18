"""`fleetlens analyze`: terminal report, --json, --html (self-contained, plotly inline), --store."""

from __future__ import annotations

import json

from sqlalchemy import select

from store.db import Store
from store.models import Trace
from tests.conftest import TRACES
from ui.cli import run

ALEXNET = TRACES / "a100_alexnet_microbench.json.gz"


def test_terminal_report(fleet_home, capsys):
    assert run(["analyze", str(ALEXNET)]) == 0
    out = capsys.readouterr().out
    assert "trace.host_bound" in out and "memory copies" in out and "top kernels" in out


def test_json_output(fleet_home, capsys):
    assert run(["analyze", str(TRACES / "amd_mi250_minitoy.json.gz"), "--json", "--gpus", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["traces"][0]["launch"]["kernels"] == 14
    assert all(f["gpu_hours_per_day"] <= 8 * 24 for f in out["findings"])


def test_html_is_one_self_contained_page(fleet_home, tmp_path, capsys):
    page = tmp_path / "report.html"
    assert run(["analyze", str(ALEXNET), "--html", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "plotly" in text.lower()
    assert '<script src="http' not in text  # plotly.js is inline
    assert "trace.host_bound" in text


def test_html_into_a_missing_folder_is_one_line_and_exit_2(fleet_home, tmp_path, capsys):
    page = tmp_path / "no" / "report.html"
    assert run(["analyze", str(ALEXNET), "--html", str(page)]) == 2
    err = capsys.readouterr().err
    assert "cannot write the HTML report" in err and "Traceback" not in err and not page.exists()
    (tmp_path / "dir.html").mkdir()  # the folder exists, the file cannot be written: said the same way
    assert run(["analyze", str(ALEXNET), "--html", str(tmp_path / "dir.html")]) == 2
    assert "cannot write the HTML report" in capsys.readouterr().err


def test_store_option_registers_and_analyses(fleet_home, capsys):
    assert run(["init"]) == 0
    assert run(["analyze", str(ALEXNET), "--store", "--workflow", "alexnet"]) == 0
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    with store.session() as s:
        traces = s.scalars(select(Trace)).all()
        assert [(t.status, t.workflow_id) for t in traces] == [("analyzed", "alexnet")]
    store.dispose()


A100 = TRACES / "a100_80gb_16rank_rank0_training.json.gz"


def test_progress_bar_on_a_terminal_shows_bytes_events_and_time(fleet_home, capsys, monkeypatch):
    import io  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    import ui.cli.analyze as cli_analyze  # noqa: PLC0415

    screen = io.StringIO()
    monkeypatch.setattr(cli_analyze, "err_console", Console(file=screen, force_terminal=True, width=160))
    assert run(["analyze", str(A100), "--no-cache"]) == 0
    shown = screen.getvalue()
    size_mb = A100.stat().st_size / 1e6
    assert "reading a100_80gb_16rank_rank0_training.json.gz" in shown
    assert f"{size_mb:.1f}/{size_mb:.1f} MB" in shown  # bytes read of the file, up to the whole file
    assert "108,936 events" in shown  # every event of the trace, counted as read
    assert "0:00:" in shown  # elapsed time


def test_json_output_has_no_progress(fleet_home, capsys, monkeypatch):
    import io  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    import ui.cli.analyze as cli_analyze  # noqa: PLC0415

    screen = io.StringIO()
    monkeypatch.setattr(cli_analyze, "err_console", Console(file=screen, force_terminal=True, width=160))
    assert run(["analyze", str(A100), "--no-cache", "--json"]) == 0
    assert screen.getvalue() == ""
    captured = capsys.readouterr()
    assert json.loads(captured.out)["traces"][0]["events"] > 0
    assert captured.err == ""


def test_terminal_report_shows_each_top_kernel_on_one_line(fleet_home, capsys):
    trace = TRACES / "a100_8rank_rank3_training.json.gz"  # templated kernels with long signatures
    assert run(["analyze", str(trace), "--json"]) == 0
    top = json.loads(capsys.readouterr().out)["traces"][0]["top_kernels"]
    assert any(k["name"].startswith("void ") and "(" in k["name"] for k in top)
    assert run(["analyze", str(trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index(next(line for line in out if line.startswith("top kernels"))) + 4  # title, rule, header, rule
    rows = out[start:out.index(next(line for line in out[start:] if line.startswith("└")))]
    assert len(rows) == len(top)  # a long name is cut with an ellipsis, never wrapped onto more lines
    assert [r.split("│")[3].strip() for r in rows] == [str(k["count"]) for k in top]
    assert not any(r.split("│")[1].strip().startswith("void") for r in rows)  # no return type
