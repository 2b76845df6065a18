"""The Slurm actuator: move a Slurm job that opted in onto fewer shards, through Slurm's own requeue, never more.

    planned -> signalled -> checkpointed -> held -> updated -> released -> resumed
        |          |             |            |         |          |
        +----------+-------------+--> failed  +---------+----------+--> rolling_back -> rolled_back

- planned: the job must still be running and opted in (`--comment=fleetlens:movable` or its SDK's start mark,
  requeueable, on shards, on one node: store.slurm.opt_in, decided again from what Slurm and the mark say now), hold
  more shards now than the move asks for (Slurm's request, not the store's row: a row read before the next import
  may still show what a finished move changed), and its start mark must say the SDK is the batch step's own process
  (the script exec'd it): `scancel --batch` signals that process alone, and a batch script that runs the training as
  its child (no `exec`, or through srun) is killed by SIGUSR1. A mark that says otherwise, or an older SDK's that
  does not say, fails the move with nothing done. Else it gets SIGUSR1 through `scancel --batch --signal=USR1` (the
  SDK checkpoints at its next step boundary).
- signalled: the SDK's manifest (store.slurm_marks) written after the signal names a file whose size and sha256
  fleetlens reads again itself; the checkpoint is then recorded (store.checkpoints). No checkpoint in time, or the
  job ended meanwhile: failed, with nothing changed.
- checkpointed: a checkpoint older than the limit is asked for again; with no GPU on the node left with enough free
  shards the move stops here (failed, nothing changed); else `scontrol requeuehold` (refused: failed, unchanged).
  That the hold was sent is recorded first: when its answer is lost (a timeout, slurmctld restarting), the next
  step finds the job requeued (a higher restart count) and held, and carries on from `held`; never left held.
- held: `scontrol update gres=<fewer shards>` (refused, or the shards went to another job meanwhile: roll back). A
  job released by someone else meanwhile runs with its old request: failed, nothing more changed; one not back in the
  queue within the resume timeout: roll back.
- updated: `scontrol release`.
- released: the SDK's start mark of the new run (Slurm's restart count now, above the one when the hold was sent)
  must say it restored the recorded checkpoint (same sha256) at or above its step; not resumed in time: roll back.
- rolling_back: the old request is restored and the job released (it resumes from its checkpoint as it was).

Every step is one Slurm command at most, decided from what the store and Slurm say now, so `advance` is idempotent
and a slurmctld that does not answer (restarted in the middle of a move) only makes it wait; a step is recorded only
if the action is still in the state it was decided in (two enforcers on one move: the first one's step stands), and
`begin` locks the job's row first (two enforcers beginning moves of one job: the second finds the first's).
Slurm keeps one job under one id: a requeued job never runs twice, and fleetlens never cancels a job or resubmits it
under a new id.

This module is the state machine; what Slurm says of the job and its node is read by enforcer.actuators.slurm_reads,
and the action's record in the store (each step written only from the state it was decided in) is
enforcer.actuators.slurm_record's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import select, update

from enforcer.actuators.base import Move, Step, StepOutcome
from enforcer.actuators.slurm_reads import is_held, node_room, read_job, whole_holders, why_not_fewer
from enforcer.actuators.slurm_record import SlurmActionRecord
from store.checkpoints import digest, record_checkpoint
from store.db import Store
from store.errors import InvalidInput, NotFound, UpstreamUnavailable
from store.models import Action, ActionEvent, Device
from store.models_slurm import SlurmJob as SlurmJobRow
from store.registry import closed_hosts, silent_hosts
from store.settings import Settings
from store.slurm import HOLDING_STATES, WAITING_STATES, SlurmJob, parse_gres
from store.slurm_cli import SlurmCli, SlurmRefused
from store.slurm_marks import job_folder, read_manifest, read_started, signal_unsafe

log = logging.getLogger(__name__)

ENGINE = "slurm"
TERMINAL = ("resumed", "rolled_back", "failed")
GONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
               "PREEMPTED")


@dataclass(frozen=True)
class SlurmMoveOptions:
    checkpoint_timeout_s: float = 120.0
    checkpoint_max_age_s: float = 60.0
    resume_timeout_s: float = 180.0
    max_attempts: int = 2

    @classmethod
    def from_settings(cls, settings: Settings) -> SlurmMoveOptions:
        return cls(checkpoint_timeout_s=settings.slurm_checkpoint_timeout_s,
                   checkpoint_max_age_s=settings.slurm_checkpoint_max_age_s,
                   resume_timeout_s=settings.slurm_resume_timeout_s, max_attempts=settings.slurm_max_attempts)


class SlurmActuator(SlurmActionRecord):
    """Carries out moves of Slurm jobs (see the module's docstring); state lives in `actions` (engine 'slurm'),
    read and written through SlurmActionRecord."""

    engine: ClassVar[str] = ENGINE

    def __init__(self, store: Store, settings: Settings, *, cli: SlurmCli | None = None,
                 options: SlurmMoveOptions | None = None) -> None:
        self.store, self.settings = store, settings
        self.cli = cli or SlurmCli.from_settings(settings)
        self.options = options or SlurmMoveOptions.from_settings(settings)
        self._stepping: tuple[int, str] | None = None

    # ---- begin -------------------------------------------------------------------------------------------------

    def begin(self, move: Move, *, now: float) -> int:
        new = parse_gres(str(move.request.get("gres") or ""))
        with self.store.session() as session:
            # two enforcers (serve's cycle and a DAG) may begin a move of one job at once: the job's row is locked
            # before the check for a move under way, so the second waits for the first one's action and sees it
            # (PostgreSQL: SELECT ... FOR UPDATE; SQLite: an UPDATE of the row first takes its one write lock)
            query = select(SlurmJobRow).where(SlurmJobRow.workflow_id == move.workflow_id)
            if self.store.is_postgres:
                query = query.with_for_update()
            else:
                session.execute(update(SlurmJobRow).where(SlurmJobRow.workflow_id == move.workflow_id)
                                .values(job_id=SlurmJobRow.job_id).execution_options(synchronize_session=False))
            row = session.scalar(query.execution_options(populate_existing=True))
            if row is None:
                raise NotFound(f"{move.workflow_id} is not a Slurm job fleetlens has seen (run the Slurm import "
                               "first); nothing moved")
            if not row.opted_in:
                raise InvalidInput(f"{move.workflow_id} is observed and advised only: {row.not_movable_reason}; "
                                   "nothing moved")
            if new is None or new.kind != "shard" or new.count >= row.shards:
                raise InvalidInput(f"a Slurm move of {move.workflow_id} asks for fewer shards than its {row.gres}, "
                                   f"not {move.request.get('gres')!r}; nothing moved")
            if row.state != "RUNNING":
                raise InvalidInput(f"{move.workflow_id} is {row.state} in Slurm, not RUNNING; nothing moved")
            # its node is the target too (the requeued job gets its shards there): heard from and taking new jobs as
            # the import last saw it (the store's rule for every host), and as sinfo says at the requeue (_room)
            node = row.node or ""
            if why := (silent_hosts(session, [node], self.settings.host_silence_s, now).get(node)
                       or closed_hosts(session, [node]).get(node)):
                raise InvalidInput(f"{move.workflow_id} runs on node {node}, which {why}; nothing moved")
            busy = session.scalar(select(Action.id).where(Action.workflow_id == move.workflow_id,
                                                          Action.state.not_in(TERMINAL)).limit(1))
            if busy is not None:
                raise InvalidInput(f"{move.workflow_id} is already being moved (action {busy}); nothing moved")
            detail = {"job_id": row.job_id, "node": row.node, "old_gres": row.gres, "new_gres": str(new),
                      "restart_before": row.restart_count, "attempts": 0, "reason": move.reason}
            # Slurm picks the GPU on release; the planner's target is recorded when the store knows it, as its intent
            known = {d for d in (move.from_device_id, move.to_device_id) if d is not None and session.get(Device, d)}
            action = Action(plan_id=move.plan_id, kind="migrate", workflow_id=move.workflow_id, policy=move.policy,
                            from_device_id=move.from_device_id if move.from_device_id in known else None,
                            to_device_id=move.to_device_id if move.to_device_id in known else None, state="planned",
                            expected_slowdown=move.expected_slowdown, attempts=0, created_at=now, updated_at=now,
                            engine=ENGINE, detail=detail)
            session.add(action)
            session.flush()
            session.add(ActionEvent(action_id=action.id, ts=now, from_state=None, to_state="planned",
                                    message=f"planned: Slurm job {row.job_id} from {row.gres} to {new}"
                                            f"{f' ({move.reason})' if move.reason else ''}", detail=detail))
            return action.id

    # ---- advance ------------------------------------------------------------------------------------------------

    def advance(self, action_id: int, *, now: float) -> list[StepOutcome]:
        with self.store.session() as session:
            action = session.get(Action, action_id)
            if action is None or action.engine != ENGINE:
                raise NotFound(f"no Slurm action {action_id} in the store")
            if action.state in TERMINAL:
                return []
            detail = dict(action.detail or {})
            state = action.state
        self._stepping = (action_id, state)  # a step is written only from the state it was decided in
        try:
            job = read_job(self.cli, self.store, self.settings, int(detail["job_id"]))
            step = getattr(self, f"_{state}")
            return step(action_id, detail, job, now)
        except UpstreamUnavailable as exc:  # slurmctld away (restarting): nothing was done, try again later
            log.info("Slurm action %s waits in %s: %s", action_id, state, exc)
            return []
        except SlurmRefused as exc:  # a command the step did not expect to be refused
            if state in ("planned", "signalled", "checkpointed"):
                return self._end(action_id, "failed", Step.FAILED, now, False,
                                 f"Slurm refused a command ({exc}); the job was not requeued, nothing was changed")
            if state == "rolling_back":
                return self._end(action_id, "failed", Step.FAILED, now, False,
                                 f"{detail.get('why', '')}; and restoring job {detail['job_id']}'s request was "
                                 f"refused ({exc}): it waits in Slurm's queue; release it with its old request "
                                 f"{detail['old_gres']} by hand (scontrol update, scontrol release)")
            return self._to(action_id, "rolling_back", {**detail, "why": f"Slurm refused a command ({exc})"}, now,
                            Step.FAILED, False, f"Slurm refused a command ({exc}); restoring the old request")

    def state(self, action_id: int) -> str:
        with self.store.session() as session:
            action = session.get(Action, action_id)
            return action.state if action is not None else "unknown"

    # ---- the steps ----------------------------------------------------------------------------------------------

    def _planned(self, action_id: int, d: dict[str, Any], job: SlurmJob | None, now: float) -> list[StepOutcome]:
        if job is None or job.state != "RUNNING":
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {d['job_id']} is {job.state if job else 'gone'}, not running; nothing was done")
        if not job.opted_in:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {job.job_id} no longer opts in ({job.not_movable_reason}); nothing was done")
        why_not = why_not_fewer(parse_gres(d["new_gres"]), job.gres)
        if why_not is not None:  # the store's row was read before a move or an update changed the job's request
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {job.job_id} holds {job.gres} now (Slurm), not {d['old_gres']} as the store "
                             f"said when the move was planned: {why_not}; nothing was done")
        started = read_started(self._folder(action_id))
        if started is None or started.job_id != job.job_id or started.restart_count != job.restart_count:
            # the SDK says where each start begins once its signal handler is in: before that, USR1 would kill it
            created = self._created(action_id)
            if now - created > self.options.checkpoint_timeout_s:
                return self._end(action_id, "failed", Step.FAILED, now, False,
                                 f"job {job.job_id}'s fleetlens SDK has not said it is ready for a checkpoint signal "
                                 f"in {self.options.checkpoint_timeout_s:.0f} s; it was not signalled, nothing done")
            return []
        unsafe = signal_unsafe(started)
        if unsafe is not None:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {job.job_id} was not signalled: {unsafe}; `scancel --batch --signal=USR1` reaches "
                             "the batch step's own process only, and SIGUSR1 kills a batch script that runs the "
                             "training as its child. Start it with `exec python train.py` in the batch script (not "
                             "without exec, not through srun), on a current fleetlens SDK; nothing was done")
        before = read_manifest(self._folder(action_id))  # the checkpoint must be a new one, whatever the clocks say
        self.cli.run("scancel", "--batch", "--signal=USR1", str(job.job_id))
        d = {**d, "signal_at": now, "attempts": int(d.get("attempts", 0)) + 1, "old_gres": str(job.gres),
             "manifest_before": before.written_at if before is not None else None}
        return self._to(action_id, "signalled", d, now, Step.PLANNED, True,
                        f"checkpoint signal (USR1) sent to job {job.job_id}'s batch script")

    def _signalled(self, action_id: int, d: dict[str, Any], job: SlurmJob | None, now: float) -> list[StepOutcome]:
        manifest = read_manifest(self._folder(action_id))
        if manifest is not None and manifest.job_id == d["job_id"] and manifest.written_at != d.get("manifest_before"):
            try:
                sha, size = digest(manifest.path)
            except OSError as exc:
                return self._end(action_id, "failed", Step.FAILED, now, False,
                                 f"the checkpoint {manifest.path} cannot be read ({exc}); the job runs on untouched")
            if (sha, size) != (manifest.sha256, manifest.size_bytes):
                return self._end(action_id, "failed", Step.FAILED, now, False,
                                 f"the checkpoint {manifest.path} is not what the job wrote (sha256 or size differ); "
                                 "the job runs on untouched")
            with self.store.session() as session:
                fact = record_checkpoint(session, self._workflow(action_id), host_id=d.get("node") or "slurm",
                                         url=manifest.path, step=manifest.step, sha256=sha, size_bytes=size,
                                         action_id=action_id, now=now)
                action = session.get(Action, action_id)
                action.checkpoint_path, action.checkpoint_step, action.checkpoint_id = fact.url, fact.step, fact.id
            d = {**d, "checkpoint": {"id": fact.id, "step": manifest.step, "sha256": sha, "size": size,
                                     "written_at": manifest.written_at}}
            return self._to(action_id, "checkpointed", d, now, Step.CHECKPOINTED, True,
                            f"checkpoint at step {manifest.step}: {size} bytes, sha256 {sha[:12]}",
                            training_step=manifest.step)
        if job is None or job.state in GONE_STATES:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {d['job_id']} ended ({job.state if job else 'gone from squeue'}) while it was "
                             "asked to checkpoint; fleetlens had only signalled it and changed nothing else")
        if now - d["signal_at"] > self.options.checkpoint_timeout_s:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"no checkpoint came within {self.options.checkpoint_timeout_s:.0f} s of the signal "
                             "(does the job use the fleetlens SDK with a checkpoint callback?); the job runs on "
                             "untouched")
        return []

    def _checkpointed(self, action_id: int, d: dict[str, Any], job: SlurmJob | None,
                      now: float) -> list[StepOutcome]:
        sent = d.get("hold_sent")
        if sent is not None and job is not None and job.restart_count > int(sent["restart_count"]):
            return self._hold_took_effect(action_id, d, job, now)  # the requeuehold was applied, its answer lost
        if job is None or job.state != "RUNNING":
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {d['job_id']} is {job.state if job else 'gone'} after its checkpoint; nothing "
                             "was changed")
        age = now - float(d["checkpoint"]["written_at"])
        if age > self.options.checkpoint_max_age_s:
            if int(d.get("attempts", 0)) >= self.options.max_attempts:
                return self._end(action_id, "failed", Step.FAILED, now, False,
                                 f"the checkpoint is {age:.0f} s old, older than the limit of "
                                 f"{self.options.checkpoint_max_age_s:.0f} s, after {d['attempts']} signals; "
                                 "nothing was changed, the job runs on")
            return self._to(action_id, "planned", d, now, Step.PLANNED, True,
                            f"the checkpoint is {age:.0f} s old (limit {self.options.checkpoint_max_age_s:.0f} s): "
                            "asking for a fresh one")
        room = node_room(self.cli, job.job_id, d["node"], int(d["new_gres"].split(":")[-1]))
        if room is not None:
            return self._end(action_id, "failed", Step.FAILED, now, False, f"{room}; nothing was changed")
        # the run this move stops is the one Slurm shows now: the resume is checked against its restart count
        d = {**d, "hold_sent": {"at": now, "restart_count": job.restart_count}, "restart_before": job.restart_count}
        if not self._note(action_id, d):  # another enforcer took this step meanwhile
            return []
        try:
            self.cli.run("scontrol", "requeuehold", str(job.job_id))
        except SlurmRefused as exc:
            # refused, or a first requeuehold whose answer was lost went through
            again = read_job(self.cli, self.store, self.settings, job.job_id)
            if again is not None and again.restart_count > job.restart_count:
                return self._hold_took_effect(action_id, d, again, now)
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"Slurm refused the requeue ({exc}); the job runs on untouched")
        return self._to(action_id, "held", {**d, "held_at": now}, now, Step.STOPPED, True,
                        f"job {job.job_id} requeued and held (its checkpoint is at step {d['checkpoint']['step']})")

    def _hold_took_effect(self, action_id: int, d: dict[str, Any], job: SlurmJob,
                          now: float) -> list[StepOutcome]:
        """The job was requeued after fleetlens sent `scontrol requeuehold` whose answer did not come back: held
        (PENDING, JobHeldUser), the move carries on from `held`; still completing its requeue, wait; anything else
        (released by someone, or ended) is no longer fleetlens's to change."""
        held = job.state == "REQUEUE_HOLD" or (job.state in WAITING_STATES and is_held(job.reason))
        if held:
            return self._to(action_id, "held", {**d, "held_at": now}, now, Step.STOPPED, True,
                            f"job {job.job_id} requeued and held (Slurm's answer to the requeuehold was lost; squeue "
                            f"shows it {job.state}, {job.reason}, restart {job.restart_count}; its checkpoint is at "
                            f"step {d['checkpoint']['step']})")
        if job.state in ("REQUEUED", "REQUEUE_FED") or (job.state in HOLDING_STATES and job.state != "RUNNING"):
            return []  # still on its way back to the queue (COMPLETING, REQUEUED): held next
        if job.state in GONE_STATES:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {job.job_id} is {job.state} after its requeuehold (whose answer was lost); "
                             "nothing is left to release")
        return self._end(action_id, "failed", Step.FAILED, now, False,
                         f"job {job.job_id} was requeued by the requeuehold (whose answer was lost) but is not held "
                         f"now ({job.state}, {job.reason or 'no reason given'}: released by someone else?); it runs "
                         f"or waits with its old request {d['old_gres']} and resumes from its checkpoint at step "
                         f"{d['checkpoint']['step']}; fleetlens changes nothing more")

    def _held(self, action_id: int, d: dict[str, Any], job: SlurmJob | None, now: float) -> list[StepOutcome]:
        if job is None or job.state in GONE_STATES:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {d['job_id']} is {job.state if job else 'gone'} after the requeue; fleetlens "
                             "cannot release it")
        if job.state == "RUNNING":
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {job.job_id} was released by someone else after its requeuehold and runs again "
                             f"with its old request {job.gres} (from its checkpoint at step "
                             f"{d['checkpoint']['step']}); fleetlens changes nothing more")
        if job.state != "PENDING":  # still completing its requeue
            if now - float(d["held_at"]) > self.options.resume_timeout_s:
                why = (f"not back in Slurm's queue within {self.options.resume_timeout_s:.0f} s of its requeuehold "
                       f"(Slurm: {job.state}, {job.reason or 'no reason given'})")
                return self._to(action_id, "rolling_back", {**d, "why": why}, now, Step.FAILED, False,
                                f"{why}; restoring its request")
            return []
        room = node_room(self.cli, job.job_id, d["node"], int(d["new_gres"].split(":")[-1]))
        if room is not None:
            return self._to(action_id, "rolling_back", {**d, "why": room}, now, Step.FAILED, False,
                            f"{room}; restoring its request")
        try:
            self.cli.run("scontrol", "update", f"jobid={job.job_id}", f"gres={d['new_gres']}")
        except SlurmRefused as exc:
            return self._to(action_id, "rolling_back", {**d, "why": str(exc)}, now, Step.FAILED, False,
                            f"Slurm refused the new request ({exc}); restoring the old one")
        return self._to(action_id, "updated", d, now, Step.PLACED, True, f"request changed to {d['new_gres']}")

    def _updated(self, action_id: int, d: dict[str, Any], job: SlurmJob | None, now: float) -> list[StepOutcome]:
        if job is not None and job.state == "PENDING":
            self.cli.run("scontrol", "release", str(job.job_id))
        return self._to(action_id, "released", {**d, "released_at": now}, now, None, True,
                        f"job {d['job_id']} released with {d['new_gres']}")

    def _released(self, action_id: int, d: dict[str, Any], job: SlurmJob | None, now: float) -> list[StepOutcome]:
        if job is None or job.state in GONE_STATES:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"job {d['job_id']} is {job.state if job else 'gone'} after its release")
        started = read_started(self._folder(action_id))
        ckpt = d["checkpoint"]
        # the mark of the run this move started: Slurm's restart count now, past the one the hold stopped (a mark
        # left by an earlier run, of an earlier move, says nothing of this one)
        if job.state == "RUNNING" and started is not None and started.job_id == d["job_id"] \
                and started.restart_count == job.restart_count > int(d["restart_before"]):
            if started.step < int(ckpt["step"]) or started.restored_sha256 != ckpt["sha256"]:
                return self._end(action_id, "failed", Step.FAILED, now, False,
                                 f"job {d['job_id']} resumed at step {started.step}, not from its checkpoint at step "
                                 f"{ckpt['step']} (sha256 {ckpt['sha256'][:12]})", training_step=started.step)
            where = f"GPU {','.join(map(str, job.gpu_indices)) or '?'} of {job.node}"
            whole = whole_holders(self.cli, job)
            note = (f"; note: Slurm put it on a GPU that job(s) {whole} hold whole (Slurm 22.05 does not keep "
                    "whole-GPU jobs off shared GPUs)") if whole else ""
            return self._end(action_id, "resumed", Step.RESUMED, now, True,
                             f"resumed at step {started.step} (checkpoint {ckpt['step']}) on {where} with "
                             f"{job.gres}{note}", training_step=started.step,
                             extra={"gpu_indices": list(job.gpu_indices), "gpus_env": started.gpus})
        if now - float(d["released_at"]) > self.options.resume_timeout_s:
            why = (f"not resumed within {self.options.resume_timeout_s:.0f} s of its release (Slurm: {job.state}, "
                   f"{job.reason or 'no reason given'})")
            return self._to(action_id, "rolling_back", {**d, "why": why}, now, Step.FAILED, False,
                            f"{why}; restoring its request")
        return []

    def _rolling_back(self, action_id: int, d: dict[str, Any], job: SlurmJob | None,
                      now: float) -> list[StepOutcome]:
        why = d.get("why", "")
        if job is None or job.state in GONE_STATES:
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"{why}; and job {d['job_id']} is {job.state if job else 'gone'}, so nothing is left to "
                             "restore")
        if job.state == "RUNNING":
            return self._end(action_id, "failed", Step.FAILED, now, False,
                             f"{why}; meanwhile Slurm started job {d['job_id']} with {job.gres}: it runs on so")
        if not is_held(job.reason):
            self.cli.run("scontrol", "hold", str(job.job_id))
        if job.gres is None or str(job.gres) != d["old_gres"]:
            self.cli.run("scontrol", "update", f"jobid={job.job_id}", f"gres={d['old_gres']}")
        self.cli.run("scontrol", "release", str(job.job_id))
        return self._end(action_id, "rolled_back", Step.ROLLED_BACK, now, True,
                         f"{why}; job {d['job_id']} released with its old request {d['old_gres']}: it resumes from "
                         f"its checkpoint at step {d['checkpoint']['step']}")

    # ---- helpers ------------------------------------------------------------------------------------------------

    def _folder(self, action_id: int) -> str:
        return job_folder(self.settings, self._workflow(action_id))
