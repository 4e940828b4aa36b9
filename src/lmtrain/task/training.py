"""One training attempt of one task: the resume point, the records, the Trainer, the outcome.

:func:`train` is what :func:`lmtrain.task.entry.run_task` hands an attempt to once the start gate
let it train: it resumes from the checkpoint rank 0 chose (its files checked against their
checksums), writes the attempt's start (:class:`lmtrain.observe.attempt.AttemptRecords`), builds data,
model, callbacks and the Trainer from the plan, and fits. However the fit ends, the preemption
controller settles the outcome (:meth:`lmtrain.preemption.controller.Preemption.settle`), the
records are written, and only then the job is requeued or cancelled.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcore.job.plan import LaunchPlan
    from lmcore.run.checkpoint_index import CompleteCheckpoint
    from lmtrain.distributed.task_env import TaskEnv
    from lmtrain.observe.attempt import AttemptRecords
    from lmtrain.preemption.controller import Preemption

log = logging.getLogger("lmtrain")


def train(plan: LaunchPlan, env: TaskEnv, attempt: int, resume: str | None) -> int:
    """Every rank: train this attempt; its exit code (non-zero: SLURM records the job FAILED)."""
    from lmtrain.observe.attempt import AttemptRecords, Outcome
    from lmtrain.observe.callbacks import StartupRecord
    from lmtrain.preemption.controller import Preemption, end_attempt

    records = AttemptRecords(plan, env, attempt)
    ctl = Preemption(plan, env, attempt)
    ctl.start()  # lmtrain owns SIGTERM and the warning signal from here on (handlers only record)
    _configure_torch(plan, env)
    found = _resume_point(plan, env, attempt, resume, ctl, records)
    if isinstance(found, int):
        return found  # cannot resume: not retryable, said in the rank log and the ledger
    ckpt, rank_state = found
    start_step = ckpt.step if ckpt is not None else 0
    records.started(start_step, resumed_from=str(ckpt.path) if ckpt is not None else None)
    if env.rank == 0:
        _record_environment(plan, env, attempt)
        _drop_abandoned(plan, attempt)
    startup = StartupRecord(records.ledger, attempt=attempt, job_id=env.job_id, rank=env.rank, start_step=start_step,
                            checkpoint_bytes=ckpt.size_bytes() if ckpt is not None and env.rank == 0 else None)
    trainer: Any = None
    try:
        from lmtrain.health import preflight

        preflight.run(plan, env, attempt)  # every node, before the ranks meet; all agree
        if start_step >= plan.trainer.max_steps:
            log.info("checkpoint step-%d is already at max_steps(%d): nothing to train", start_step,
                     plan.trainer.max_steps)
            outcome = Outcome(reason="completed", end_step=start_step, detail="already at max_steps")
        else:
            from lmtrain.task.fit import Fit

            fit = Fit(plan, env, ctl, records, ckpt, rank_state)
            trainer = fit.trainer_for(startup)
            outcome = fit.run(trainer)
    except BaseException as exc:
        outcome = ctl.failed(exc, trainer.global_step if trainer is not None else start_step, records)
    return end_attempt(ctl, records, startup, ctl.settle(outcome, start_step))


def _resume_point(plan: LaunchPlan, env: TaskEnv, attempt: int, resume: str | None, ctl: Preemption,
                  records: AttemptRecords) -> tuple[CompleteCheckpoint | None, Any] | int:
    """The checkpoint this attempt resumes from (rank 0's choice, its files checked) and this
    rank's own state in it; or, when it cannot resume, the exit code (2, never requeued)."""
    from lmtrain.checkpoint.manager import CheckpointError, check_compatible
    from lmtrain.checkpoint.resume_point import agreed_checkpoint, resume_point
    from lmtrain.distributed.node_share import training_share

    try:
        ckpt = agreed_checkpoint(plan.paths.checkpoint_dir, resume, rank=env.rank)
    except CheckpointError as exc:
        ctl.signals.restore()
        raise RuntimeError(f"rank {env.rank}: {exc}") from None
    if ckpt is None:
        return None, None
    try:
        # its files are the ones written, the ranks' checks gathered per node where they can be
        ckpt = resume_point(plan, env, attempt, ckpt, node=training_share(os.environ, env.node_rank))
        check_compatible(ckpt, plan.parallelism.with_world(env.world_size))
    except CheckpointError as exc:
        log.error("cannot resume: %s", exc)
        records.refused(ckpt.step, f"cannot resume: {exc}")
        ctl.tell_batch_script("none", [])  # the next attempt could not resume either
        ctl.signals.restore()
        return 2
    return ckpt, ckpt.rank_state(env.rank)


def _record_environment(plan: LaunchPlan, env: TaskEnv, attempt: int) -> None:
    """Rank 0: what this attempt runs on (``lmlaunch diff``); a warning when it does not run the
    run's code snapshot."""
    import json

    from lmtrain.observe.environment_record import record_environment

    try:
        path = record_environment(plan, env, attempt)
        code = json.loads(path.read_text())["code"]
        if code["snapshot_digest"] and not code["from_snapshot"]:
            log.warning("this attempt runs lmtrain from %s, not the run's code snapshot (%s/code): "
                        "was PYTHONPATH changed?", code["lmtrain"], plan.paths.run_dir)
    except OSError as exc:
        log.warning("could not record the environment of attempt %d: %s", attempt, exc)


def _drop_abandoned(plan: LaunchPlan, attempt: int) -> None:
    """Rank 0: the run directory's temporary files that an earlier attempt's writers, killed between
    write and rename, left (a chaos campaign's rank SIGKILLed while it rewrote metrics/rank-times.json
    left one in a completed run): those older than the last attempt's end line, whose processes are gone."""
    from lmcore.atomic import drop_abandoned_under
    from lmcore.jsonlines import read_jsonl

    ends = [float(e["time"]) for e in read_jsonl(plan.paths.ledger) if e.get("event") == "end" and e.get("time")]
    if attempt <= 1 or not ends:
        return
    try:
        # not eval/: the evaluator alongside outlives attempts; the checkpoints have their own protocol
        removed = drop_abandoned_under(plan.paths.run_dir, max(ends), skip=("checkpoints", "code", "eval"))
    except OSError as exc:
        log.warning("could not look for abandoned temporary files in %s: %s", plan.paths.run_dir, exc)
        return
    if removed:
        log.info("removed %d temporary file(s) earlier attempts' killed writers left: %s", len(removed),
                 ", ".join(str(p.relative_to(plan.paths.run_dir)) for p in removed[:5]))


def _configure_torch(plan: LaunchPlan, env: TaskEnv) -> None:
    import torch

    t = plan.trainer
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("SLURM_CPUS_PER_TASK")
    if t.accelerator == "cpu" and threads:
        torch.set_num_threads(max(1, int(threads)))
    if t.accelerator == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = True  # 32-true matmuls on tensor cores
        torch.backends.cudnn.allow_tf32 = True
