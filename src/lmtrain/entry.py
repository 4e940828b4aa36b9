"""What every SLURM task (and every local process) runs: plan.json -> Trainer -> fit/resume.

``run_slurm_task(run_dir)`` is called by :class:`lmtrain.task.TrainTask` in each srun task
(submitit's runner unpickles and calls it); ``python -m lmtrain.entry RUN_DIR`` is what
``lmlaunch run --local`` starts in each local process. Both go through :func:`run_task`:

1. read the plan and this task's environment (SLURM's, or the local launcher's);
2. rendezvous: rank 0 picks the attempt number and a free MASTER_PORT and publishes them;
3. tee this rank's output into ``logs/attempt-<N>/rank-<R>.log``;
4. build data, model and Trainer from the plan; resume from the newest complete checkpoint;
5. train; write the ledger ``end`` line, the heartbeat ``end`` event and ``DONE`` (rank 0).

Preemption (:mod:`lmtrain.signals`, :mod:`lmtrain.preemption`): the task owns SIGTERM and the warning signal
from its first line (handlers only record); a start gate (rank 0, before the rendezvous) ends
an attempt of a finished, cancelled or stuck run at once; the stop is agreed by all ranks at a
step boundary and checkpointed collectively; after the fit rank 0 decides the ledger reason,
writes the ``end`` line, and only then requeues (``scontrol requeue``) when the job must.
The ``hooks`` argument is for tests and tools: its callbacks join the Trainer's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the task imports these when it needs them
    import lightning.pytorch as pl

    from launcher.core.plan import LaunchPlan
    from lmtrain.env import TaskEnv
    from lmtrain.preemption import Preemption
    from lmtrain.signals import StopRequest

log = logging.getLogger("lmtrain")


@dataclass
class Outcome:
    """How this attempt ended (what the ledger's ``end`` line says)."""

    reason: str  # completed | preempted | timeout | cancelled | crashed | ...
    end_step: int
    detail: str | None = None
    requeued: bool = False
    exit_code: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # ledger extras: signal_time, checkpoint_seconds, ...


@dataclass
class Hooks:
    """Extension points for the caller (preemption handling, tests).

    ``setup(ctx)`` runs on every rank before the Trainer is built and may return callbacks.
    """

    setup: Callable[[RunContext], list[Any]] | None = None
    callbacks: list[Any] = field(default_factory=list)


@dataclass
class RunContext:
    plan: LaunchPlan
    env: TaskEnv
    attempt: int
    run_dir: Path
    stop: StopRequest
    trainer: pl.Trainer | None = None
    start_step: int = 0
    preemption: Preemption | None = None


def run_slurm_task(run_dir: str) -> int:
    """The body of every SLURM task (via lmtrain.task.TrainTask). An attempt that ended badly
    without an exception (disk_full, preflight_failed, a checkpoint it cannot resume) exits
    with its code, so SLURM records the job FAILED (submitit would call a returned value a
    success, and a dependant waiting with afterok would start)."""
    from lmtrain.signals import retire

    try:
        code = run_task(run_dir)
    finally:
        retire()  # a late time-limit warning must not kill the exiting process
    if code:
        raise SystemExit(code)
    return code


def run_task(run_dir: str | Path, *, hooks: Hooks | None = None) -> int:
    from lmtrain.startup import CLOCK, imports_without_gc

    CLOCK.begin_attempt()
    CLOCK.mark("entry")
    from launcher.core.rundir import PLAN
    from lmtrain.signals import own_signals

    run_dir = Path(run_dir)
    raw_plan = json.loads((run_dir / PLAN).read_text())
    # First of all, before any import that takes time: from here on lmtrain's handlers (record
    # only), not submitit's (tests/unit/test_preemption_signals.py)
    signals = own_signals(raw_plan.get("preemption") or {})
    fresh = "torch" not in sys.modules  # a task's process, not forked from a zygote nor called in-process
    with imports_without_gc(freeze=fresh):
        from launcher.core.plan import LaunchPlan
        from launcher.core.rundir import Ledger, attempts_of, next_attempt_of
        from lmtrain import preemption
        from lmtrain.env import read_env, rendezvous
        from lmtrain.task_record import record_this_task

    plan = LaunchPlan.from_dict(raw_plan)
    record_this_task(run_dir)  # this process's node and pid, for `lmlaunch stacks` (even if stuck starting)
    try:
        with imports_without_gc(freeze=fresh):
            _import_frameworks(plan.training.strategy)  # the rest of them, with the signals already ours
        CLOCK.mark("imports")
        env = read_env()
        if env.world_size != plan.topology.world_size:
            raise RuntimeError(
                f"this task sees world_size {env.world_size} ({env.launcher}) but the plan has "
                f"nodes({plan.topology.nodes}) x tasks_per_node({plan.topology.tasks_per_node}) = "
                f"{plan.topology.world_size}; the job must be started with the plan's topology"
            )
        # Rank 0 reads the ledger once: this attempt's number, and the history the start gate
        # judges. It decides whether this attempt trains at all (DONE / CANCELLED / loop guards)
        # and publishes the answer before the rendezvous, so every rank reads the same one after it.
        entries = Ledger(plan.paths.ledger).entries() if env.rank == 0 else []
        attempt = next_attempt_of(entries) if env.rank == 0 else None
        gate = preemption.decide_start(plan, env, run_dir, attempts_of(entries)) if env.rank == 0 else None
        # Rank 0 alone lists the checkpoints; every rank resumes from its choice (shared filesystems
        # may show each node a different listing for a moment).
        resume = _newest_checkpoint_name(plan) if env.rank == 0 else None
        if resume is not None:
            from lmtrain.resume_point import agreed_checkpoint, convert_for_world_size

            convert_for_world_size(plan, env, agreed_checkpoint(plan.paths.checkpoint_dir, resume))
        CLOCK.mark("gate")
        rv = rendezvous(env, run_dir, attempt=attempt, resume=resume)
        CLOCK.mark("rendezvous")
        gate = gate or preemption.read_gate(run_dir, env)
    except BaseException:
        signals.restore()  # this attempt never reaches training: give the handlers back
        raise
    log_path = Path(plan.paths.logs_dir) / f"attempt-{rv.attempt}" / f"rank-{env.rank}.log"
    with _rank_log(log_path, env.rank):
        log.info(
            "lmtrain: run %s attempt %d, rank %d/%d (local %d, node %d), job %s, master %s:%d",
            plan.run_name, rv.attempt, env.rank, env.world_size, env.local_rank, env.node_rank,
            env.job_id, rv.addr, rv.port,
        )
        for note in plan.notes if env.rank == 0 else ():
            log.warning("notice: %s", note)
        if gate.exit:
            return preemption.finish_without_training(plan, env, rv.attempt, gate)
        if plan.spec.get("eval"):  # an eval job: rank 0 evaluates a checkpoint (lmtrain.evaluate)
            from lmtrain.evaluate import run_eval

            try:
                return run_eval(plan, env, rv.attempt, run_dir)
            finally:
                signals.restore()
        return _train(plan, env, rv.attempt, run_dir, hooks or Hooks(), resume=rv.resume)


def _import_frameworks(strategy: str) -> None:
    """What every attempt imports before it can train (the ``imports`` phase of its startup
    record, with the plan's schema and lmtrain's preemption modules imported before it): the
    frameworks, transformers' model code and lmtrain's training modules, all while the caller
    has the garbage collector paused (lmtrain.startup.imports_without_gc)."""
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import transformers.modeling_utils  # noqa: F401  (every model's base: most of a model's import)

    import lmtrain.callbacks
    import lmtrain.data
    import lmtrain.module
    import lmtrain.strategies  # noqa: F401

    if strategy == "deepspeed":
        import deepspeed  # noqa: F401


def _newest_checkpoint_name(plan) -> str | None:
    from lmtrain.checkpoint import newest_complete

    ckpt = newest_complete(plan.paths.checkpoint_dir)
    return ckpt.path.name if ckpt is not None else None


_LIST_LOCALLY = "<list locally>"


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, data: str) -> int:
        for s in self.streams:
            s.write(data)
            s.flush()
        return len(data)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.streams[0].fileno()


@contextlib.contextmanager
def _rank_log(path: Path, rank: int):
    """Tee Python's stdout/stderr (and logging) into this rank's own log file. Output of C
    libraries (NCCL) still goes to the task's stdout, which submitit keeps per task."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a", buffering=1)
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(old_out, f), _Tee(old_err, f)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    # Lightning installs its own stderr handlers at import; route its records through ours
    # (into the rank log) instead of printing them twice.
    import lightning.pytorch  # noqa: F401  (installs those handlers now)

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        sys.stdout, sys.stderr = old_out, old_err
        f.close()


def _train(plan, env, attempt: int, run_dir: Path, hooks: Hooks, resume: str | None = _LIST_LOCALLY) -> int:
    from launcher.core.rundir import DONE, AttemptEnd, AttemptStart, Ledger
    from lmtrain.callbacks import RunInfo, StartupRecord, heartbeat_of
    from lmtrain.checkpoint import CheckpointError, check_compatible, newest_complete
    from lmtrain.notify import Notifier
    from lmtrain.preemption import Preemption
    from lmtrain.resume_point import agreed_checkpoint, resume_point
    from lmtrain.signals import StopRequest

    t, paths = plan.trainer, plan.paths
    max_steps = t.max_steps
    is_zero = env.rank == 0
    ledger = Ledger(paths.ledger)
    info = RunInfo(
        run_dir=str(run_dir), attempt=attempt, job_id=env.job_id, restart_count=env.restart_count,
        world_size=env.world_size, rank=env.rank, nodes=list(env.nodes), max_steps=max_steps,
    )
    heartbeat = heartbeat_of(paths.heartbeat, info)
    stop = StopRequest()
    ctx = RunContext(plan=plan, env=env, attempt=attempt, run_dir=run_dir, stop=stop)
    # lmtrain owns SIGTERM and the warning signal from here on (handlers only record).
    ctx.preemption = Preemption(plan, env, run_dir, stop, attempt)
    ctx.preemption.start()

    _configure_torch(t, env)

    # --- resume point (rank 0's choice, published in the rendezvous) ------------------------
    start_step = 0
    rank_state = None
    try:
        if resume == _LIST_LOCALLY:
            ckpt = newest_complete(paths.checkpoint_dir)
        else:
            ckpt = agreed_checkpoint(paths.checkpoint_dir, resume)
    except CheckpointError as exc:
        ctx.preemption.signals.restore()
        raise RuntimeError(f"rank {env.rank}: {exc}") from None
    if ckpt is not None:
        try:
            ckpt = resume_point(plan, env, run_dir, attempt, ckpt)  # its files are the ones written
            check_compatible(ckpt, strategy=plan.training.strategy, world_size=env.world_size)
        except CheckpointError as exc:
            # Not retryable: say so in the rank log and the ledger, exit non-zero, never requeue.
            log.error("cannot resume: %s", exc)
            if is_zero:
                now = time.time()
                ledger.write(AttemptStart(
                    attempt=attempt, job_id=env.job_id, restart_count=env.restart_count, time=now,
                    start_step=ckpt.step, nodes=list(env.nodes), world_size=env.world_size,
                ))
                ledger.write(AttemptEnd(attempt=attempt, job_id=env.job_id, time=now, end_step=ckpt.step,
                                        reason="crashed", detail=f"cannot resume: {exc}"[:2000]))
            ctx.preemption.signals.restore()
            return 2
        start_step = ckpt.step
        rank_state = ckpt.rank_state(env.rank)
    ctx.start_step = start_step

    if is_zero:
        ledger.write(AttemptStart(
            attempt=attempt, job_id=env.job_id, restart_count=env.restart_count, time=time.time(),
            start_step=start_step, nodes=list(env.nodes), world_size=env.world_size,
        ))
        try:
            from lmtrain.environment import record_environment

            path = record_environment(plan, env, attempt, run_dir)  # what this attempt runs on (lmlaunch diff)
            code = json.loads(path.read_text())["code"]
            if code["snapshot_digest"] and not code["from_snapshot"]:
                log.warning("this attempt runs lmtrain from %s, not the run's code snapshot (%s/code): "
                            "was PYTHONPATH changed?", code["lmtrain"], run_dir)
        except OSError as exc:
            log.warning("could not record the environment of attempt %d: %s", attempt, exc)
    startup = StartupRecord(ledger, attempt=attempt, job_id=env.job_id, rank=env.rank, start_step=start_step,
                            checkpoint_bytes=ckpt.size_bytes() if ckpt is not None and is_zero else None)
    heartbeat.emit("start", step=start_step, max_steps=max_steps,
                   resumed_from=str(ckpt.path) if ckpt is not None else None)
    notifier = Notifier(plan.spec.get("notify") or {}, run=plan.run_name, attempt=attempt, job_id=env.job_id,
                        enabled=is_zero)
    notifier.send("started", f"attempt {attempt} started on {','.join(env.nodes)} from step {start_step}",
                  nodes=list(env.nodes), start_step=start_step, max_steps=max_steps)

    outcome = Outcome(reason="crashed", end_step=start_step, exit_code=1)
    try:
        from lmtrain import preflight

        preflight.run(plan, env, attempt, run_dir)  # every node, before the ranks meet; all agree
        if start_step >= max_steps:
            log.info("checkpoint step-%d is already at max_steps(%d): nothing to train", start_step, max_steps)
            outcome = Outcome(reason="completed", end_step=start_step, detail="already at max_steps")
        else:
            outcome = _fit(plan, env, ctx, hooks, heartbeat, ckpt, rank_state, startup)
    except BaseException as exc:
        from lmtrain.disk_space import disk_full_in
        from lmtrain.preflight import PreflightFailed
        from lmtrain.watchdog import hang_reason

        outcome = Outcome(
            reason=stop.reason or hang_reason(exc, paths.logs_dir, attempt) or "crashed",
            end_step=ctx.trainer.global_step if ctx.trainer is not None else start_step,
            detail=f"{type(exc).__name__}: {exc}"[:2000],
            exit_code=1,
        )
        full = disk_full_in(exc)
        if isinstance(exc, PreflightFailed):  # a diagnosis: lmtrain.policy requeues off the failing nodes or stops
            outcome.reason, outcome.extra["preflight"] = "preflight_failed", exc.failed
            log.error("%s", exc)
        elif full is None:
            log.error("training failed:\n%s", traceback.format_exc())
            _last_words(run_dir, attempt, env, exc)
            raise
        else:  # a diagnosis, not a crash: the figures go to the ledger (reason disk_full, lmtrain.policy)
            outcome.extra["disk_full"] = full.figures
            log.error("training stopped: %s", full)
    finally:
        hung = outcome.reason == "hang"  # lmtrain.watchdog: a rank of this attempt stopped making progress
        ctx.preemption.decide(ctx, outcome)  # reason, requeue decision (rank 0 asks SLURM)
        if hung and outcome.reason == "crashed":
            outcome.reason = "hang"  # same retry rules as a crash; the ledger says why
        if is_zero:
            if outcome.reason == "completed":
                _write_marker(run_dir / DONE, f"{outcome.end_step}\n")  # durable: fsynced, atomic
            ledger.write_end_once(AttemptEnd(  # the hang watchdog may have written it
                attempt=attempt, job_id=env.job_id, time=time.time(), end_step=outcome.end_step,
                reason=outcome.reason, detail=outcome.detail, requeued=outcome.requeued, extra=outcome.extra,
            ))
        heartbeat.emit("end", step=outcome.end_step, reason=outcome.reason, **outcome.extra)
        if is_zero:
            try:
                _notify_end(notifier, plan, outcome, attempt)
            except Exception as exc:  # a message must never cost the requeue below
                log.warning("notify: could not compose the end message: %s", exc)
        if is_zero and not startup.written:  # ended before its first step: the phases it reached
            startup.write()
        ctx.preemption.after_end(ctx, outcome)  # scontrol requeue comes LAST
        notifier.close()  # delivered in the background meanwhile; a bounded wait
    return outcome.exit_code


def _last_words(run_dir: Path, attempt: int, env, exc: BaseException) -> None:
    """This rank dies of ``exc``: say so where rank 0 looks for the first death (lmtrain.first_death)."""
    from launcher.core.rundir import LastWords
    from lmtrain.first_death import is_peer_lost

    text = f"{type(exc).__name__}: {exc}".strip()
    line = text.splitlines()[-1] if text else type(exc).__name__
    node = env.nodes[env.node_rank] if env.node_rank < len(env.nodes) else ""
    try:
        LastWords(rank=env.rank, node=node, pid=os.getpid(), time=time.time(), how="exception",
                  detail=(text.splitlines()[0] + (f" ... {line}" if line != text.splitlines()[0] else ""))[:500],
                  peer_lost=is_peer_lost(text)).write(run_dir, attempt)
    except OSError as err:
        log.warning("could not write this rank's last words: %s", err)


def _notify_end(notifier: Any, plan: LaunchPlan, outcome: Outcome, attempt: int) -> None:
    """The webhook messages of how this attempt ended."""
    from launcher.core.rundir import read_jsonl
    from lmtrain.notify import goodput, last_lines

    step, reason, detail = outcome.end_step, outcome.reason, outcome.detail or ""
    facts = {"reason": reason, "end_step": step, "detail": detail[:500]}
    if reason in ("preempted", "timeout"):
        notifier.send("preempted", f"attempt {attempt} {reason} at step {step}", **facts)
    elif reason == "hang":
        notifier.send("hang", f"attempt {attempt} hung at step {step}: {detail[:300]}", **facts)
    elif reason == "completed":
        beats = read_jsonl(plan.paths.heartbeat)
        losses = [b["loss"] for b in beats if b.get("event") == "step" and isinstance(b.get("loss"), (int, float))]
        g = goodput(read_jsonl(plan.paths.ledger), beats, time.time())
        loss_text = f"{losses[-1]:.4f}" if losses else "?"
        notifier.send("completed", f"completed at step {step}: loss {loss_text}, goodput "
                      f"{'?' if g is None else f'{g:.2f}'}", **facts, loss=losses[-1] if losses else None, goodput=g)
    if outcome.requeued:
        notifier.send("requeued", f"requeued after {reason}: the next attempt resumes from the newest checkpoint",
                      **facts)
    elif reason not in ("completed", "preempted", "timeout", "cancelled", "hang"):
        logs = sorted((Path(plan.paths.logs_dir) / f"attempt-{attempt}").glob("rank-*.log"))
        notifier.send("failed", f"attempt {attempt} failed ({reason}) at step {step}: {detail[:300]}",
                      **facts, log_tail=last_lines(logs))


def _write_marker(path: Path, text: str) -> None:
    from lmtrain.durable import write_text_atomic

    write_text_atomic(path, text)


def _configure_torch(t, env) -> None:
    import torch

    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("SLURM_CPUS_PER_TASK")
    if t.accelerator == "cpu" and threads:
        torch.set_num_threads(max(1, int(threads)))
    if t.accelerator == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = True  # 32-true matmuls on tensor cores
        torch.backends.cudnn.allow_tf32 = True


def _watchdog_callbacks(plan, env, ctx: RunContext, heartbeat) -> list[Any]:
    """The hang watchdog (lmtrain.watchdog), unless the spec turned it off."""
    from lmtrain.watchdog import WatchdogCallback, watchdog_settings

    w = watchdog_settings(plan.spec)
    if w["hang_timeout_s"] is None:
        return []
    return [WatchdogCallback(
        timeout_s=float(w["hang_timeout_s"]), grace_s=float(w["exit_grace_s"]), logs_dir=plan.paths.logs_dir,
        ledger=plan.paths.ledger, attempt=ctx.attempt, rank=env.rank, job_id=env.job_id, heartbeat=heartbeat,
    )]


def _fit(plan, env, ctx: RunContext, hooks: Hooks, heartbeat, ckpt, rank_state, startup) -> Outcome:
    import lightning.pytorch as pl

    from launcher.core.checkpoint_index import checkpoint_bytes
    from lmtrain.callbacks import (
        CheckpointCallback,
        MetricsHeartbeat,
        RealignAccumulation,
        RngNeutralValidation,
        logger_identity,
        make_loggers,
    )
    from lmtrain.checkpoint import CheckpointManager
    from lmtrain.data import TokenData, make_dataloaders
    from lmtrain.elastic import needs_universal, universal_dir
    from lmtrain.model import build_config, parameter_count
    from lmtrain.module import LMModule, OptimSettings, RuntimeSettings
    from lmtrain.startup import CLOCK
    from lmtrain.strategies import build_strategy
    from lmtrain.watchdog import process_group_timeout

    spec, t, training, paths = plan.spec, plan.trainer, plan.training, plan.paths
    job = plan.job_spec()  # typed: checkpoint, logging, data, trainer settings
    stop = ctx.stop
    max_steps = t.max_steps
    data_spec = job.data
    seed = training.seed

    # --- data -----------------------------------------------------------------------------
    config = build_config(spec["model"])
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None:
        TokenData(data_spec.path).check_vocab(int(vocab))
    train_loader, val_loader, sampler = make_dataloaders(data_spec, world_size=env.world_size, rank=env.rank, seed=seed)
    if ctx.preemption is not None:
        ctx.preemption.guard_workers(train_loader, val_loader)  # workers ignore SIGTERM / the warning
    resume_rng = None
    realign = None
    if ckpt is not None:
        state = rank_state if rank_state is not None else ckpt.rank_state(0)
        if state is None:
            raise RuntimeError(f"{ckpt.path} has no rank-{env.rank}.pt nor rank-0.pt: not a complete lmtrain checkpoint")
        sampler.load_state_dict(state["data_sampler"])
        if rank_state is not None and int(rank_state.get("world_size", env.world_size)) == env.world_size:
            resume_rng = rank_state["rng"]
        else:
            old_world = int((rank_state or state).get("world_size", env.world_size))
            log.warning(
                "resuming step-%d on %d ranks (written on %d): data position re-sharded, RNG streams start fresh",
                ckpt.step, env.world_size, old_world,
            )
            old_accum = plan.topology.global_batch_size // (plan.topology.micro_batch_size * old_world)
            realign = RealignAccumulation(old_accum, t.accumulate_grad_batches)

    universal = ckpt is not None and needs_universal(ckpt, strategy=training.strategy, world_size=env.world_size)
    CLOCK.mark("data")

    # --- model ----------------------------------------------------------------------------
    pl.seed_everything(seed, workers=True, verbose=False)
    accum = t.accumulate_grad_batches
    rt = RuntimeSettings(
        strategy=training.strategy, precision=t.precision, accelerator=t.accelerator,
        clip_val=training.gradient_clip_val, seq_len=data_spec.seq_len, micro_batch_size=data_spec.micro_batch_size,
        world_size=env.world_size, accumulate=accum, log_every_n_steps=t.log_every_n_steps,
        offload_optimizer=job.trainer.offload_optimizer,
    )
    module = LMModule(spec["model"], OptimSettings.from_spec(spec["optim"], max_steps), rt, seed)
    module.data_sampler = sampler

    # --- callbacks, loggers ---------------------------------------------------------------
    manager = CheckpointManager(
        paths.checkpoint_dir,
        keep_last=job.checkpoint.keep_last,
        every_n_steps=job.checkpoint.every_n_steps,
        strategy=training.strategy,
        zero_stage=job.trainer.zero_stage if training.strategy == "deepspeed" else None,
        identity={"job_id": env.job_id, "attempt": ctx.attempt,
                  "logger": logger_identity(str(ctx.run_dir), spec["logging"])},
    )
    manager.collective_timeout = process_group_timeout(plan.spec)  # the background writers' group (gloo)
    # room for a first checkpoint, before there is one to measure (lmtrain.disk_space)
    manager.estimate = lambda: checkpoint_bytes(parameter_count(spec["model"])[0], training.strategy, t.precision)
    ckpt_cb = CheckpointCallback(
        manager, lambda: {"data_sampler": sampler.state_dict()}, heartbeat,
        resume_rng=resume_rng, resumed_step=ckpt.step if ckpt is not None else None,
        background=job.checkpoint.async_save,
    )
    metrics_cb = MetricsHeartbeat(heartbeat, every_n_steps=job.logging.heartbeat_every_n_steps)
    module.metrics_sink = metrics_cb.step_metrics
    stop_cb = ctx.preemption.callback(ckpt_cb)
    callbacks = [startup, ckpt_cb, stop_cb, RngNeutralValidation(), metrics_cb, *([realign] if realign else [])]
    if hooks.setup is not None:
        callbacks += list(hooks.setup(ctx) or [])
    callbacks += hooks.callbacks
    callbacks += _watchdog_callbacks(plan, env, ctx, heartbeat)  # last: it beats after checkpoint writes
    loggers = make_loggers(ctx.run_dir, spec["logging"], plan.run_name, resume_step=ckpt.step if ckpt else None)

    # --- trainer ----------------------------------------------------------------------------
    # The plan's Trainer arguments as they are (the dry run printed them); without a validation
    # split in the data, the same arguments with validation off.
    trainer_plan = t if val_loader is not None else t.without_validation()
    validate = trainer_plan.val_check_interval is not None
    trainer = pl.Trainer(
        **trainer_plan.kwargs(),
        strategy=build_strategy(plan, env, load_universal=universal),
        enable_model_summary=env.rank == 0,
        logger=loggers or False,
        callbacks=callbacks,
    )
    ctx.trainer = trainer
    CLOCK.mark("model")
    fit_kwargs: dict[str, Any] = {}
    if ckpt is not None:
        path = universal_dir(ckpt) if universal else ckpt.lightning_path
        fit_kwargs = {"ckpt_path": str(path), "weights_only": True}
        log.info("resuming from %s (step %d)", path, ckpt.step)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader if validate else None, **fit_kwargs)

    step = trainer.global_step
    if validate and step >= max_steps and max_steps % (trainer_plan.val_every_n_steps or max_steps):
        # The last interval did not end on a validation step: validate the final weights.
        trainer.validate(module, dataloaders=val_loader, verbose=False)
    if stop.agreed_step is not None:
        return Outcome(reason=stop.reason or "preempted", end_step=step,
                       detail=f"{stop.detail or stop.reason}; checkpoint step-{stop.agreed_step} complete")
    if step >= max_steps:
        return Outcome(reason="completed", end_step=step)
    return Outcome(reason="crashed", end_step=step, detail=f"the Trainer stopped at step {step} < max_steps({max_steps})", exit_code=1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lmtrain.entry RUN_DIR", file=sys.stderr)
        return 2
    from lmtrain.signals import retire

    try:
        return run_task(args[0])
    finally:
        retire()  # a late time-limit warning must not kill the exiting process


if __name__ == "__main__":
    sys.exit(main())
