"""Readers on bad input: malformed rows skipped and counted; missing columns named; the CLI prints one line."""

from __future__ import annotations

import gzip

import pytest

from enforcer.sim.readers.alibaba import read_alibaba
from enforcer.sim.readers.openb import read_openb
from enforcer.sim.readers.salus import read_salus
from store.errors import InvalidInput
from tests.conftest import FLEET
from ui.cli import run

POD_HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
              "creation_time,deletion_time,scheduled_time\n")


def test_openb_malformed_rows_counted(tmp_path):
    f = tmp_path / "pods.csv"
    f.write_text(POD_HEADER
                 + "p0,1000,1024,1,500,,LS,Running,0,100,10\n"
                 + "p1,1000,1024,one,500,,LS,Running,0,100,10\n"  # num_gpu not a number
                 + "p2,1000,1024,1,500,,LS,Running,0,100,10,extra,fields\n"  # too many fields
                 + "p3,1000,1024,0,0,,LS,Running,0,100,10\n"  # CPU only
                 + "p4,1000,1024,1,500,,LS,Pending,5,6,\n"  # never scheduled
                 + "p5,1000,1024,2,1000,,LS,Running,3,50,4\n")
    tr = read_openb(f)
    assert [j.id for j in tr.jobs] == ["p0", "p5"]
    assert tr.jobs[0].share == 0.5 and tr.jobs[0].work == 90 and tr.jobs[1].gpus == 2
    assert tr.report.skipped == {"malformed": 2, "cpu_only": 1, "never_scheduled": 1}
    assert tr.report.rows == 6 and tr.cluster is None


def test_openb_missing_columns_named(tmp_path):
    f = tmp_path / "pods.csv"
    f.write_text("name,num_gpu\np0,1\n")
    with pytest.raises(InvalidInput) as exc:
        read_openb(f)
    msg = str(exc.value)
    assert "lacks the columns gpu_milli, creation_time, deletion_time, scheduled_time" in msg
    assert "found name, num_gpu" in msg


def test_salus_too_few_columns_and_bad_rows(tmp_path):
    f = tmp_path / "w.csv"
    f.write_text("vgg11_25_1min,67.0\n")
    with pytest.raises(InvalidInput, match=r"expected 5 columns .* found 2"):
        read_salus(f)
    f.write_text("a_1,60,1000,10,python x.py --model=alexnet\nb_1,oops,1000,10,python\nc_1,-5,1,1,python\n")
    tr = read_salus(f, n_jobs=5, seed=3)
    assert len(tr.jobs) == 5 and all(j.model == "alexnet" for j in tr.jobs)
    assert tr.report.skipped == {"malformed": 2}


def test_salus_workload_is_seeded():
    a = read_salus(FLEET / "salus_workloads.csv", seed=7)
    b = read_salus(FLEET / "salus_workloads.csv", seed=7)
    c = read_salus(FLEET / "salus_workloads.csv", seed=8)
    assert a.jobs == b.jobs and a.jobs != c.jobs and len(a.jobs) == 100
    assert all(x.arrival <= y.arrival for x, y in zip(a.jobs, a.jobs[1:], strict=False))


def test_alibaba_bad_rows_and_missing_columns(tmp_path):
    with gzip.open(tmp_path / "alibaba_genai_pod_gpu_duty_cycle.csv.gz", "wt") as fh:
        fh.write("value,timestamp_anon,container_ip\n10,0,c1\n20,60,c1\nxx,120,c1\n50,0,c2\n")
    with gzip.open(tmp_path / "alibaba_genai_pod_gpu_memory_used_bytes.csv.gz", "wt") as fh:
        fh.write("timestamp_anon,value,container_ip\n0,1000,c1\n60,3000,c1\n")
    tr = read_alibaba(tmp_path)
    assert [j.id for j in tr.jobs] == ["c1"] and tr.jobs[0].mem == 3000
    assert tr.report.skipped == {"malformed": 1, "one_series_only": 1}
    with gzip.open(tmp_path / "alibaba_genai_pod_gpu_memory_used_bytes.csv.gz", "wt") as fh:
        fh.write("ts,bytes\n0,1\n")
    with pytest.raises(InvalidInput, match="expected value, timestamp_anon, container_ip; found ts, bytes"):
        read_alibaba(tmp_path)


def test_cli_bad_trace_one_line(fleet_home, capsys):
    assert run(["simulate", "--trace", "openb:" + str(FLEET / "salus_workloads.csv")]) == 2
    assert "lacks the columns" in capsys.readouterr().err
    assert run(["simulate", "--trace", "nope:/x"]) == 2
    assert run(["simulate", "--trace", "alibaba:" + str(FLEET), "--nodes", "0x8"]) == 2
    capsys.readouterr()
    for kind in ("openb", "salus", "alibaba"):  # no path after the colon: said in one line, not a traceback
        assert run(["simulate", "--trace", f"{kind}:"]) == 2
        assert "after the colon" in capsys.readouterr().err


def test_cli_table_and_html(fleet_home, tmp_path, capsys):
    out = tmp_path / "report.html"
    code = run(["simulate", "--trace", f"salus:{FLEET / 'salus_workloads.csv'}", "--policy", "fifo",
                "--policy", "srtf", "--one-lane", "--jobs", "20", "--html", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "fifo" in text and "srtf/1-lane" in text and "mean JCT" in text
    page = out.read_text()
    assert "plotly" in page and "srtf/1-lane" in page and "device-hours" in page
