"""A small PyTorch trainable for the Ray Tune sweeps: real training steps, checkpoints through Ray's API, and a
step time set by the test (seconds per step alone, slowed or sped by its width as the speed model says). With
`fail_wide` it raises once, in its first step on more than one GPU, before reporting it (`marker` notes that it
did)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import ray
import torch
from ray import tune

from collector.tune.scheduler import GPU_IDS, STEP_S, STEPS_LEFT
from enforcer.sweeps.speed import SpeedModel


def train(config: dict) -> None:
    width = float(tune.get_context().get_trial_resources().required_resources.get("GPU", 0.0))
    speed = SpeedModel(config["eta"], tuple(config["share_speeds"]), config["d"]).speed(width)
    torch.manual_seed(config["seed"])
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, config["steps"]):
        began = time.monotonic()
        x = torch.randn(64, 8)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(max(0.0, config["step_s"] * config["scale"] / speed - (time.monotonic() - began)))
        if config.get("fail_wide") and width > 1.0 and not Path(config["marker"]).exists():
            Path(config["marker"]).write_text(f"died at step {step} on {width} GPUs")
            raise RuntimeError("the test's failure")
        with tempfile.TemporaryDirectory() as folder:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                       Path(folder) / "state.pt")
            tune.report({"loss": float(loss), "width": width, "resumed_at": start, STEP_S: config["step_s"],
                         STEPS_LEFT: config["steps"] - step - 1, GPU_IDS: ray.get_gpu_ids()},
                        checkpoint=tune.Checkpoint.from_directory(folder))
