"""A Slurm shard job's memory cap (collector.slurm_job.memory_cap): `shard:N` of a GPU Slurm splits into S shards
holds N/S of it, read from what Slurm gives the job (SLURM_SHARDS_ON_NODE, CUDA_VISIBLE_DEVICES, the node's line in
slurm.conf); an explicit FLEETLENS_MEMORY_FRACTION wins; anything missing or unreadable means no cap, with the
reason. On the CPU the SDK computes and reports the cap (its start mark, its log) and enforces nothing."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

from collector.job import job
from collector.slurm_job import memory_cap
from store.settings import Settings
from store.slurm_marks import job_folder, read_started

CONF = """# the local cluster's, as local-cluster.sh writes it
GresTypes=gpu,shard
NodeName=node1 NodeAddr=127.0.0.1 NodeHostname=node1 CPUs=8 Gres=gpu:4,shard:8 State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    path = tmp_path / "slurm.conf"
    path.write_text(CONF)
    return path


def _settings(conf: Path, **kw) -> Settings:
    update = {"slurm_job_id": 42, "slurm_shards_on_node": "1", "cuda_visible_devices": "2", "slurmd_nodename": "node1",
              "slurm_conf": conf, **kw}
    return Settings(home=conf.parent / "home", sdk_retry_s=3600).model_copy(update=update)


def test_a_shard_job_is_capped_at_its_share_of_the_gpu(conf: Path):
    fraction, note = memory_cap(_settings(conf))
    assert fraction == 0.5 and "1 shard(s) on 1 GPU(s) of 2" in note and "4 GPUs" in note  # shard:1 of 2
    assert memory_cap(_settings(conf, slurm_shards_on_node="2"))[0] == 1.0  # shard:2 of 2: the whole GPU
    assert memory_cap(_settings(conf, slurm_shards_on_node="2", cuda_visible_devices="0,1"))[0] == 0.5  # one a GPU
    # where the job cannot read slurm.conf, the shards per GPU set outright
    assert memory_cap(_settings(conf, slurm_conf=conf.parent / "missing", slurm_shards_per_gpu=4))[0] == 0.25


def test_on_a_node_whose_shards_do_not_divide_evenly_the_job_s_own_gpu_decides(conf: Path):
    conf.write_text(CONF.replace("shard:8", "shard:6"))  # Slurm spreads 6 shards on 4 GPUs as 1, 1, 2, 2
    fraction, note = memory_cap(_settings(conf, slurm_job_gpus="3"))
    assert fraction == 0.5 and "GPU(s) 3 split into 2" in note
    assert memory_cap(_settings(conf, slurm_job_gpus="0"))[0] == 1.0  # GPU 0's one shard is all of it
    # shard:2 over GPUs 1 and 2: one a GPU, so half of GPU 2 (the smaller share where its GPUs differ)
    assert memory_cap(_settings(conf, slurm_shards_on_node="2", cuda_visible_devices="0,1",
                                slurm_job_gpus="1,2"))[0] == 0.5
    for unknown in (None, "", "7", "x"):  # which GPU is the job's is not known: no cap, with the reason
        fraction, note = memory_cap(_settings(conf, slurm_job_gpus=unknown))
        assert fraction is None and "spread unevenly (1, 1, 2, 2)" in note and "SLURM_JOB_GPUS" in note
    conf.write_text(CONF.replace("shard:8", "shard:3"))  # 0, 1, 1, 1: GPU 0 has no shard to hold
    assert memory_cap(_settings(conf, slurm_job_gpus="0"))[0] is None
    assert memory_cap(_settings(conf, slurm_job_gpus="1"))[0] == 1.0


def test_an_explicit_memory_fraction_wins(conf: Path):
    assert memory_cap(_settings(conf, memory_fraction=0.3)) == (0.3, "FLEETLENS_MEMORY_FRACTION")


@pytest.mark.parametrize(("change", "why"), [
    ({"slurm_shards_on_node": None}, "not a shard job"),
    ({"slurm_shards_on_node": "two"}, "not a number of shards"),
    ({"slurm_shards_on_node": "0"}, "not a number of shards"),
    ({"cuda_visible_devices": ""}, "no GPU"),
    ({"slurmd_nodename": None}, "SLURMD_NODENAME is not set"),
    ({"slurmd_nodename": "node9"}, "no NodeName line for node node9"),
    ({"slurm_conf": Path("/nonexistent/slurm.conf")}, "cannot be read"),
])
def test_missing_or_bad_facts_mean_no_cap_with_the_reason(conf: Path, change: dict, why: str):
    fraction, note = memory_cap(_settings(conf, **change))
    assert fraction is None and why in note


def test_a_gres_it_cannot_read_means_no_cap(conf: Path):
    conf.write_text("NodeName=node1 Gres=gpu:4,shard:8:x\n")
    fraction, note = memory_cap(_settings(conf))
    assert fraction is None and "cannot read" in note


def test_on_the_cpu_the_sdk_reports_its_cap_and_its_opt_in_and_enforces_nothing(conf: Path, fleet_home: Path,
                                                                                   caplog):
    settings = _settings(conf)
    before = signal.getsignal(signal.SIGUSR1)  # the SDK catches the checkpoint signal under Slurm
    try:
        with caplog.at_level(logging.INFO, logger="collector.slurm_job"):
            with job("capped", total_steps=2, workflow="slurm-42", settings=settings, movable=True) as j:
                assert list(j.steps()) == [0, 1]
                assert j.memory_fraction_applied is None  # no CUDA here: nothing to cap, nothing broken
        started = read_started(job_folder(settings, "slurm-42"))
        assert (started.movable, started.memory_fraction) == (True, 0.5)
        assert "not enforced" in started.memory_note and "memory cap 0.5" in caplog.text
        with job("asked-not", total_steps=1, workflow="slurm-42", settings=settings) as j:  # FLEETLENS_MOVABLE unset
            list(j.steps())
        assert read_started(job_folder(settings, "slurm-42")).movable is False
        by_env = settings.model_copy(update={"movable": True})
        with job("by-env", total_steps=1, workflow="slurm-42", settings=by_env) as j:
            list(j.steps())
        assert read_started(job_folder(settings, "slurm-42")).movable is True
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_the_node_line_is_found_through_slurm_conf_includes(tmp_path: Path):
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "gpu-c1.conf").write_text(
        "NodeName=DEFAULT Gres=gpu:4,shard:16  # every GPU node\nNodeName=node[1-2] CPUs=8\n")
    (tmp_path / "partitions.conf").write_text("PartitionName=debug Nodes=node[1-2] Default=YES\n")
    main = tmp_path / "slurm.conf"
    # relative names are looked up beside slurm.conf; %c is the cluster's name; a commented Include is no Include
    main.write_text("ClusterName=c1\n#Include nowhere.conf\nGresTypes=gpu,shard\ninclude nodes/gpu-%c.conf\n"
                    f"Include {tmp_path / 'partitions.conf'}\n")
    fraction, note = memory_cap(_settings(main))
    assert fraction == 0.25 and "16 shards on 4 GPUs" in note  # shard:1 of 4 per GPU


@pytest.mark.parametrize(("main", "why"), [
    ("Include missing.conf\n", "missing.conf"),  # the file it names, in the reason
    ("Include\n", "Include line with no file name"),
    ("Include slurm.conf\n", "nested more than"),  # a loop
])
def test_an_include_it_cannot_follow_means_no_cap_with_the_reason(tmp_path: Path, main: str, why: str):
    conf = tmp_path / "slurm.conf"
    conf.write_text("NodeName=node1 Gres=gpu:4,shard:8\n" + main)
    fraction, note = memory_cap(_settings(conf))
    assert fraction is None and why in note
