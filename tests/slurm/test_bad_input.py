"""Bad input from Slurm gets a clear message, never a traceback: the CLI missing or failing, JSON of another Slurm
version, a gres fleetlens does not understand (and the parsing of the gres it does)."""

from __future__ import annotations

import copy
import json

import pytest
from sqlalchemy import select

from collector.importers.slurm import import_slurm, record_view
from store.errors import InvalidInput, UpstreamUnavailable
from store.models import Host, Placement
from store.models_slurm import SlurmJob
from store.settings import Settings, get_settings
from store.slurm import Gres, SlurmView, held_indices, parse_gres, parse_indices, parse_jobs, parse_nodes
from store.slurm_cli import SlurmCli
from tests.fakes.fake_slurm import SlurmAnswers
from ui.cli import run


def test_gres_strings():
    assert parse_gres("gres:shard:2") == Gres("shard", 2)
    assert parse_gres("gpu:a100:3") == Gres("gpu", 3, "a100") and str(Gres("gpu", 3, "a100")) == "gpu:a100:3"
    assert parse_gres("gres:gpu") == Gres("gpu", 1)
    assert parse_gres("") is None and parse_gres("(null)") is None
    assert held_indices(["shard:1(IDX:2)"]) == [2] and held_indices(["gpu:3(IDX:0-1,3)"]) == [0, 1, 3]
    assert parse_indices("0-2,5") == [0, 1, 2, 5]
    for bad, says in (("gres:mps:100", "does not understand"), ("gres:shard:2,gres:gpu:1", "both"),
                      ("shard:two:x", "cannot read")):
        with pytest.raises(InvalidInput, match=says):
            parse_gres(bad)
    with pytest.raises(InvalidInput, match="GPU indices"):
        parse_indices("0-x")


def test_a_node_whose_gres_cannot_be_read_leaves_the_rest_of_the_cluster_imported(sqlite_store, fleet_home):
    slurm = SlurmAnswers(nodes=[{"name": "n1", "gres": "gpu:a100:4(S:0,2),shard:8"}, {"name": "n2", "gres": "gpu:x:y"}])
    slurm.jobs = [{"job_id": j, "job_state": "RUNNING", "submit_time": 1000, "tres_per_node": "gres:gpu:1",
                   "nodes": node, "batch_host": node, "gres_detail": ["gpu:1(IDX:0)"]} for j, node in ((1, "n1"),
                                                                                                    (2, "n2"))]
    result = import_slurm(sqlite_store, Settings(home=fleet_home), cli=slurm, now=1.0)
    assert (result.nodes, result.jobs) == (1, 2)
    assert len(result.errors) == 1 and "node n2 left out" in result.errors[0] and "gpu:x:y" in result.errors[0]
    with sqlite_store.session() as s:
        assert s.get(Host, "n1") is not None and s.get(Host, "n2") is None
        # the job on the readable node holds its GPU there; the other is observed without a placement
        held = {p.workflow_id for p in s.scalars(select(Placement).where(Placement.state == "active"))}
        assert held == {"slurm-1"} and s.get(SlurmJob, "slurm-2").state == "RUNNING"


def test_squeue_missing_says_what_to_install(tmp_path, sqlite_store, fleet_home, monkeypatch, capsys):
    with pytest.raises(UpstreamUnavailable, match=r"squeue is not in .*\(FLEETLENS_SLURM_BIN_DIR\).*slurm-client"):
        import_slurm(sqlite_store, Settings(home=fleet_home), cli=SlurmCli(bin_dir=tmp_path))
    with sqlite_store.session() as s:
        assert s.scalars(select(SlurmJob)).first() is None
    # the command line says it in one line, without a traceback
    monkeypatch.setenv("FLEETLENS_DB_URL", str(sqlite_store.url))
    monkeypatch.setenv("FLEETLENS_SLURM_BIN_DIR", str(tmp_path))
    get_settings(fresh=True)
    assert run(["slurm-import"]) == 2
    err = capsys.readouterr().err
    assert "squeue is not in" in err and "Traceback" not in err


@pytest.mark.slurm
def test_squeue_that_cannot_reach_slurmctld(slurm, sqlite_store, slurm_settings, tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    text = open(slurm.env["SLURM_CONF"]).read()
    port = slurm.env["SLURM_LOCAL_CTLD_PORT"]
    conf.write_text(text.replace(f"SlurmctldPort={port}", "SlurmctldPort=9"))  # nothing listens there
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(UpstreamUnavailable, match="could not read the cluster.*slurmctld up"):
        import_slurm(sqlite_store, slurm_settings)


@pytest.mark.slurm
def test_json_of_another_version_and_an_unknown_gres(slurm, any_store, slurm_settings, tmp_path):
    job = slurm.submit("sleep 60", gres="shard:1", comment="fleetlens:movable", cwd=tmp_path)
    slurm.wait_running(job)
    doc = json.loads(slurm.run("squeue", "--json"))
    newer = copy.deepcopy(doc)
    newer["meta"]["plugin"]["type"] = "openapi/v0.0.39"
    newer["meta"]["Slurm"]["release"] = "23.02.7"
    with pytest.raises(InvalidInput, match=r"openapi/v0\.0\.39 \(Slurm 23\.02\.7\).*v0\.0\.38 \(Slurm 22\.05\)"):
        parse_jobs(newer)
    with pytest.raises(InvalidInput, match="did not print Slurm's JSON"):
        parse_jobs({"jobs": []})
    # a gres this version of fleetlens does not read: the job is observed, without GPUs, and never movable
    odd = copy.deepcopy(doc)
    for raw in odd["jobs"]:
        raw["tres_per_node"] = "gres:mps:50"
    version, jobs = parse_jobs(odd)
    _, nodes = parse_nodes(json.loads(slurm.run("sinfo", "--json")))
    result = record_view(any_store, SlurmView(version=version, nodes=nodes, jobs=jobs), slurm_settings, now=1.0)
    assert any("'mps'" in e and "never moved" in e for e in result.errors)
    # the same cluster read properly: the job holds its GPU (on SQLite and PostgreSQL alike)
    import_slurm(any_store, slurm_settings)
    with any_store.session() as s:
        row = s.get(SlurmJob, f"slurm-{job}")
        assert row.opted_in and row.gres == "shard:1" and len(row.gpu_indices) == 1
        assert s.scalars(select(Placement).where(Placement.workflow_id == f"slurm-{job}",
                                                 Placement.state == "active")).one().compute_share == 0.5
    record_view(any_store, SlurmView(version=version, nodes=nodes, jobs=jobs), slurm_settings, now=2.0)
    with any_store.session() as s:
        row = s.get(SlurmJob, f"slurm-{job}")
        assert row.state == "RUNNING" and not row.opted_in and "cannot be read" in row.not_movable_reason
        assert s.scalars(select(Placement).where(Placement.workflow_id == f"slurm-{job}",
                                                 Placement.state == "active")).first() is None
