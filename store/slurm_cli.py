"""The Slurm command line, run for the importer (squeue, sinfo, scontrol show) and the actuator (scancel --signal,
scontrol requeuehold / update / release): one place that finds the commands, bounds their time and turns their
failures into the project's errors. pyslurm does not build against Slurm 22.05, so the CLI and its JSON it is."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.errors import InvalidInput, UpstreamUnavailable
from store.settings import Settings


class SlurmRefused(InvalidInput):
    """Slurm answered and said no (an invalid job id, a requeue it does not allow, a gres it will not take)."""


@dataclass(frozen=True)
class SlurmCli:
    bin_dir: Path | None = None
    timeout_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> SlurmCli:
        return cls(bin_dir=settings.slurm_bin_dir, timeout_s=settings.slurm_timeout_s)

    def command(self, name: str) -> str:
        found = (str(self.bin_dir / name) if (self.bin_dir / name).is_file() else None) if self.bin_dir \
            else shutil.which(name)
        if found is None:
            where = f"in {self.bin_dir} (FLEETLENS_SLURM_BIN_DIR)" if self.bin_dir else "on PATH"
            raise UpstreamUnavailable(f"Slurm's {name} is not {where}: install the Slurm client (Debian: "
                                      "slurm-client) on the host that runs fleetlens, or set FLEETLENS_SLURM_BIN_DIR")
        return found

    def run(self, name: str, *args: str) -> str:
        """stdout of one Slurm command. Raises UpstreamUnavailable when it cannot reach slurmctld (or hangs), and
        SlurmRefused when Slurm answers with an error about the request itself."""
        argv = [self.command(name), *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise UpstreamUnavailable(f"`{' '.join([name, *args])}` gave no answer in {self.timeout_s:.0f} s; is "
                                      "slurmctld up?") from None
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot run {argv[0]}: {exc}") from None
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            if _unreachable(message):
                raise UpstreamUnavailable(f"`{' '.join([name, *args])}` could not reach slurmctld: {message}")
            raise SlurmRefused(f"`{' '.join([name, *args])}` failed: {message}")
        return done.stdout

    def json(self, name: str, *args: str) -> dict[str, Any]:
        out = self.run(name, *args, "--json")
        try:
            doc = json.loads(out)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"`{name} --json` did not print JSON ({exc}): {out[:200]!r}") from None
        if not isinstance(doc, dict):
            raise InvalidInput(f"`{name} --json` printed {type(doc).__name__}, not Slurm's JSON object")
        return doc


_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused",
                "Zero Bytes were transmitted", "Communication connection failure",
                # what scontrol says of a job while slurmctld is shutting down or starting again
                "Unexpected message received")


def _unreachable(message: str) -> bool:
    return any(s.lower() in message.lower() for s in _UNREACHABLE)
