"""What the Ray Tune tests need: the tune extra installed; without it they fail when CI=true and are skipped
elsewhere."""

from __future__ import annotations

import os

import pytest


def need_ray() -> tuple[object, object]:
    """Ray and Ray Tune, or the test fails (CI=true) or is skipped."""
    try:
        import ray
        from ray import tune
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("Ray Tune is not installed, and the ray tests must run when CI=true (pip install .[tune])")
        pytest.skip("Ray Tune is not installed (the tune extra)")
    return ray, tune
