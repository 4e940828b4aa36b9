"""The batch script's parts for an evaluator alongside the training (``eval.alongside``): the run is
one SLURM heterogeneous job, the trainer its first component (every option launcher.submit.script
renders) and the evaluator its second (``#SBATCH hetjob``, then the evaluator's own partition,
nodes, CPUs, GPUs and memory; the job's name, time, requeue, signal, account and QOS are SLURM's
propagated options). Both start together, and a preemption or a requeue takes both.

In the script: the evaluator's srun (``--het-group=1``) starts in the background before the
trainer's; a plain srun is the first component's, so the trainer's command is unchanged. When
the trainer's srun has ended (its restart loop too), the script says so in the run's
``eval/training-ended`` (the job id and srun's exit status) and waits at most
``finish_wait_s`` for the evaluator to score what is left, then stops it; the job's exit status
stays the trainer's. Pure: its options and shell lines (launcher.submit.script renders the scripts).
"""

from __future__ import annotations

import shlex
from typing import Any

from launcher.submit.container_lines import container_task_command, host_lines
from launcher.submit.shell import export_line
from lmcore.job.container import ContainerPlan
from lmcore.job.plan import LaunchPlan
from lmcore.run.eval_alongside import EVALUATOR_EXIT, TRAINING_ENDED, EvaluatorPlan

EVALUATOR_MODULE = "lmtrain.evaluator.main"


def evaluator_of(plan: LaunchPlan) -> EvaluatorPlan | None:
    return EvaluatorPlan.from_json(plan.evaluator) if plan.evaluator else None


def component_options(ev: EvaluatorPlan) -> list[tuple[str, Any]]:
    """The second component's sbatch options (launcher.submit.script renders them after ``hetjob``)."""
    return [("partition", ev.partition), ("nodes", ev.nodes), ("ntasks-per-node", 1),
            ("cpus-per-task", ev.cpus_per_task), ("gres", ev.gres or None), ("mem", ev.mem or None)]


def evaluator_command(plan: LaunchPlan, *extra: str, python: str | None = None) -> str:
    """What the evaluator's srun starts: lmtrain.evaluator.main on the run directory (and ``extra``
    arguments) with the evaluator's interpreter (``python``, else the plan's evaluator's, else the
    tasks'), or in the run's container as the trainer's tasks are."""
    inner = ["-u", "-m", EVALUATOR_MODULE, plan.paths.run_dir, *extra]
    if plan.container is not None:  # the container's interpreter: the image must hold lm-eval
        return container_task_command(ContainerPlan.from_json(plan.container), inner)
    ev = evaluator_of(plan)
    python = python or (ev.python if ev is not None and ev.python else plan.python)
    return shlex.join([*shlex.split(python), *inner])


def start_lines(plan: LaunchPlan) -> list[str]:
    """The evaluator's srun, in the background, its exit status recorded when it ends."""
    ev = evaluator_of(plan)
    if ev is None:
        return []
    log = shlex.quote(ev.log.split("%j")[0]) + '"$SLURM_JOB_ID"' + shlex.quote(ev.log.split("%j", 1)[1]) \
        if "%j" in ev.log else shlex.quote(ev.log)
    ended = '"$LMLAUNCH_RUN_DIR/' + TRAINING_ENDED + '"'
    exited = '"$LMLAUNCH_RUN_DIR/' + EVALUATOR_EXIT + '"'
    # the container's srun options only (pyxis): the site's trainer options (--gpus-per-task, --cpu-bind, ...)
    # may not fit the evaluator's shape; LMLAUNCH_TASK_ROLE names its podman container apart from rank 0's
    box = ContainerPlan.from_json(plan.container).srun_args if plan.container is not None else []
    srun = " ".join(["LMLAUNCH_TASK_ROLE=evaluator srun --het-group=1 --unbuffered --nodes=1 --ntasks=1",
                     *map(shlex.quote, box)])
    return [
        "# lmlaunch: the evaluator, the heterogeneous job's second component, scores each checkpoint as it completes "
        "(eval.alongside; lmtrain.evaluator); its srun's exit status is recorded for status (a crash, the OOM killer)",
        f"rm -f {ended} {exited}  # an earlier attempt's",
        f"mkdir -p \"$(dirname {ended})\"",
        f"( {srun} --output={log} --error={log} {evaluator_command(plan)} &",
        "  lmlaunch_p=$!",
        "  lmlaunch_how=exited  # or stopped: the job ended it (a preemption, a requeue, a cancel, finish_wait_s)",
        "  trap 'lmlaunch_how=stopped; kill -TERM \"$lmlaunch_p\" 2>/dev/null' TERM",
        '  wait "$lmlaunch_p"; lmlaunch_erc=$?',
        '  while kill -0 "$lmlaunch_p" 2>/dev/null; do wait "$lmlaunch_p"; lmlaunch_erc=$?; done',
        "  # the job stopped it unless the job still runs and is not being preempted (SLURM signals the",
        "  # tasks, not always this shell: a preemption, a cancel, a requeue, the time limit)",
        '  lmlaunch_job=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null)',
        '  case "$lmlaunch_job" in *JobState=RUNNING*) case "$lmlaunch_job" in *PreemptTime=[0-9]*) '
        "lmlaunch_how=stopped ;; esac ;; *) lmlaunch_how=stopped ;; esac",
        f'  echo "$SLURM_JOB_ID $lmlaunch_erc $(date +%s) $lmlaunch_how" > {exited}',
        '  if [ "$lmlaunch_erc" -gt 128 ]; then lmlaunch_why=" (killed by signal $((lmlaunch_erc - 128)))"; '
        'else lmlaunch_why=""; fi',
        f'  [ "$lmlaunch_erc" -eq 0 ] || [ "$lmlaunch_how" = stopped ] || echo "lmlaunch: ERROR: the evaluator\'s srun '
        f'exited $lmlaunch_erc$lmlaunch_why; the training goes on" >> {log} ) &',
        "lmlaunch_eval_pid=$!",
    ]


def finish_lines(plan: LaunchPlan) -> list[str]:
    """After the trainer's srun: say it ended, give the evaluator ``finish_wait_s`` to catch up."""
    ev = evaluator_of(plan)
    if ev is None:
        return []
    ended = '"$LMLAUNCH_RUN_DIR/' + TRAINING_ENDED + '"'
    most = ev.finish_wait_s
    return [
        f'echo "$SLURM_JOB_ID $lmlaunch_rc" > {ended}.tmp && mv -f {ended}.tmp {ended}',
        "# at most finish_wait_s, and never into the time limit (the job would end TIMEOUT, not as the training did)",
        f"lmlaunch_most={most}",
        'lmlaunch_end=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null | head -n1)  # the job\'s EndTime, or nothing',
        'case "$lmlaunch_end" in [0-9]*) lmlaunch_end=$(date -d "$lmlaunch_end" +%s 2>/dev/null || echo 0) ;; '
        "*) lmlaunch_end=0 ;; esac",
        'if [ "$lmlaunch_end" -gt 0 ] && [ $((lmlaunch_end - $(date +%s) - 30)) -lt "$lmlaunch_most" ]; then',
        "  lmlaunch_most=$((lmlaunch_end - $(date +%s) - 30))",
        "fi",
        "lmlaunch_waited=0",
        'while kill -0 "$lmlaunch_eval_pid" 2>/dev/null && [ "$lmlaunch_waited" -lt "$lmlaunch_most" ]; do '
        "sleep 1; lmlaunch_waited=$((lmlaunch_waited + 1)); done",
        'if kill -0 "$lmlaunch_eval_pid" 2>/dev/null; then',
        '  echo "lmlaunch: the evaluator has not finished $lmlaunch_waited s after the training ended '
        f'(eval.alongside.finish_wait_s: {most}, or the time limit): stopped" >&2',
        '  kill -TERM "$lmlaunch_eval_pid" 2>/dev/null',
        "fi",
        'wait "$lmlaunch_eval_pid" 2>/dev/null',
    ]


def eval_job_options(plan: LaunchPlan, ev: EvaluatorPlan, time_minutes: int) -> list[tuple[str, Any]]:
    """``lmlaunch eval RUN``'s job's sbatch options: an ordinary single-node job on the evaluator's
    resources; its log is the evaluator's."""
    s = plan.slurm
    log = ev.log or f"{plan.paths.run_dir}/logs/evaluator-%j.log"
    return [("job-name", f"{s.job_name}-eval"), ("partition", ev.partition), ("nodes", 1), ("ntasks-per-node", 1),
            ("cpus-per-task", ev.cpus_per_task), ("time", time_minutes), ("output", log), ("error", log),
            ("open-mode", "append"), ("chdir", plan.paths.run_dir), ("gres", ev.gres or None), ("mem", ev.mem or None),
            ("account", s.account or None), ("qos", s.qos or None)]


def eval_job_body(plan: LaunchPlan, ev: EvaluatorPlan, evaluator_file: str, *, steps: str | None) -> list[str]:
    """``lmlaunch eval RUN``'s job's commands: it scores the finished run's checkpoints (``--once``: what
    is there, then it ends) as the evaluator alongside would, with the run's environment."""
    extra = ["--evaluator", evaluator_file, "--once", *(["--steps", steps] if steps else [])]
    return [
        f"# lmlaunch: `lmlaunch eval {plan.run_name}`: its checkpoints scored with lm-evaluation-harness as the "
        "evaluator alongside the training scores them (lmtrain.evaluator), then the job ends",
        *plan.setup, *(export_line(name, plan.env[name]) for name in sorted(plan.env) if name != "PYTHONPATH"),
        "# this lmlaunch's evaluator, not the run's code snapshot (a run trained before it has none): it only reads",
        "# the checkpoints, in the formats every lmlaunch since reads",
        *(host_lines(ContainerPlan.from_json(plan.container), sorted(plan.env)) if plan.container is not None else []),
        f"srun --unbuffered --nodes=1 --ntasks=1 {evaluator_command(plan, *extra, python=ev.python or None)}",
    ]
