"""Fixtures for the trace analyzer tests: the shared real traces, parsed once per session where they are big."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from analyzer.rules import load_thresholds
from tests.conftest import TRACES


def raw_events(name: str) -> list[dict]:
    """The trace's events straight from the JSON, to check the analyzer's counts against."""
    with gzip.open(TRACES / name, "rb") as fh:
        return json.loads(fh.read())["traceEvents"]


@pytest.fixture(scope="session")
def thresholds() -> dict:
    return load_thresholds()


def every_cost_thresholds() -> dict:
    """The packaged thresholds with every finding reported however little it costs ([common] material_cost_fraction
    0): to check a rule's figures on a trace where what it finds is too small to report."""
    th = load_thresholds()
    return {**th, "common": {**th["common"], "material_cost_fraction": 0.0}}


@pytest.fixture(scope="session")
def trace_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace-cache")


@pytest.fixture(scope="session")
def rank3(trace_cache: Path):
    """The 8-rank A100 training trace (rank 3): big, so analysed once for the session."""
    from analyzer.traces.run import analyze_one

    return analyze_one(TRACES / "a100_8rank_rank3_training.json.gz", cache_dir=trace_cache)


# words of NVIDIA's stack only: advice for another device must not name them (NCCL_DEBUG is RCCL's variable too)
CUDA_ONLY = (r"CUDA", r"\bcuda[A-Z]\w*", r"(?i)cudnn", r"(?i)cublas", r"(?i)tensor cores?", r"(?i)nvidia", r"\bDALI\b",
             r"\bNCCL\b(?!_DEBUG)")
# on a device that is no GPU at all, PyTorch's CUDA namespace and the word GPU do not apply either
NOT_A_GPU = (r"(?i)cuda", r"\bNCCL", r"\bGPU\b", r"\bHIP\b")


def words_of_other_devices(text: str, kind: str) -> list[str]:
    """The words in a finding's advice that belong to another device's API than the trace's (kind: device_kind)."""
    if kind == "cuda":
        return []
    patterns = CUDA_ONLY + (NOT_A_GPU if kind != "rocm" else ())
    return [m.group(0) for p in patterns for m in re.finditer(p, text)]
