"""The demo's jobs (collector.examples.train) profiled for real on the CPU: the tiny-steps job gets the finding that
its steps are too small, with the numbers that prove it; the healthy job gets none.

Each job's own model, batch and optimizer (train.py's defaults for the mode, the demo's hidden width for the
healthy job) run under torch.profiler as the job SDK runs them; the arithmetic figures are recomputed from the
raw trace events.
"""

from __future__ import annotations

import pytest

from analyzer.rules import load_thresholds
from analyzer.traces.run import analyze_one
from collector.examples.train import build_model, parse_args
from tests.analyzer import raw_trace as R
from tests.analyzer.conftest import words_of_other_devices
from ui.serve.demo import HEALTHY_HIDDEN

TH = load_thresholds()
MATH = ("aten::mm", "aten::addmm", "aten::bmm")


def _profile(path, mode: str, hidden: int | None = None, steps: int = 6) -> None:
    import torch  # noqa: PLC0415  (heavy: only these tests need it)
    from torch.profiler import ProfilerActivity, profile, schedule  # noqa: PLC0415

    args = parse_args(["--mode", mode] + (["--hidden", str(hidden)] if hidden else []))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.width, args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=2, active=steps)) as prof:
        for _ in range(steps + 3):
            x, y = torch.randn(args.batch_size, args.width), torch.randn(args.batch_size, 1)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            prof.step()
    prof.export_chrome_trace(str(path))


def _arithmetic_share(raw: R.Raw) -> float:
    ops = [e for n in MATH for e in raw.cpu(n)]
    return R.inside(R.spans(ops), raw.steps) / sum(e - s for s, e in raw.steps)


def test_tiny_steps_job_is_told_its_steps_are_too_small(tmp_path):
    path = tmp_path / "tiny.json"
    _profile(path, "tiny")
    raw = R.load(path)
    share = _arithmetic_share(raw)
    assert share < TH["tiny_steps"]["arithmetic_share_max"]
    summary, found = analyze_one(path)
    f = next(f for f in found if f.rule == "trace.tiny_steps")
    assert f.evidence["arithmetic_share"] == pytest.approx(share, abs=0.005)
    assert f.evidence["step_ms"] <= TH["tiny_steps"]["step_ms_max"]
    assert f.evidence["dataloader_share"] == 0.0  # the batches are made in the loop: nothing to wait for
    assert f.cost_fraction == pytest.approx(1 - share, abs=0.005)
    assert "Steps too small" in f.title and "batch size" in f.fix
    assert summary["device_kind"]["kind"] == "cpu"
    # a CPU has no graph to replay the step as: the advice names none (it used to say "a CUDA graph")
    assert [words_of_other_devices(f.fix, "cpu") for f in found] == [[] for _ in found]
    assert "torch.compile" in f.fix


def test_healthy_job_gets_no_finding(tmp_path):
    path = tmp_path / "healthy.json"
    _profile(path, "healthy", hidden=HEALTHY_HIDDEN)
    share = _arithmetic_share(R.load(path))
    assert share > TH["tiny_steps"]["arithmetic_share_max"]
    _, found = analyze_one(path)
    assert found == []
