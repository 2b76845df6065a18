"""`fleetlens detect`, `findings` and `rank` include the serving rules; `fleetlens serving` sets SLOs, shows the
applications and right-sizes a stored serving workflow; a user's mistake is one line and exit code 2."""

from __future__ import annotations

import json
import time

from store import latency_sketch as ls
from store.serving import merge_minutes, set_slo
from store.serving_raw import write_raw
from store.workflows import upsert_workflow
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



def test_rightsize_blames_the_slo_only_when_requests_miss_it_even_alone(cli_store, capsys) -> None:
    # one 0.1 s request every 10 s and an SLO of 0.105 s: every request fits alone, but a scheduler that holds a
    # batch open for more requests misses all of them, on any number of devices
    now = time.time()
    eh: dict[int, int] = {}
    ls.add(eh, 0.1, 6)
    recs = [{"app": "a", "minute": (now - (30 - i) * 60.0) // 60 * 60, "n": 6, "dropped": 0, "met": 6,
             "exec_sum": 0.6, "exec_sumsq": 0.06, "wait_sum": 0.0, "latency_sum": 0.6, "batch_sum": 6,
             "exec_hist": ls.to_json(eh), "latency_hist": ls.to_json(eh)} for i in range(30)]
    with cli_store.session() as s:
        upsert_workflow(s, "svc")
        set_slo(s, "svc", "a", 0.105)
        merge_minutes(s, "svc", recs, devices=1)
    assert run(["serving", "rightsize", "svc", "--scheduler", "triton_like"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "even alone (relax the SLO" not in out
    assert "no number of devices up to 64 reaches 99.0% with triton_like" in out
    # with the SLO below the execution time, it is the SLO that no number of devices can help
    with cli_store.session() as s:
        set_slo(s, "svc", "a", 0.05)
    assert run(["serving", "rightsize", "svc", "--scheduler", "triton_like"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "only 0.00% of requests run within their SLO even alone (relax the SLO or the target)" in out
