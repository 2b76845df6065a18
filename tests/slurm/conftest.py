"""The session's real Slurm cluster: started once with ../shared/slurm/local-cluster.sh, always stopped. Tests marked
`slurm` use it; without Slurm installed they are skipped, except with CI=true, where they fail."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.settings import Settings
from tests.slurm.cluster import PROJECT_ROOT, Cluster, unavailable_reason


def started_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, **kw: int) -> Iterator[Cluster]:
    """A cluster of its own under a new temporary folder, started, and stopped however the tests end."""
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}, and the Slurm tests must run when CI=true")
        pytest.skip(reason)
    cluster = Cluster(tmp_path_factory.mktemp(name) / "cluster", **kw)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from started_cluster(tmp_path_factory, "slurm")


@pytest.fixture
def slurm(slurm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The cluster, empty at the start and at the end of the test, with SLURM_CONF in this process's environment."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()


@pytest.fixture
def job_env(fleet_home: Path) -> dict[str, str]:
    """What a submitted job needs: this tree first on its path, and the test's FLEETLENS_HOME."""
    return {"PYTHONPATH": str(PROJECT_ROOT), "FLEETLENS_HOME": str(fleet_home), "FLEETLENS_SECRET": "test-secret"}


@pytest.fixture
def slurm_settings(fleet_home: Path) -> Settings:
    return Settings(home=fleet_home, slurm_checkpoint_timeout_s=60, slurm_resume_timeout_s=60)
