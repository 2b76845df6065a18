"""NVIDIA MPS on one host: the agent runs nvidia-cuda-mps-control while a lane on the host's GPUs needs it.

With FLEETLENS_MPS=true the agent's MPS thread checks every FLEETLENS_MPS_CHECK_INTERVAL_S which open lanes on its
GPUs hold a job (store.registry.busy_gpu_lanes) and:

- starts the control daemon when the first lane appears, with CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY
  under FLEETLENS_HOME (Settings.mps_pipe_dir / mps_log_dir), and waits until it has opened its control pipe
  (`control` in the pipe folder). The daemon runs in the foreground (`-f`) as the agent's child rather than
  daemonised (`-d`), so the agent sees at once when it dies;
- sets each lane's active thread percentage: a job in a lane gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (its lane's
  share, collector.launch) and CUDA_MPS_PIPE_DIRECTORY (to reach this daemon) in its environment. NVIDIA's rule
  (MPS documentation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): a client's variable "will only further constrain" the
  daemon's setting, so a client gets min(its variable, the daemon's default). The daemon's default
  (`set_default_active_thread_percentage`) is therefore the largest lane's: every lane's jobs get exactly their own
  share, and a client that lost its environment gets no more than the largest lane was given. (The smallest lane's
  default would hold every lane to the smallest share: a 70 % lane beside a 30 % one would get 30 %.)
  `effective_percentage` is that rule;
- puts the lanes' GPUs in EXCLUSIVE_PROCESS compute mode before it starts the daemon (FLEETLENS_MPS_EXCLUSIVE, on
  by default), as NVIDIA's MPS documentation advises: only the MPS server then opens a context there, so a process
  outside MPS cannot share the GPU beside the lanes; the modes the GPUs had are put back when the daemon stops (kept in
  the pipe folder, MODES_FILE, so that the next agent puts them back after one that was killed).
  Setting a compute mode needs root: without it, that is said and the lanes run all the same;
- restarts the daemon when it died, and stops it (`quit`) when no lane needs it any more.

Nothing of a daemon outlives it: one that ignores `quit` is killed with the MPS servers it spawned (only the daemon
when the agent stops while lanes' jobs, which outlive the agent, still run on those servers), and a daemon that
was killed or died leaves no `control` pipe behind (a launch takes that pipe as the sign that MPS serves, and would
start a job outside it). The daemon's pid is kept in the pipe folder (DAEMON_PID_FILE), so a daemon left running by
an agent that was killed is found (by that pid, and the pipe folder in its environment) by the next agent: taken over
while it takes commands (the lane jobs the earlier agent started are its clients and run on), killed when it does
not, and stopped as soon as no lane needs it, instead of running on unreachable beside a new one.

Control commands go the way MPS takes them: one `nvidia-cuda-mps-control` client per command, the command on its
stdin. MPS counts SMs in whole percents (1..100): a lane share below 1 % is clamped to 1 %, and that is said.
What the supervisor does or meets (started, died and restarted, binary missing, share clamped, stopped) goes to
the agent's log and to the store as a host event, which the dashboard shows with the host. When the binary is
not on PATH the lanes still run, without MPS.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from store.db import Store
from store.errors import DatabaseUnavailable
from store.registry import busy_gpu_lane_devices, busy_gpu_lanes, record_host_event

log = logging.getLogger(__name__)

MIN_PERCENT, MAX_PERCENT = 1, 100  # what CUDA_MPS_ACTIVE_THREAD_PERCENTAGE can express: whole percents of SMs
QUIT_WAIT_S = 10.0
READY_WAIT_S = 10.0  # how long a started daemon may take to open its control pipe
COMMAND_TIMEOUT_S = 10.0
DAEMON_PID_FILE = "fleetlens-daemon.pid"  # in the pipe folder: the daemon this host's agent started last
MODES_FILE = "fleetlens-compute-modes.json"  # in the pipe folder: {GPU UUID: the compute mode to put back}
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def thread_percentage(share: float) -> tuple[int, bool]:
    """(the active thread percentage for a compute share 0..1, whether the share had to be clamped to fit)."""
    exact = share * 100.0
    percent = max(MIN_PERCENT, min(MAX_PERCENT, round(exact)))
    return percent, exact < MIN_PERCENT or exact > MAX_PERCENT


def effective_percentage(client: int | None, daemon_default: int | None) -> int:
    """The active thread percentage an MPS client gets: its own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE can only lower
    the control daemon's default (100 when the daemon was never told one)."""
    default = MAX_PERCENT if daemon_default is None else daemon_default
    return default if client is None else min(client, default)


def daemon_default(percentages: Mapping[int, int]) -> int:
    """The daemon's default for these lanes' percentages: the largest, so that no lane's own is cut."""
    return max(percentages.values(), default=MAX_PERCENT)


def mps_env(pipe_dir: Path, log_dir: Path) -> dict[str, str]:
    """The variables that tie a daemon, its control clients and its CUDA clients to one MPS instance."""
    return {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}


class MpsSupervisor:
    """Keeps one nvidia-cuda-mps-control daemon running exactly while some lane needs it. `check(lanes)` does one
    round; `run(...)` calls it on a thread with the lanes read from the store."""

    def __init__(self, binary: str, pipe_dir: Path, log_dir: Path, *, store: Store | None = None,
                 host_id: str | None = None, base_env: Mapping[str, str] | None = None, exclusive: bool = False,
                 nvml: Any = None) -> None:
        self.binary, self.pipe_dir, self.log_dir = binary, Path(pipe_dir), Path(log_dir)
        self.store, self.host_id = store, host_id
        self._base_env = dict(os.environ if base_env is None else base_env)
        self.proc: subprocess.Popen | _Adopted | None = None
        self._path: str | None = None  # the binary as found on PATH at the last start
        self.state = "stopped"  # stopped | running | unavailable
        self.restarts = 0
        self.percentages: dict[int, int] = {}  # lane id -> active thread percentage, for the lanes now served
        self._default: int | None = None  # the default percentage the running daemon was given
        self._clamped_said: set[int] = set()
        self._pending: list[tuple[str, str, dict[str, Any]]] = []  # events the database could not take yet
        self._lock = threading.Lock()
        self._last_lanes: dict[int, float] = {}
        self.exclusive = exclusive
        self._nvml = nvml  # pynvml, or a stand-in (tests); imported on first use
        self.devices: dict[int, str] = {}  # lane id -> its GPU's UUID, for the compute mode
        self.modes: dict[str, int] = {}  # GPU UUID -> the compute mode it had before we set EXCLUSIVE_PROCESS
        self._mode_said: set[str] = set()

    # ---- one round -------------------------------------------------------------------------------------

    def check(self, lanes: Mapping[int, float], devices: Mapping[int, str] | None = None) -> None:
        """Bring the daemon in line with these lanes ({lane id: compute share}; `devices` {lane id: GPU UUID}):
        start, restart, re-set, stop."""
        with self._lock:
            if devices is not None:
                self.devices = dict(devices)
            self._check(dict(lanes))
            self._flush_events()

    def _check(self, lanes: dict[int, float]) -> None:
        self.percentages = {}
        for lane_id, share in sorted(lanes.items()):
            percent, clamped = thread_percentage(share)
            self.percentages[lane_id] = percent
            if clamped and lane_id not in self._clamped_said:
                self._clamped_said.add(lane_id)
                self._say("warning", f"lane {lane_id}'s compute share {share:.2%} is outside what MPS can express "
                                     f"({MIN_PERCENT}-{MAX_PERCENT} % of the SMs); its jobs get {percent} %",
                          lane=lane_id, share=share, percent=percent)
        self._clamped_said &= set(lanes)
        if not lanes:
            if self.proc is None and self._adopt():
                self._say("info", f"took over the MPS control daemon (pid {self.proc.pid}) an earlier agent left "
                                  "running, to stop it", pid=self.proc.pid)
            if self.proc is not None:
                self._stop("no lane on this host needs it any more")
            elif (self.pipe_dir / MODES_FILE).exists():  # left by an agent that was killed, its daemon gone too
                self._restore_modes()
            if self.state == "unavailable":
                self.state = "stopped"
            return
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.proc = None
            self.restarts += 1
            self._say("error", f"the MPS control daemon died (exit status {code}); restarting it "
                               f"(restart {self.restarts}); lanes' jobs keep running meanwhile",
                      exit_status=code, restarts=self.restarts)
            self._start(restarted=True)
        elif self.proc is None:
            self._start(restarted=False)
        if self.proc is not None and self.exclusive:
            self._exclusive({self.devices[lane] for lane in lanes if lane in self.devices})
        if self.proc is not None and self._control.exists():
            default = daemon_default(self.percentages)
            if default != self._default and self._command(f"set_default_active_thread_percentage {default}"):
                self._default = default
                # the default reaches only servers spawned after it: a running server is told its own
                for pid in self._servers():
                    self._command(f"set_active_thread_percentage {pid} {default}")

    def _start(self, *, restarted: bool) -> None:
        path = self._path = shutil.which(self.binary, path=self._base_env.get("PATH"))
        if path is None:
            if self.state != "unavailable":
                self.state = "unavailable"
                self._say("error", f"{self.binary} is not on PATH: lanes on this host run without MPS, so their "
                                   "compute shares are not held on the GPU. Install the NVIDIA driver's MPS tools "
                                   "on the agent's PATH, or set FLEETLENS_MPS=false", binary=self.binary)
            return
        if self._adopt():
            self.state, self._default = "running", None  # told the lanes' percentages again
            self._say("warning", f"took over the MPS control daemon (pid {self.proc.pid}) an earlier agent left "
                                 f"running on {self.pipe_dir}; its lanes' jobs run on", pid=self.proc.pid)
            return
        if self.exclusive:  # before the daemon: its server must be the only context on these GPUs
            self._exclusive({uuid for uuid in self.devices.values()})
        try:
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._control.unlink(missing_ok=True)  # left by a daemon that died: readiness must be the new one's
            self.proc = subprocess.Popen([path, "-f"], env=self._env(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._pid_file.write_text(str(self.proc.pid))
        except OSError as exc:
            self.state = "unavailable"
            self._say("error", f"cannot start {path} -f: {exc.strerror or exc}; lanes on this host run without MPS",
                      binary=path)
            return
        self.state, self._default = "running", None
        if not self._ready():
            self._say("warning", f"the MPS control daemon (pid {self.proc.pid}) has not opened its control pipe in "
                                 f"{self.pipe_dir} after {READY_WAIT_S:.0f} s; its percentages are set once it has",
                      pid=self.proc.pid)
        self._say("warning" if restarted else "info",
                  f"MPS control daemon {'restarted' if restarted else 'started'} (pid {self.proc.pid}) for lanes "
                  f"{', '.join(f'{lane}: {p} %' for lane, p in self.percentages.items())}",
                  pid=self.proc.pid, pipe_dir=str(self.pipe_dir), log_dir=str(self.log_dir),
                  lanes={str(k): v for k, v in self.percentages.items()})

    @property
    def _pid_file(self) -> Path:
        return self.pipe_dir / DAEMON_PID_FILE

    def _leftover(self) -> psutil.Process | None:
        """The daemon an earlier agent started on this pipe folder, still running (the pid file's process, if it
        still serves this folder: a pid used again by another process is not it)."""
        try:
            pid = int(self._pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if self.proc is not None and pid == self.proc.pid:
            return None
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and \
                    proc.environ().get("CUDA_MPS_PIPE_DIRECTORY") == str(self.pipe_dir):
                return proc
        except psutil.Error:
            pass
        self._pid_file.unlink(missing_ok=True)  # its daemon is gone: nothing to look for next round
        return None

    def _adopt(self) -> bool:
        """Take over a daemon an agent that was killed left running on this pipe folder, if it still takes commands
        (its control pipe is there): the lane jobs that agent started are its clients, and stopping it would end
        their MPS server under them. One that does not take commands is killed with its servers. True: taken over."""
        proc = self._leftover()
        if proc is None:
            return False
        if self._control.exists():
            self.proc = _Adopted(proc)
            self._path = self._path or shutil.which(self.binary, path=self._base_env.get("PATH"))
            return True
        _kill_tree(proc)
        self._say("warning", f"killed the MPS control daemon (pid {proc.pid}) an earlier agent left running on "
                             f"{self.pipe_dir} without its control pipe", pid=proc.pid)
        return False

    @property
    def _control(self) -> Path:
        """The control daemon's pipe: it exists once the daemon takes commands."""
        return self.pipe_dir / "control"

    def _ready(self) -> bool:
        deadline = time.monotonic() + READY_WAIT_S
        while self.proc is not None and self.proc.poll() is None:
            if self._control.exists():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return False

    def _nvml_lib(self) -> Any:
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        return self._nvml

    def _exclusive(self, uuids: set[str]) -> None:
        """EXCLUSIVE_PROCESS on these GPUs (the mode each had is kept to put back); said once per GPU when it
        cannot be set."""
        todo = sorted(uuids - set(self.modes) - self._mode_said)
        if not todo:
            return
        nv = self._nvml_lib()
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            self._mode_said.update(todo)
            self._say("warning", f"cannot put GPUs {', '.join(todo)} in EXCLUSIVE_PROCESS mode: NVML does not start "
                                 f"({exc}); processes outside MPS may open contexts beside the lanes", gpus=todo)
            return
        saved = self._saved_modes()
        try:
            for uuid in todo:
                try:
                    handle = nv.nvmlDeviceGetHandleByUUID(uuid)
                    # the mode an agent that was killed found, not the EXCLUSIVE_PROCESS it left
                    before = saved.get(uuid, int(nv.nvmlDeviceGetComputeMode(handle)))
                    if int(nv.nvmlDeviceGetComputeMode(handle)) != nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                        nv.nvmlDeviceSetComputeMode(handle, nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
                    self.modes[uuid] = before
                    self._save_modes({**saved, **self.modes})
                except nv.NVMLError as exc:
                    self._mode_said.add(uuid)
                    self._say("warning", f"cannot put GPU {uuid} in EXCLUSIVE_PROCESS mode ({exc}): processes "
                                         "outside MPS may open contexts beside its lanes; run the agent as root, or "
                                         f"set it once with `nvidia-smi -i {uuid} -c EXCLUSIVE_PROCESS`", gpu=uuid)
        finally:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass

    def _saved_modes(self) -> dict[str, int]:
        """The modes to put back that the modes file keeps (an earlier agent's too)."""
        try:
            saved = json.loads((self.pipe_dir / MODES_FILE).read_text())
            return {str(uuid): int(mode) for uuid, mode in saved.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _save_modes(self, modes: dict[str, int]) -> None:
        try:
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            (self.pipe_dir / MODES_FILE).write_text(json.dumps(modes))
        except OSError as exc:
            log.warning("cannot keep the GPUs' compute modes in %s (%s): an agent killed now leaves them "
                        "EXCLUSIVE_PROCESS", self.pipe_dir, exc)

    def _restore_modes(self) -> None:
        """Put back the compute modes the GPUs had before the daemon ran (also those an agent that was killed set)."""
        modes, self.modes, self._mode_said = {**self._saved_modes(), **self.modes}, {}, set()
        if not modes:
            return
        nv = self._nvml_lib()
        try:
            nv.nvmlInit()
        except nv.NVMLError:
            return
        (self.pipe_dir / MODES_FILE).unlink(missing_ok=True)
        try:
            for uuid, mode in modes.items():
                try:
                    if mode != nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                        nv.nvmlDeviceSetComputeMode(nv.nvmlDeviceGetHandleByUUID(uuid), mode)
                except nv.NVMLError as exc:
                    self._say("warning", f"cannot put GPU {uuid}'s compute mode back to {mode} ({exc})", gpu=uuid)
        finally:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass

    def _stop(self, why: str) -> None:
        proc, self.proc = self.proc, None
        self.state, self._default = "stopped", None
        if proc is None:
            self._restore_modes()
            return
        if proc.poll() is None:
            self._command("quit")
            try:
                proc.wait(timeout=QUIT_WAIT_S)
            except subprocess.TimeoutExpired:  # a daemon that ignores quit still has to go
                try:
                    if self.percentages:  # lanes' jobs still run (the agent is stopping): their servers stay
                        proc.kill()
                    else:  # nobody's server: they go with it
                        _kill_tree(psutil.Process(proc.pid))
                except psutil.Error:
                    proc.kill()
                proc.wait()
        # a daemon killed, or dead before it was told to quit, leaves its control pipe: a launch would take it as
        # a daemon serving and start its job outside MPS
        self._control.unlink(missing_ok=True)
        self._pid_file.unlink(missing_ok=True)
        self._restore_modes()
        self._say("info", f"MPS control daemon stopped: {why}", pid=proc.pid)

    def _servers(self) -> list[int]:
        """The pids of the MPS servers the daemon runs now (`get_server_list`)."""
        out = self._command("get_server_list", output=True)
        return [int(word) for word in (out or "").split() if word.isdigit()]

    def _command(self, command: str, *, output: bool = False) -> Any:
        """Send one control command through a control client; False (and said) when it did not take it (with
        `output`: what it printed, None when it failed)."""
        try:
            done = subprocess.run([self._path or self.binary], input=command + "\n", env=self._env(),
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._say("warning", f"MPS control command {command!r} failed: {exc}", command=command)
            return None if output else False
        if done.returncode != 0:
            self._say("warning", f"MPS control command {command!r} failed (exit status {done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()[:200]}", command=command)
            return None if output else False
        return done.stdout if output else True

    def _env(self) -> dict[str, str]:
        return {**self._base_env, **mps_env(self.pipe_dir, self.log_dir)}

    # ---- saying what happened ------------------------------------------------------------------------

    def _say(self, level: str, message: str, **detail: Any) -> None:
        log.log(_LEVELS[level], "%s", message)
        self._pending.append((level, message, detail))

    def _flush_events(self) -> None:
        if not self._pending:
            return
        if self.store is None or self.host_id is None:  # no store to tell: the log has it
            self._pending.clear()
            return
        try:
            with self.store.session() as session:
                for level, message, detail in self._pending:
                    record_host_event(session, self.host_id, "mps", level, message, detail)
        except DatabaseUnavailable:
            return  # kept: written at the next round that reaches the database
        self._pending.clear()

    # ---- the agent's thread ----------------------------------------------------------------------------

    def lanes(self) -> dict[int, float]:
        """The lanes the store says need MPS on this host; the last ones known while the database is away."""
        assert self.store is not None and self.host_id is not None
        try:
            with self.store.session() as session:
                self._last_lanes = busy_gpu_lanes(session, self.host_id)
                self.devices = busy_gpu_lane_devices(session, self.host_id)
        except DatabaseUnavailable:
            pass
        return self._last_lanes

    def run(self, stop: threading.Event, interval_s: float,
            lanes: Callable[[], Mapping[int, float]] | None = None) -> None:
        """Check every `interval_s` until `stop` is set, then stop the daemon."""
        read = lanes or self.lanes
        while True:
            try:
                self.check(read())
            except Exception:  # one bad round must not end the supervision
                log.exception("supervising the MPS control daemon failed")
            if stop.wait(interval_s):
                break
        self.close()

    def close(self) -> None:
        """Stop the daemon (the agent is stopping)."""
        with self._lock:
            if self.proc is not None:
                self._stop("the agent is stopping")
            self._flush_events()


def _kill_tree(proc: psutil.Process) -> None:
    """SIGKILL a daemon and the MPS servers it spawned (found before it goes, while they are still its children)."""
    try:
        children = proc.children(recursive=True)
    except psutil.Error:
        children = []
    for p in (proc, *children):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs([proc, *children], timeout=5)


class _Adopted:
    """A daemon an earlier agent started (not this process's child), as much of a Popen as the supervisor uses."""

    def __init__(self, proc: psutil.Process) -> None:
        self._proc, self.pid = proc, proc.pid
        self.returncode: int | str | None = None

    def poll(self) -> int | str | None:
        if self.returncode is None:
            try:
                alive = self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                self.returncode = "unknown"  # the exit status of a process that is not our child is not ours to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | str | None:
        try:
            self._proc.wait(timeout=timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0) from None
        except psutil.Error:
            pass
        self.returncode = self.returncode or "unknown"
        return self.returncode

    def kill(self) -> None:
        try:
            self._proc.kill()
        except psutil.Error:
            pass
