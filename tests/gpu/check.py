"""`make gpu-check`: on a machine with one NVIDIA GPU, run the `gpu` tests (the nvml source idle and busy, the
two-job lane test under PACK with its no-wait control, the memory caps, the two-lane MPS test at 70 %/30 %, the
demo), then the lane gate benchmark, within a time limit, and print one JSON summary: the host, each test's
outcome, the figures the tests measured and the benchmark's line. Nothing is fetched from the network. Exit
status 0 when every test that could run passed, 1 when one failed or the time ran out, 2 when this machine cannot
run them (the summary says why).

    python -m tests.gpu.check --timeout 450 --out gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from tests.conftest import PROJECT_ROOT
from tests.gpu.probe import gpu_unavailable_reason


def host_facts() -> dict[str, Any]:
    """What the summary says of the machine: Python, torch and CUDA, the driver and the GPUs NVML lists."""
    facts: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                     cuda_available=bool(torch.cuda.is_available()))
    except Exception as exc:  # a host without torch still gets its summary
        facts["torch"] = f"not importable: {exc}"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    mig = int(pynvml.nvmlDeviceGetMigMode(h)[0])
                except pynvml.NVMLError:
                    mig = None
                gpus.append({"name": pynvml.nvmlDeviceGetName(h), "uuid": pynvml.nvmlDeviceGetUUID(h), "mig": mig})
            facts["gpus"] = gpus
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        facts["nvml"] = f"unavailable: {exc}"
    return facts


def _outcomes(junit: Path) -> dict[str, dict[str, Any]]:
    """Each test case's outcome, seconds and message from pytest's JUnit XML."""
    if not junit.exists():
        return {}
    tests: dict[str, dict[str, Any]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or found.text or "")[:500]
                break
        tests[name] = {"outcome": outcome, "seconds": round(float(case.get("time") or 0.0), 2),
                       **({"message": message} if message else {})}
    return tests


def _benchmarks(left_s: float) -> dict[str, Any]:
    """The lane gate benchmark's JSON line (its GPU part: kernel overlap, the event wait's and the memory release's
    cost per step), in the time left; what went wrong otherwise."""
    if left_s < 30:
        return {"lane_gate": f"not run: {left_s:.0f} s left of the time limit"}
    try:
        done = subprocess.run([sys.executable, "benchmarks/lane_gate.py"], cwd=PROJECT_ROOT, capture_output=True,
                              text=True, timeout=left_s)
        return {"lane_gate": json.loads(done.stdout.strip().splitlines()[-1])}
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
        return {"lane_gate": f"failed: {type(exc).__name__}: {exc}"}


def run(timeout_s: float, extra: list[str]) -> tuple[dict[str, Any], int]:
    started = time.monotonic()
    summary: dict[str, Any] = {"check": "fleetlens gpu-check", "host": host_facts()}
    reason = gpu_unavailable_reason()
    if reason is not None:
        summary.update(ok=False, reason=f"this machine cannot run the gpu tests: {reason}")
        return summary, 2
    with tempfile.TemporaryDirectory(prefix="fleetlens-gpu-check-") as tmp:
        figures_dir, junit = Path(tmp, "figures"), Path(tmp, "junit.xml")
        figures_dir.mkdir()
        env = {**os.environ, "FLEETLENS_GPU_CHECK_DIR": str(figures_dir), "PYTHONPATH": str(PROJECT_ROOT)}
        env.pop("CI", None)
        command = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                   f"--junitxml={junit}", "-o", "junit_family=xunit1", *extra]
        proc = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the test run and every job it started
            output, _ = proc.communicate()
        tests = _outcomes(junit)
        figures = {p.stem: json.loads(p.read_text()) for p in sorted(figures_dir.glob("*.json"))}
    summary["benchmarks"] = _benchmarks(timeout_s - (time.monotonic() - started))
    ran = [t for t in tests.values() if t["outcome"] != "skipped"]
    failed = [name for name, t in tests.items() if t["outcome"] in ("failed", "error")]
    ok = not timed_out and proc.returncode == 0 and bool(ran) and not failed
    summary.update(ok=ok, elapsed_s=round(time.monotonic() - started, 1), timed_out=timed_out,
                   pytest_exit=proc.returncode, passed=sum(t["outcome"] == "passed" for t in tests.values()),
                   failed=failed, skipped=[n for n, t in tests.items() if t["outcome"] == "skipped"],
                   tests=tests, figures=figures)
    if not ok:
        summary["pytest_tail"] = output[-4000:]
    return summary, 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=450.0, help="seconds for the whole test run (then killed)")
    ap.add_argument("--out", default=None, help="also write the summary to this file")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. -k 'not demo')")
    args = ap.parse_args(argv)
    summary, code = run(args.timeout, args.pytest_args)
    line = json.dumps(summary, default=str)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
