"""A job that ran out of GPU memory is blamed only when its own cap stopped it: read from PyTorch's out-of-memory
message (what it was allowed, held and asked for, what the GPU had free), through the agent's reading of the job's
log, into the failure its workflow is labelled with."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.oom import oom_cause, ran_out_of_memory
from store.db import Store
from store.models import Lane, Placement, Workflow
from store.placements import FAILURE_LABEL, end_placements
from store.registry import DeviceSpec, register_devices, register_host
from store.workflows import upsert_workflow

GiB = 1 << 30
TB = 'Traceback (most recent call last):\n  File "train.py", line 40, in <module>\n    step()\n'


def torch_oom(tried: str, free: str, allowed: str | None, allocated: str, unallocated: str) -> str:
    """An out-of-memory error in the form PyTorch's CUDA caching allocator prints it."""
    cap = f"{allowed} allowed; " if allowed else ""
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of "
            f"79.15 GiB of which {free} is free. Including non-PyTorch memory, this process has 20.10 GiB memory in "
            f"use. {cap}Of the allocated memory {allocated} is allocated by PyTorch, and {unallocated} is reserved "
            "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


@pytest.mark.parametrize(("text", "cause"), [
    # at its cap: 19.5 GiB held + 2 GiB asked > 20 GiB allowed, though the GPU had room
    (torch_oom("2.00 GiB", "30.00 GiB", "20.00 GiB", "19.00 GiB", "512.00 MiB"), "share"),
    # well within its cap (8.5 + 2 < 20), the GPU full: a neighbour took the memory
    (torch_oom("2.00 GiB", "300.00 MiB", "20.00 GiB", "8.00 GiB", "512.00 MiB"), "device"),
    # no cap in force: nothing says the GPU was at fault
    (torch_oom("2.00 GiB", "300.00 MiB", None, "8.00 GiB", "512.00 MiB"), "share"),
    # an older message form, and CUDA's own error
    ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)", "share"),
    ("RuntimeError: CUDA error: out of memory", "share"),
    ("Traceback: ValueError: shapes do not match", None),
    # caught and recovered from (a smaller batch), then died of something else: not out of memory
    ("out of memory at batch 64 (CUDA out of memory. Tried to allocate 2.00 GiB); retrying with batch 32\n"
     f"step 11\n{TB}OSError: [Errno 28] No space left on device\n", None),
    # an error raised while handling the out-of-memory error: the chain began with it
    (f"{TB}{torch_oom('2.00 GiB', '30.00 GiB', None, '8.00 GiB', '0 bytes')}\n\nDuring handling of the above "
     f"exception, another exception occurred:\n\n{TB}RuntimeError: saving the batch failed\n", "share"),
    # torchrun's report of its worker, after the worker's own out-of-memory error
    (f"{TB}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n{TB}"
     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: train.py FAILED\n", "share"),
])
def test_the_cause_is_read_from_pytorchs_message(text: str, cause: str | None) -> None:
    assert oom_cause(text) == cause


def _placed(store: Store) -> None:
    with store.session() as s:
        register_host(s, "oom-host", hostname="h", source="nvml")
        (device_id,) = register_devices(s, "oom-host", [DeviceSpec(0, "GPU-oom-0", "A100", 80 * GiB)],
                                        source="nvml").values()
        lane = Lane(device_id=device_id, size_bytes=40 * GiB, compute_share=0.5, state="open", created_at=1.0)
        s.add(lane)
        s.flush()
        upsert_workflow(s, "victim", now=1.0, id_source="managed", managed=True, state="running")
        s.add(Placement(workflow_id="victim", device_id=device_id, lane_id=lane.id, host_id="oom-host", pid=42,
                        mem_persistent=10 * GiB, mem_ephemeral=9 * GiB,  # P' 11 GiB + E: 20 GiB
                        state="active", started_at=1.0))


@pytest.mark.parametrize(("used", "free", "label"), [
    ("8.00 GiB", "300.00 MiB", "ran out of GPU memory within its memory share of 21474836480 bytes: the GPU was full"),
    ("19.00 GiB", "30.00 GiB", "exceeded its memory share of 21474836480 bytes (out of memory)"),
])
def test_a_job_starved_by_a_neighbour_is_not_said_to_have_exceeded_its_share(
        sqlite_store: Store, tmp_path: Path, used: str, free: str, label: str) -> None:
    _placed(sqlite_store)
    log = tmp_path / "victim.log"
    log.write_text("step 10\n" + torch_oom("2.00 GiB", free, "20.00 GiB", used, "512.00 MiB") + "\n")
    cause = ran_out_of_memory(log)
    assert cause
    end_placements(sqlite_store, "victim", 42, "failed", out_of_memory=cause)
    with sqlite_store.session() as s:
        wf = s.get(Workflow, "victim")
        assert wf.state == "failed" and wf.labels[FAILURE_LABEL].startswith(label)
