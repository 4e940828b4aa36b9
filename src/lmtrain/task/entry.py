"""What every SLURM task (and every local process) runs: plan.json -> Trainer -> fit/resume.

``run_slurm_task(run_dir)`` is called by :class:`lmtrain.task.train_task.TrainTask` in each srun task
(submitit's runner unpickles and calls it); ``python -m lmtrain.task.entry RUN_DIR`` is what
``lmlaunch run --local`` starts in each local process. Both go through :func:`run_task`:

1. read the plan and this task's environment (SLURM's, or the local launcher's);
2. rendezvous: rank 0 picks the attempt number and a free MASTER_PORT and publishes them;
3. tee this rank's output into its node's log, ``logs/attempt-<N>/node-<K>.log`` (its lines marked ``[rank R]``);
4. build data, model and Trainer from the plan; resume from the newest complete checkpoint;
5. train; write the ledger ``end`` line, the heartbeat ``end`` event and ``DONE`` (rank 0).

Preemption (:mod:`lmtrain.preemption`): the task owns SIGTERM and the warning signal
from its first line (handlers only record); a start gate (rank 0, before the rendezvous) ends
an attempt of a finished, cancelled or stuck run at once; the stop is agreed by all ranks at a
step boundary and checkpointed collectively; after the fit rank 0 decides the ledger reason,
writes the ``end`` line, and only then requeues (``scontrol requeue``) when the job must.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the task imports these when it needs them
    from lmcore.job.plan import LaunchPlan
    from lmtrain.distributed.task_env import Rendezvous, TaskEnv
    from lmtrain.preemption.policy import Gate

log = logging.getLogger("lmtrain")


def run_slurm_task(run_dir: str) -> int:
    """The body of every SLURM task (via lmtrain.task.train_task.TrainTask). An attempt that ended badly
    without an exception (disk_full, preflight_failed, a checkpoint it cannot resume) exits
    with its code, so SLURM records the job FAILED (submitit would call a returned value a
    success, and a dependant waiting with afterok would start)."""
    from lmtrain.preemption.signals import retire

    try:
        code = run_task(run_dir)
    finally:
        retire()  # a late time-limit warning must not kill the exiting process
    if code:
        raise SystemExit(code)
    return code


def run_task(run_dir: str | Path) -> int:
    from lmcore.run.rundir import RunLayout
    from lmtrain.observe.startup import CLOCK, imports_without_gc

    CLOCK.begin_attempt()
    CLOCK.mark("entry")
    from lmtrain.preemption.signals import own_signals

    raw_plan = json.loads(RunLayout.of(run_dir).plan.read_text())
    simulated = bool((raw_plan.get("spec") or {}).get("simulate"))  # the scale harness (lmtrain.simulate): no torch
    if simulated:  # the scale harness's counters, when its spec asks for them
        from lmtrain.simulate import fs_count

        fs_count.install_from_plan(raw_plan, "task", "start")
    # First of all, before any import that takes time: from here on lmtrain's handlers (record
    # only), not submitit's (tests/unit/test_preemption_signals.py)
    signals = own_signals(raw_plan.get("preemption") or {})
    fresh = "torch" not in sys.modules  # a task's process, not forked from a zygote nor called in-process
    with imports_without_gc(freeze=fresh):
        from lmcore.job.plan import LaunchPlan
        from lmtrain.distributed.task_env import begin_task

    plan = LaunchPlan.from_dict(raw_plan)
    begin_task(run_dir, plan)  # its record (node, pid, place in the mesh) and its own NCCL_IB_HCA
    try:
        if not simulated:
            with imports_without_gc(freeze=fresh):
                import_frameworks(deepspeed=bool(plan.parallelism.zero))  # the rest of them, with the signals already ours
        CLOCK.mark("imports")
        env, gate, rv = _meet(plan, simulated=simulated)
    except BaseException:
        signals.restore()  # this attempt never reaches training: give the handlers back
        raise
    from lmcore.run.rundir import RunLayout

    with _rank_log(RunLayout.of_plan(plan).node_log(rv.attempt, env.node_rank), env.rank):
        log.info(
            "lmtrain: run %s attempt %d, rank %d/%d (local %d, node %d), job %s, master %s:%d",
            plan.run_name, rv.attempt, env.rank, env.world_size, env.local_rank, env.node_rank,
            env.job_id, rv.addr, rv.port,
        )
        for note in plan.notes if env.rank == 0 else ():
            log.warning("notice: %s", note)
        if gate.exit:
            from lmtrain.preemption.gate import finish_without_training

            return finish_without_training(plan, env, rv.attempt, gate)
        return _attempt(plan, env, rv, signals, simulated=simulated)


def _attempt(plan: LaunchPlan, env: TaskEnv, rv: Rendezvous, signals: Any, *, simulated: bool) -> int:
    """What this attempt does once the start gate let it: evaluate a checkpoint (an eval job), run the
    scale harness (``simulate``), or train."""
    if (ev := plan.job_spec().eval) is not None and ev.checkpoint is not None:  # an eval job: rank 0 evaluates a checkpoint (lmtrain.task.evaluate)
        from lmtrain.task.evaluate import run_eval

        try:
            code = run_eval(plan, env, rv.attempt)
        finally:
            signals.restore()
    elif simulated:
        from lmtrain.simulate import fs_count
        from lmtrain.simulate.steps import train as simulate

        fs_count.note(attempt=rv.attempt, generation=env.generation)
        return simulate(plan, env, rv.attempt, rv.resume, addr=rv.addr, port=rv.port)
    else:
        from lmtrain.task.training import train

        code = train(plan, env, rv.attempt, resume=rv.resume)
    if code == 0:
        from lmtrain.distributed.task_env import leave_process_group

        leave_process_group()  # before the interpreter's teardown (an abort there fails the job)
    return code


def _meet(plan: LaunchPlan, *, simulated: bool = False) -> tuple[TaskEnv, Gate, Rendezvous]:
    """This task's environment, the start gate's answer and the rendezvous. Rank 0 reads the
    ledger once: this attempt's number, and the history the start gate judges; it decides
    whether this attempt trains at all (DONE / CANCELLED / loop guards) and publishes the answer
    before the rendezvous, so every rank reads the same one after it. Rank 0 alone lists the
    checkpoints; every rank resumes from its choice (shared filesystems may show each node a
    different listing for a moment)."""
    from lmcore.run.checkpoint_index import newest_complete
    from lmcore.run.rundir import Ledger, attempts_of, next_attempt_of
    from lmtrain.distributed.task_env import read_env, rendezvous
    from lmtrain.observe.startup import CLOCK
    from lmtrain.preemption.gate import decide_start, read_gate

    env = read_env()
    if env.world_size != plan.topology.world_size:
        raise RuntimeError(
            f"this task sees world_size {env.world_size} ({env.launcher}) but the plan has "
            f"nodes({plan.topology.nodes}) x tasks_per_node({plan.topology.tasks_per_node}) = "
            f"{plan.topology.world_size}; the job must be started with the plan's topology"
        )
    entries = Ledger(plan.paths.ledger).entries() if env.rank == 0 else []
    attempt = next_attempt_of(entries) if env.rank == 0 else None
    gate = decide_start(plan, env, attempts_of(entries)) if env.rank == 0 else None
    if env.rank == 0 and plan.paths.checkpoint_store and not simulated:  # a newer one in the bucket first
        from lmtrain.checkpoint.store_mirror import fetch_newer

        fetch_newer(plan)
    newest = newest_complete(plan.paths.checkpoint_dir) if env.rank == 0 else None
    resume = newest.path.name if newest is not None else None
    if resume is not None and not simulated:  # a ZeRO checkpoint on another world size (the harness has none)
        from lmtrain.checkpoint.resume_point import agreed_checkpoint, convert_for_world_size

        convert_for_world_size(plan, env, agreed_checkpoint(plan.paths.checkpoint_dir, resume))
    CLOCK.mark("gate")
    rv = rendezvous(env, plan.paths.run_dir, attempt=attempt, resume=resume)
    CLOCK.mark("rendezvous")
    return env, gate or read_gate(plan, env), rv


def import_frameworks(*, deepspeed: bool) -> None:
    """What every attempt imports before it can train (the ``imports`` phase of its startup
    record, with the plan's schema and lmtrain's preemption modules imported before it): the
    frameworks, transformers' model code and lmtrain's training modules, all while the caller
    has the garbage collector paused (lmtrain.observe.startup.imports_without_gc). The task's
    agent (lmtrain.task.agent) imports the same before it forks the training process."""
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import transformers.modeling_utils  # noqa: F401  (every model's base: most of a model's import)

    import lmtrain.task.training  # noqa: F401

    if deepspeed:
        import deepspeed as _deepspeed  # noqa: F401


class _Tee:
    def __init__(self, *streams: Any) -> None:
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


# Third-party advice that does not apply to a run lmlaunch started, left out of the rank's log by
# its exact text (a warning that matters still shows):
NOT_FOR_LMLAUNCH_RECORDS = (
    # Lightning's advert for its hosted logger, on every Trainer
    "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
    # transformers on a config without loss_type: the default causal-LM loss is what lmtrain trains with
    "`loss_type=None` was set in the config but it is unrecognized. Using the default loss: `ForCausalLMLoss`.",
)
NOT_FOR_LMLAUNCH_WARNINGS = (
    # Lightning on a SLURM host when the ranks were started by lmlaunch's local launcher, not by srun
    "The `srun` command is available on your system but is not used.",
    # Lightning's own use of torch's pytree API (nothing a user can change)
    "`isinstance(treespec, LeafSpec)` is deprecated",
)


class NotForLmlaunch(logging.Filter):
    """Drops the log records of :data:`NOT_FOR_LMLAUNCH_RECORDS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(text) for text in NOT_FOR_LMLAUNCH_RECORDS)


@contextlib.contextmanager
def _rank_log(path: Path, rank: int) -> Iterator[None]:
    """Tee Python's stdout/stderr (and logging) into this rank's share of its node's log, every line
    marked with the rank (lmcore.run.rank_logs). Output of C libraries (NCCL) still goes to the task's
    stdout, which submitit keeps per task."""
    from lmcore.run.rank_logs import NodeLogWriter

    f = NodeLogWriter(path, rank)
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(old_out, f), _Tee(old_err, f)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(NotForLmlaunch())
    root = logging.getLogger()
    root.addHandler(handler)
    # Lightning installs its own stderr handlers at import ("lightning": "INFO: ..."; its
    # subpackages), which import_frameworks did: route its records through ours (into the rank log)
    # instead of printing them twice. The scale harness's ranks (lmtrain.simulate) never import it.
    for name in ("lightning", "lightning.pytorch", "lightning.fabric") if "lightning.pytorch" in sys.modules else ():
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    for h in logging.getLogger("transformers").handlers:  # transformers prints through a handler of its own
        h.addFilter(NotForLmlaunch())
    for text in NOT_FOR_LMLAUNCH_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text))
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        sys.stdout, sys.stderr = old_out, old_err
        f.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lmtrain.task.entry RUN_DIR", file=sys.stderr)
        return 2
    from lmtrain.preemption.signals import retire

    try:
        return run_task(args[0])
    finally:
        retire()  # a late time-limit warning must not kill the exiting process


if __name__ == "__main__":
    sys.exit(main())
