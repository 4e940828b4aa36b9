"""The start gate's I/O: rank 0, before the rendezvous, decides whether this attempt trains at
all (:func:`lmtrain.preemption.policy.start_gate`), records an earlier attempt that died without
its end line, and publishes the answer; every other rank reads it after the rendezvous.
Torch-free: it runs before the frameworks are imported."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from lmcore.atomic import write_private
from lmcore.run.checkpoint_index import newest_complete
from lmcore.run.run_layout import UNDECIDED_VAR
from lmcore.run.rundir import LedgerAttempt, RunLayout, is_cancelled, read_done_step
from lmtrain.observe.attempt import AttemptRecords, MissingEnd
from lmtrain.preemption.policy import Gate, StartFacts, start_gate
from lmtrain.preemption.signals import release_early_signals
from lmtrain.preemption.slurm_facts import previous_attempt_state

log = logging.getLogger("lmtrain.preemption")


def decide_start(plan: Any, env: Any, history: list[LedgerAttempt]) -> Gate:
    """Rank 0, before the rendezvous: decide from the ledger's ``history``, append a missing end
    line, publish the answer."""
    layout = RunLayout.of_plan(plan)
    ckpt = newest_complete(layout.checkpoints)
    previous_state = None
    if history and history[-1].reason is None and env.launcher == "slurm" and env.restart_count > 0:
        previous_state = previous_attempt_state(env.job_id)
    done, done_step = read_done_step(layout.run_dir)
    gate = start_gate(StartFacts(
        done_step=done_step, done_marker=done, cancelled_marker=is_cancelled(layout.run_dir),
        start_step=ckpt.step if ckpt is not None else 0, restart_count=env.restart_count, job_id=env.job_id,
        history=history, previous_state=previous_state, max_steps=plan.trainer.max_steps,
        undecided_exit=os.environ.get(UNDECIDED_VAR) or None if env.launcher == "slurm" else None,
    ), plan.preemption)
    if gate.previous_end is not None:
        AttemptRecords(plan, env, gate.previous_end["attempt"]).missing_end(MissingEnd(**gate.previous_end))
    if not gate.exit and done:
        log.warning("the run finished at step %s before; continuing to trainer.max_steps(%s)",
                    done_step, plan.trainer.max_steps)
        layout.done.unlink(missing_ok=True)
    path = layout.gate_file(env.rendezvous_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, gate.to_json())  # before the rendezvous file: a rank that sees that one sees this
    return gate


def read_gate(plan: Any, env: Any) -> Gate:
    """Every rank but 0, after the rendezvous: rank 0's answer."""
    d = json.loads(RunLayout.of_plan(plan).gate_file(env.rendezvous_key).read_text())
    return Gate(**d)


def finish_without_training(plan: Any, env: Any, attempt: int, gate: Gate) -> int:
    """An attempt the gate refused: rank 0 writes its start and end lines; every rank exits 0."""
    log.warning("attempt %d ends before training: %s (%s)", attempt, gate.reason, gate.detail)
    try:
        ckpt = newest_complete(plan.paths.checkpoint_dir) if env.rank == 0 else None
        AttemptRecords(plan, env, attempt).skipped(ckpt.step if ckpt is not None else 0, gate.reason or "",
                                                   gate.detail or "")
    finally:
        release_early_signals()
    return 0
