"""The Fleet and Workflow pages show Slurm jobs as the import read them from the real cluster: their request, the
GPUs they hold, their time limit, and whether fleetlens may move them."""

from __future__ import annotations

import pytest

from collector.importers.slurm import import_slurm
from tests.ui.helpers import assert_clean, metrics, page, texts

pytestmark = pytest.mark.slurm


def test_fleet_and_workflow_pages_show_slurm_jobs(slurm, slurm_settings, cli_store, tmp_path):
    store = cli_store
    movable = slurm.submit("sleep 120", gres="shard:2", comment="fleetlens:movable", time_limit="30", cwd=tmp_path,
                           name="resnet")
    whole = slurm.submit("sleep 120", gres="gpu:1", cwd=tmp_path, name="bert")
    slurm.wait_running(movable, whole)
    import_slurm(store, slurm_settings)
    jobs = slurm.jobs()

    at = page("fleet")
    assert_clean(at)
    shown = metrics(at)
    assert (shown["Slurm jobs running"], shown["Shards held"], shown["Opted in to moves"]) == ("2", "2", "1")
    table = next(df.value for df in at.dataframe if "gres" in df.value.columns)
    rows = table.set_index("workflow_id")
    assert rows.loc[f"slurm-{movable}", "gres"] == "shard:2" and rows.loc[f"slurm-{movable}", "movable"] == "yes"
    assert rows.loc[f"slurm-{movable}", "time_limit"] == "30 min"
    held = jobs[movable]["gres_detail"][0].split("IDX:")[1].rstrip(")")
    assert rows.loc[f"slurm-{movable}", "gpus_held"] == held
    assert "did not opt in" in rows.loc[f"slurm-{whole}", "movable"]

    at = page("workflow", workflow=f"slurm-{whole}")
    assert_clean(at)
    said = texts(at.markdown) + texts(at.caption)
    assert f"Slurm job **{whole}**" in said and "asked for **gpu:1**" in said
    assert "Observed and advised only: did not opt in" in said
