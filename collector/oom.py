"""Why a job ran out of GPU memory, from what PyTorch printed: its own cap, or a full GPU while within its cap.

With a per-process memory fraction set, PyTorch's out-of-memory message says how much the process was allowed
("<size> allowed;"), what it held ("Of the allocated memory <size> is allocated by PyTorch, ... and <size> is
reserved by PyTorch but unallocated"), what it asked for ("Tried to allocate <size>") and what the GPU had free
("of which <size> is free"). When what it reserved plus what it asked for fits in what it was allowed, the cap did
not stop it: the GPU itself was full (a lane-mate over its share, a job outside fleetlens, CUDA contexts and
workspaces outside every share), and the job must not be reported as having exceeded its share.

`oom_cause(text)`: "share" (its cap, or no way to tell otherwise), "device" (within its cap, the GPU was full),
None (no out-of-memory error in the text, or not the one the job died of); `ran_out_of_memory(log)` reads it from a
managed job's log since its last start.

A job that caught an out-of-memory error and went on (a smaller batch) may die later of something else: an
out-of-memory error followed by a Python traceback of another error, not chained to it ("During handling of the
above exception ..."), is not what ended the job. A launcher's own traceback after its worker's (torchrun's
ChildFailedError) reports that worker's error and does not hide it.
"""

from __future__ import annotations

import re
from pathlib import Path

START_MARK = "--- fleetlens: starting"  # the line the agent writes into a job's log before each start

# what PyTorch's CUDA allocator (and CUDA itself) print when a process runs out of GPU memory
OUT_OF_MEMORY_MARKERS = ("CUDA out of memory", "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError",
                         "CUDA error: out of memory")

_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_TRIED = re.compile(r"Tried to allocate\s+" + _SIZE)
_ALLOWED = re.compile(_SIZE + r"\s+allowed;")
_ALLOCATED = re.compile(r"Of the allocated memory\s+" + _SIZE + r"\s+is allocated by PyTorch")
_UNALLOCATED = re.compile(_SIZE + r"\s+is reserved by PyTorch but unallocated")
_FREE = re.compile(r"of which\s+" + _SIZE + r"\s+is free")
TRACEBACK = "Traceback (most recent call last):"
# what Python prints between two tracebacks of one chain: the later error came from handling the earlier one
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")
_REPORTS_WORKER = "ChildFailedError"  # torchrun's error for a worker that failed (its own error printed before)


def _bytes(match: re.Match[str] | None) -> float | None:
    return None if match is None else float(match.group(1)) * _UNITS[match.group(2)]


def oom_cause(text: str) -> str | None:
    """"share", "device" or None for the last out-of-memory error in `text` (see the module's docstring)."""
    at = max((text.rfind(marker) for marker in OUT_OF_MEMORY_MARKERS), default=-1)
    if at < 0 or _died_of_something_else(text[at:]):
        return None
    message = text[at:at + 4096]
    tried, allowed = _bytes(_TRIED.search(message)), _bytes(_ALLOWED.search(message))
    allocated = _bytes(_ALLOCATED.search(message))
    if tried is None or allowed is None or allocated is None:
        return "share"  # no cap in force, or a message of another form: nothing says the GPU was at fault
    reserved = allocated + (_bytes(_UNALLOCATED.search(message)) or 0.0)
    free = _bytes(_FREE.search(message))
    if reserved + tried <= allowed and (free is None or free < tried):
        return "device"
    return "share"


def _died_of_something_else(after: str) -> bool:
    """Whether `after` (the log from the last out-of-memory error on) ends with a traceback of another error that
    is neither chained to it nor a launcher's report of a failed worker."""
    last = after.rfind(TRACEBACK)
    if last < 0:
        return False
    between, final = after[:last], after[last:]
    return not between.rstrip().endswith(_CHAINED) and _REPORTS_WORKER not in final


def ran_out_of_memory(log_path: Path, tail_bytes: int = 64 * 1024) -> str | None:
    """Whether the end of a job's log, since its last start, shows it died out of GPU memory (with or without the
    job SDK: the markers are what PyTorch and CUDA print), and why: "share" (its cap), "device" (the GPU was full
    while it was within its cap), None (not out of memory)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    return oom_cause(tail.rsplit(START_MARK, 1)[-1])  # an earlier run's failure is not this one's
