"""`fleetlens detect`, `findings` and `rank` include the serving rules; `fleetlens serving` sets SLOs, shows the
applications and right-sizes a stored serving workflow; a user's mistake is one line and exit code 2."""

from __future__ import annotations

import json

from store.serving_raw import write_raw
from tests.ui.serving_seed import WORKFLOW, seed_serving
from ui.cli import run


def test_detect_findings_and_rank_include_serving(cli_store, capsys) -> None:
    seed_serving(cli_store)
    assert run(["detect", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"serving.dynamic_runtime", "serving.over_provisioned"} <= set(out["rules"])
    assert out["rules"]["serving.over_provisioned"]["gpu_hours_per_day"] > 0
    assert run(["findings", "--json"]) == 0
    rules = {f["rule"] for f in json.loads(capsys.readouterr().out)}
    assert "serving.over_provisioned" in rules
    assert run(["rank", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert WORKFLOW in json.dumps(ranked)


def test_serving_commands(cli_store, capsys) -> None:
    seed_serving(cli_store)
    assert run(["serving", "slo", WORKFLOW, "img2img", "0.5", "--target", "0.95"]) == 0
    assert run(["serving", "show"]) == 0
    shown = capsys.readouterr().out
    assert "img2img" in shown and "0.5" in shown and "raw requests kept" not in shown
    with cli_store.session() as s:  # a workflow that keeps raw requests: its stored rows and those over the cap
        write_raw(s, WORKFLOW, [{"app": "img2img", "arrival": 1.0, "wait_s": 0.0, "exec_s": 1.0, "latency_s": 1.0,
                                 "batch_size": 1}] * 3, 2)
    assert run(["serving", "show"]) == 0
    kept = capsys.readouterr().out.split("raw requests kept")[1]
    assert WORKFLOW in kept and " 2 " in kept and " 1 " in kept
    assert run(["serving", "rightsize", WORKFLOW, "--scheduler", "ours", "--scheduler", "clockwork_like"]) == 0
    assert "right size:" in capsys.readouterr().out
    assert run(["serving", "rightsize", WORKFLOW, "--scheduler", "fifo"]) == 2
    assert "one of ours" in capsys.readouterr().err
    assert run(["serving", "slo", WORKFLOW, "img2img", "-1"]) == 2
    assert "-1.0 is not a positive number of seconds" in capsys.readouterr().err
    assert run(["serving", "slo", "no-such-service", "img2img", "1"]) == 2
    assert "no workflow 'no-such-service' in the store" in capsys.readouterr().err
