"""A small, real torch training job on the job SDK: the workload tests, the demo and migrations launch.

    python -m collector.examples.train --mode healthy --steps 500

Modes: `healthy` (an MLP doing real work each step), `input-bound` (a DataLoader whose dataset sleeps
`--loader-delay` per batch), `idle-holder` (holds `--hold-mb` of memory and mostly sleeps), `tiny` (very small
steps: launch/overhead-bound). Batches are a pure function of the step index, so a resumed run sees exactly the
batches it would have seen. Checkpoints (on the agent's request, or every `--save-every` steps) hold model,
optimizer, RNG state and the next step, written to a temporary file and renamed into place, so a checkpoint
is whole or absent. A run resumes from `--resume PATH` or FLEETLENS_RESUME_FROM (a file, or a folder whose
newest checkpoint is used) at the saved step. The last stdout line is a JSON summary of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from collector.job import job
from collector.sdk_settings import job_settings
from store.errors import FleetlensError
from store.paths import path_component

MODES = ("healthy", "input-bound", "idle-holder", "tiny")
CHECKPOINT_GLOB = "step-*.pt"


class StepBatches(Dataset):
    """Batch `i` (a whole batch per index) depends only on i and the seed, so resuming replays nothing twice."""

    def __init__(self, first: int, last: int, batch: int, width: int, seed: int, delay_s: float) -> None:
        self.first, self.last, self.batch, self.width = first, last, batch, width
        self.seed, self.delay_s = seed, delay_s

    def __len__(self) -> int:
        return max(0, self.last - self.first)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow input pipeline (decoding, remote storage, ...)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first + i)
        x = torch.randn(self.batch, self.width, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.1 + 0.01 * torch.randn(self.batch, 1, generator=g)
        return x, y


def build_model(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


def save_checkpoint(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint whole or not at all: temporary file, fsync, rename, fsync the folder."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:09d}.pt"
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "rng": torch.get_rng_state(), "saved_at": time.time(), **(extra or {})}
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def latest_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a file, else the newest checkpoint in the folder."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.glob(CHECKPOINT_GLOB))
    if not found:
        raise FileNotFoundError(f"no checkpoint ({CHECKPOINT_GLOB}) in {path}")
    return found[-1]


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer and RNG; return the step to continue at."""
    state = torch.load(latest_checkpoint(path), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, default="healthy")
    ap.add_argument("--steps", type=int, default=300, help="total steps of the whole run (resumed runs included)")
    ap.add_argument("--name", default=None, help="the job's name (the workflow id comes from FLEETLENS_WORKFLOW)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--width", type=int, default=None, help="input features")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loader-delay", type=float, default=None, help="seconds the dataset sleeps per batch")
    ap.add_argument("--hold-mb", type=float, default=None, help="memory the idle holder keeps allocated")
    ap.add_argument("--idle-s", type=float, default=None, help="seconds the idle holder sleeps per step")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (stretches a run)")
    ap.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only on request)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="folder for --save-every checkpoints (default FLEETLENS_HOME/checkpoints/<workflow>)")
    ap.add_argument("--resume", default=None, help="checkpoint file or folder to resume from (else "
                    "FLEETLENS_RESUME_FROM)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--log-every", type=int, default=0, help="print progress to stderr every N steps")
    args = ap.parse_args(argv)
    if args.steps < 0:
        ap.error("--steps must be >= 0")
    defaults = {  # per mode: batch, width, hidden, loader delay, hold MB, idle sleep
        "healthy": (64, 64, 256, 0.0, 0.0, 0.0),
        "input-bound": (64, 64, 256, 0.02, 0.0, 0.0),
        "idle-holder": (8, 16, 32, 0.0, 256.0, 0.2),
        "tiny": (4, 8, 8, 0.0, 0.0, 0.0),
    }[args.mode]
    for field, default in zip(("batch_size", "width", "hidden", "loader_delay", "hold_mb", "idle_s"), defaults,
                              strict=True):
        if getattr(args, field) is None:
            setattr(args, field, default)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    model = build_model(args.width, args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    settings = job_settings()  # the SDK's one way to read a job's settings
    if args.resume:  # an explicit --resume wins over the environment
        settings = settings.model_copy(update={"resume_from": Path(args.resume)})
    saved: list[dict[str, Any]] = []
    held = None
    if args.hold_mb:
        held = torch.ones(int(args.hold_mb * 2**20 / 4), dtype=torch.float32, device=device)  # touched: resident

    def on_checkpoint(directory: str) -> str:
        path = save_checkpoint(directory, model, optimizer, j.step)
        saved.append({"path": str(path), "step": j.step})
        return str(path)

    def on_restore(path: str) -> int:
        return load_checkpoint(path, model, optimizer)

    loss_value = None
    with job(args.name or f"train-{args.mode}", total_steps=args.steps, checkpoint=on_checkpoint,
             restore=on_restore, settings=settings) as j:
        start = j.step
        ckpt_dir = Path(args.checkpoint_dir or settings.checkpoint_dir / path_component(j.workflow_id))
        print(f"train: workflow {j.workflow_id} mode {args.mode} from step {start} to {args.steps}"
              f"{' (resumed from ' + str(j.resume_from) + ')' if j.resume_from else ''}", file=sys.stderr, flush=True)
        data = StepBatches(start, args.steps, args.batch_size, args.width, args.seed, args.loader_delay)
        loader = DataLoader(data, batch_size=None, shuffle=False, num_workers=0)
        loss_fn = nn.MSELoss()
        for x, y in j.steps(loader):
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if held is not None:
                held[:1] += 1  # the holder touches its memory now and then, no more
            if args.idle_s:
                time.sleep(args.idle_s)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            done = j.step + 1
            if args.save_every and done % args.save_every == 0 and done < args.steps:
                path = save_checkpoint(ckpt_dir, model, optimizer, done)
                saved.append({"path": str(path), "step": done})
            if args.log_every and done % args.log_every == 0:
                print(f"train: step {done}/{args.steps} loss {loss.item():.4f}", file=sys.stderr, flush=True)
            loss_value = loss
        end, connected = j.step, j.connected
    summary = {
        "event": "done", "workflow": j.workflow_id, "mode": args.mode, "start_step": start, "end_step": end,
        "steps_run": end - start, "total_steps": args.steps, "resumed_from": str(j.resume_from or "") or None,
        "loss": None if loss_value is None else float(loss_value.item()), "checkpoints": saved, "traces": j.traces,
        "connected": connected,
    }
    print(json.dumps(summary), flush=True)
    return 0


def cli() -> int:
    try:
        return main()
    except FleetlensError as exc:  # a bad FLEETLENS_RESUME_FROM, say: one line, not a traceback
        print(f"train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(cli())
