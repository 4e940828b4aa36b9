"""The batch scripts lmlaunch submits, rendered here and nowhere else: completely, before anything
is submitted. The dry run prints this text and ``sbatch`` receives it byte for byte
(tests/unit/test_submitit_contract.py); no other module writes a line of a batch script.

- A run's job script (:func:`render_script`): submitit's layout (``#SBATCH`` header from
  :func:`executor_parameters`, setup, command, teardown, rendered by submitit's
  ``_make_sbatch_string``) with lmlaunch's parts: the header comment, the profile's setup lines,
  the planned exports (launcher.submit.shell's one quoting rule), the container's lines on the host
  (the SLURM relay, the image's identity, apptainer's variables), the restart-in-place loop around
  srun, srun's spare-node options, the task command (inside the container's wrapper where there is
  one) and the relay's teardown.
- A sweep's array script (:func:`render_array_script`): the same, each task's run directory picked
  by ``SLURM_ARRAY_TASK_ID``.
- ``data prepare --on-cluster``'s scripts (:func:`array_script`, :func:`assemble_script`): a
  throttled array of slices and its final step.
- ``lmlaunch eval``'s job (:func:`render_eval_script`) and the evaluator alongside's component of a
  run's heterogeneous job: their options and shell lines from launcher.submit.hetjob.

Every ``#SBATCH`` line lmlaunch writes itself is one option of a list of (option, value) pairs rendered
by :func:`sbatch_lines`; the run's and the sweep's headers are submitit's, from
:func:`executor_parameters`.

launcher.submit.submission submits the text (the executor's hooks); launcher.search.array and
launcher.submit.data_cluster submit theirs. Pure: no I/O but reading whether a run's code snapshot
predates lmtrain.task.main.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.submit import hetjob
from launcher.submit.container_lines import container_task_command, host_lines, stop_lines
from launcher.submit.keeper import keeper_lines
from launcher.submit.shell import export_line, shell_quote
from lmcore.job.container import ContainerPlan
from lmcore.job.plan import LaunchPlan
from lmcore.run import rundir
from lmcore.run.eval_alongside import EvaluatorPlan
from lmcore.run.run_layout import BATCH_VAR, UNDECIDED_VAR
from lmcore.run.rundir import RunLayout


# --------------------------------------------------------------------------- a run's job script
def setup_lines(plan: LaunchPlan) -> list[str]:
    """Profile setup, then every planned variable exported with its value shell-quoted.

    MASTER_PORT is not set here: lmtrain's rank 0 picks a free port on its own node at every
    attempt (see ``plan.rendezvous``)."""
    lines = [
        f"# lmlaunch: run {plan.run_name}, profile {plan.profile}; "
        f"rerun this plan with: lmlaunch submit {plan.paths.spec_yaml} --dry-run"
    ]
    lines += list(plan.setup)
    lines += [export_line(name, plan.env[name]) for name in sorted(plan.env)]
    # this run of the script (a requeue runs it again): the ranks' rendezvous key, another cluster's job of the same id apart
    lines += [f'export {BATCH_VAR}="$(date +%s%N)-$$"']
    return lines + container_lines(plan) + hetjob.start_lines(plan) + restart_loop_head(plan)


def container_lines(plan: LaunchPlan) -> list[str]:
    if plan.container is None:
        return []
    return host_lines(ContainerPlan.from_json(plan.container), sorted(plan.env))


def executor_parameters(plan: LaunchPlan, dependency: str | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (the keys of ``_make_sbatch_string``); ``dependency``:
    sbatch --dependency (``submit --after``)."""
    s = plan.slurm
    extra: dict[str, Any] = {
        "requeue": "expedite" if s.requeue_expedite else True,  # sbatch --requeue[=expedite]
        "signal": s.signal,  # no "B:": the warning goes to every task of every step
        # the tasks start in the run directory: `python -m` puts the working directory first on
        # sys.path, and a checkout there would shadow the run's code snapshot (PYTHONPATH)
        "chdir": plan.paths.run_dir,
    }
    extra.update({"gres": s.gres} if s.gres else {})
    extra.update({"gpu_bind": s.gpu_bind} if s.gpu_bind else {})
    extra.update({k.replace("-", "_"): v for k, v in s.site_options.items()})  # the site's own (lmcore.job.site_options)
    params: dict[str, Any] = {
        "job_name": s.job_name,
        "partition": s.partition,
        "time": s.time_minutes,
        "nodes": s.nodes,
        "ntasks_per_node": s.ntasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "signal_delay_s": s.warning_seconds,
        "setup": setup_lines(plan),
        "additional_parameters": extra,
        "stderr_to_stdout": False,
        "use_srun": True,
        "wckey": None,  # no accounting wckey (submitit would add "submitit")
    }
    for key in ("mem", "account", "qos", "constraint"):
        value = getattr(s, key)
        if value is not None:
            params[key] = value
    if s.exclusive:
        params["exclusive"] = True
    if s.exclude:
        params["exclude"] = s.exclude
    if dependency:
        params["dependency"] = dependency
    if s.spare_nodes:
        extra["no_kill"] = True  # a failed node leaves the allocation; the job and its batch script live on
    srun_args = [*plan.srun_args, *task_output_args(plan), *spare_srun_args(plan)]  # the spares' beside the restart's
    if srun_args:
        params["srun_args"] = srun_args
    if plan.container is not None or plan.evaluator:  # the job's exit status stays srun's (the trainer's)
        params["teardown"] = [stop_lines()[0], *hetjob.finish_lines(plan),
                              *(stop_lines()[1:-1] if plan.container is not None else []), stop_lines()[-1]]
    return params


def task_command(plan: LaunchPlan, folder: str | None = None) -> str:
    """What srun starts in each task: lmtrain.task.main (signals owned, then submitit's runner);
    submitit's own for older snapshots."""
    code = RunLayout.of_plan(plan).code
    old = code.is_dir() and not (code / "lmtrain" / "task" / "main.py").is_file()  # resumed without --new-code
    runner = ["submitit.core._submit"] if old else ["lmtrain.task.main", "--signal", plan.preemption.signal]
    inner = ["-u", "-m", *runner, folder or plan.paths.submitit_dir]
    if plan.container is not None:  # the interpreter inside the container (lmcore.job.container)
        return container_task_command(ContainerPlan.from_json(plan.container), inner)
    return " ".join(shlex.quote(x) for x in [*shlex.split(plan.python), *inner])


def submit_command(plan: LaunchPlan, folder: str | None = None) -> str:
    """The script's command after srun's options: the nodes a restart leaves out (a job with spare
    nodes), the task command, then the restart loop's tail where the job restarts in place
    (:func:`restart_loop_tail`)."""
    return restart_srun_prefix(plan) + task_command(plan, folder) + restart_loop_tail(plan)


def render_script(plan: LaunchPlan, dependency: str | None = None) -> str:
    """The sbatch script exactly as submit writes it."""
    from submitit.slurm.slurm import _make_sbatch_string

    return with_component(_make_sbatch_string(
        command=submit_command(plan), folder=plan.paths.submitit_dir, **executor_parameters(plan, dependency)
    ), plan)


# --------------------------------------------------------------------------- the #SBATCH lines lmlaunch writes itself
Options = list[tuple[str, Any]]  # (sbatch's long option, value): True a flag; None or False: left out


def sbatch_lines(options: Options) -> list[str]:
    """``#SBATCH --option=value`` for each option in order (``--option`` for True)."""
    return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={v}" for k, v in options if v is not None and v is not False]


def with_component(text: str, plan: LaunchPlan) -> str:
    """The rendered script with the evaluator's component (``hetjob``) after the last ``#SBATCH`` line."""
    ev = hetjob.evaluator_of(plan)
    if ev is None:
        return text
    lines = text.split("\n")
    last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
    component = ["#SBATCH hetjob", *sbatch_lines(hetjob.component_options(ev))]
    return "\n".join([*lines[: last + 1], *component, *lines[last + 1:]])


def render_eval_script(plan: LaunchPlan, ev: EvaluatorPlan, evaluator_file: str, *, steps: str | None, time_minutes: int) -> str:
    """``lmlaunch eval RUN``'s job: the finished run's checkpoints scored on the evaluator's resources."""
    head = sbatch_lines(hetjob.eval_job_options(plan, ev, time_minutes))
    return "\n".join(["#!/bin/bash", *head, "", *hetjob.eval_job_body(plan, ev, evaluator_file, steps=steps), ""])


# --------------------------------------------------------------------------- the restart-in-place loop and spare nodes' srun options
def restart_loop_head(plan: LaunchPlan) -> list[str]:
    """The last setup lines of a job that restarts in place: srun (the command section) runs in a
    loop, once more each time the attempt's rank 0 asked for it (lmtrain.preemption.controller:
    the decision file, written after the attempt's end line), or when srun failed and rank 0 never
    decided (its process was killed: SIGKILL, the OOM killer), at most max_crash_retries times."""
    if not plan.preemption.restart_in_place:
        return []
    return ["# lmlaunch: a crash or a hang is retried in this allocation: srun again while rank 0 asks "
            "($LMLAUNCH_RUN_DIR/" + rundir.RESTART_IN_PLACE + ": the job id, the nodes the ranks leave out, "
            "rank 0's decision), or when srun failed and rank 0 never decided",
            'rm -f "$LMLAUNCH_RUN_DIR/' + rundir.RESTART_IN_PLACE + '"  # an earlier job\'s, never this one\'s',
            "lmlaunch_restarts=0",
            "lmlaunch_undecided=0",
            "lmlaunch_exclude=",
            "lmlaunch_overlap=  # set from the first restart on (launcher.submit.script.restart_srun_prefix)",
            "# a preemption that lands between two sruns signals no task of the next: do not start one then",
            "lmlaunch_preempting() { scontrol show job \"$SLURM_JOB_ID\" 2>/dev/null | grep -q 'PreemptTime=[0-9]'; }",
            "while :; do", *keeper_lines(plan)]


def restart_loop_tail(plan: LaunchPlan) -> str:
    """What follows srun in a job that restarts in place: the loop's test and end, the job's exit
    status srun's last. Rank 0's file names this job (a file of another job is never this one's);
    its third line is the decision (``restart``, or what rank 0 did instead: ``requeue``,
    ``cancel``, ``none``; no third line: a run directory's older code, which wrote only restarts)."""
    if not plan.preemption.restart_in_place:
        return ""
    said = '"$LMLAUNCH_RUN_DIR/' + rundir.RESTART_IN_PLACE + '"'
    most = plan.preemption.max_crash_retries
    return "\n".join([
        "",
        "lmlaunch_rc=$?",
        f"lmlaunch_said=$(cat {said} 2>/dev/null); rm -f {said}",
        'lmlaunch_decision=$(printf "%s\\n" "$lmlaunch_said" | sed -n 3p)',
        f"export {UNDECIDED_VAR}=",
        'if [ -n "$SLURM_JOB_ID" ] && [ "$(printf "%s\\n" "$lmlaunch_said" | sed -n 1p)" = "$SLURM_JOB_ID" ]; then',
        '  if [ -z "$lmlaunch_decision" ] || [ "$lmlaunch_decision" = restart ]; then  # this job\'s rank 0 asked',
        '    lmlaunch_exclude=$(printf "%s\\n" "$lmlaunch_said" | sed -n 2p); lmlaunch_restarts=$((lmlaunch_restarts + 1))',
        '    echo "lmlaunch: restarting the ranks in place ($lmlaunch_restarts; srun exited $lmlaunch_rc${lmlaunch_exclude:+; '
        'not on $lmlaunch_exclude})" >&2',
        *_unless_preempting("    "),
        "    lmlaunch_overlap=1",
        "    continue",
        "  fi",
        f'elif [ -n "$SLURM_JOB_ID" ] && [ "$lmlaunch_rc" -ne 0 ] && [ "$lmlaunch_undecided" -lt {most} ]; then',
        "  # rank 0 never decided (killed before its end line): the next attempt's rank 0 records why",
        "  lmlaunch_undecided=$((lmlaunch_undecided + 1)); lmlaunch_restarts=$((lmlaunch_restarts + 1))",
        f'  export {UNDECIDED_VAR}="$lmlaunch_rc"',
        '  echo "lmlaunch: srun exited $lmlaunch_rc and rank 0 never decided (killed?): restarting the ranks in place '
        f'($lmlaunch_restarts; $lmlaunch_undecided of max_crash_retries({most}))" >&2',
        *_unless_preempting("  "),
        "  lmlaunch_overlap=1",
        "  continue",
        "fi",
        "break",
        "done",
        '(exit "$lmlaunch_rc")',
    ])


def _unless_preempting(indent: str) -> list[str]:
    """Before a restart: a job SLURM is preempting (PreemptTime set, its GraceTime running) requeues
    itself instead, as rank 0 would (SLURM 22.05 ends a preempted job whose tasks exit within
    GraceTime as COMPLETED, never requeued); the next attempt resumes from the newest checkpoint."""
    return [f"{indent}if lmlaunch_preempting; then",
            f'{indent}  echo "lmlaunch: the job is being preempted (PreemptTime set): requeueing it, not restarting '
            f'the ranks" >&2',
            f'{indent}  scontrol requeue "$SLURM_JOB_ID" || echo "lmlaunch: scontrol requeue failed" >&2',
            f"{indent}  break",
            f"{indent}fi"]


def task_output_args(plan: LaunchPlan) -> list[str]:
    """srun's output file of the tasks, one per node for their stdout and stderr, each line labelled
    with its task (submitit's srun options come first, two files per task; srun takes the last of
    each); none for a plan of before, whose tasks keep submitit's. At 2,048 nodes of 8 ranks: 2,048
    files a job, not 32,768."""
    s = plan.slurm
    if "%n" not in s.task_output or "%n" not in s.task_error:
        return []
    return [f"--output={s.task_output}", f"--error={s.task_error}", "--label"]


def spare_srun_args(plan: LaunchPlan) -> list[str]:
    """srun's options in a job with spare nodes: the ranks on ``run_nodes`` of the allocation, and
    the step (not the job) lives on when one of its nodes fails, so that rank 0 decides the restart."""
    s = plan.slurm
    if not s.spare_nodes:
        return []
    return [f"--nodes={s.run_nodes}", f"--ntasks={s.run_nodes * s.ntasks_per_node}", "--no-kill"]


def restart_srun_prefix(plan: LaunchPlan) -> str:
    """srun's last options in a job that restarts in place: from the first restart on ``--overlap``
    (a step whose node died with everything on it stays RUNNING in the controller, holding its CPUs
    on the live nodes, until that node comes back: seen on SLURM 22.05, "step creation temporarily
    disabled (Requested nodes are busy)" for ever); with spare nodes, the nodes rank 0 asked the
    restart to leave out."""
    if not plan.preemption.restart_in_place:
        return ""
    out = "${lmlaunch_overlap:+--overlap} "
    return out + ("${lmlaunch_exclude:+--exclude=$lmlaunch_exclude} " if plan.slurm.spare_nodes else "")


# --------------------------------------------------------------------------- a sweep's array script
PER_POINT_ENV = ("LMLAUNCH_RUN_DIR", "PYTHONPATH")  # what each array task sets for its own point


def _per_point_export(name: str, value: str, run_dir: str) -> str:
    """``export NAME=...`` with the first point's run directory in ``value`` made this task's."""
    parts = [shell_quote(p) if p else "" for p in value.split(run_dir)]
    return f"export {name}=" + '"$LMLAUNCH_RUN_DIR"'.join(parts)


def array_setup(plan: LaunchPlan, run_dirs: list[str]) -> list[str]:
    """A sweep array's setup: the shared environment (launcher.search.sweep.shape), then each task's run
    directory and code snapshot, picked by its SLURM_ARRAY_TASK_ID."""
    run_dir = plan.paths.run_dir
    lines = [f"# lmlaunch: sweep array of {len(run_dirs)} points, profile {plan.profile}; "
             "each task runs the point its SLURM_ARRAY_TASK_ID names"]
    lines += list(plan.setup)
    own = sorted(n for n in plan.env if n not in PER_POINT_ENV and run_dir in plan.env[n])
    lines += [export_line(n, plan.env[n]) for n in sorted(plan.env) if n not in PER_POINT_ENV and n not in own]
    lines.append("LMLAUNCH_POINTS=(" + " ".join(shell_quote(d) for d in run_dirs) + ")")
    lines.append('export LMLAUNCH_RUN_DIR="${LMLAUNCH_POINTS[$SLURM_ARRAY_TASK_ID]}"')
    code = f"$LMLAUNCH_RUN_DIR/{rundir.CODE_DIR}/{rundir.CODE_ZIP}"  # its snapshot's zip, as the planned PYTHONPATH
    lines.append(f'export PYTHONPATH="{code}${{PYTHONPATH:+:$PYTHONPATH}}"')
    lines += [_per_point_export(n, plan.env[n], run_dir) for n in own]  # e.g. the NCCL flight recorder's file
    return lines + container_lines(plan) + hetjob.start_lines(plan) + restart_loop_head(plan)


def array_parameters(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                     dependency: str | None = None) -> dict[str, Any]:
    """submitit parameters of one sweep array (``plan``: its first point; every point has its shape)."""
    params = executor_parameters(plan, dependency)
    params["job_name"] = Path(sweep_dir).name
    params["setup"] = array_setup(plan, run_dirs)
    params["additional_parameters"] = {**params["additional_parameters"], "chdir": sweep_dir}
    params["array_parallelism"] = max_parallel
    if "srun_args" in params:  # each array task's own files, as submitit names its (%A_%a for %j)
        outputs = set(task_output_args(plan)[:2])
        params["srun_args"] = [a.replace("%j", "%A_%a") if a in outputs else a for a in params["srun_args"]]
    return params


def array_plan(plan: LaunchPlan, sweep_dir: str) -> LaunchPlan:
    """The first point's plan as the whole array's: a container starts in the sweep directory, as
    the array's tasks do on the host (sbatch --chdir), not in the first point's run directory."""
    box = plan.container
    if box is None or box["workdir"] != plan.paths.run_dir:
        return plan
    old = f"--container-workdir={plan.paths.run_dir}"
    swapped = {**box, "workdir": sweep_dir,
               "srun_args": [f"--container-workdir={sweep_dir}" if a == old else a for a in box["srun_args"]],
               "prefix": [{f"--workdir={plan.paths.run_dir}": f"--workdir={sweep_dir}"}.get(a, a) for a in box["prefix"]]}
    if box["runtime"] == "apptainer":
        i = swapped["prefix"].index("--pwd")
        swapped["prefix"][i + 1] = sweep_dir
    return dataclasses.replace(plan, container=swapped,
                               srun_args=tuple(f"--container-workdir={sweep_dir}" if a == old else a
                                               for a in plan.srun_args))


def render_array_script(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                        dependency: str | None = None) -> str:
    """A sweep array's sbatch script exactly as submit_array writes it."""
    from submitit.slurm.slurm import _make_sbatch_string

    plan = array_plan(plan, sweep_dir)
    params = array_parameters(plan, run_dirs, sweep_dir, max_parallel, dependency)
    folder = str(RunLayout.of(sweep_dir).submitit)
    return _make_sbatch_string(command=submit_command(plan, folder), folder=folder, map_count=len(run_dirs), **params)


# --------------------------------------------------------------------------- data prepare --on-cluster: its array and its final step
@dataclass(frozen=True)
class ArrayJob:
    """What the sbatch scripts say: the run, the partition and limits, the interpreter."""

    name: str
    run_dir: str
    partition: str
    time: str
    cpus: int
    python: str
    account: str | None = None
    qos: str | None = None

    def header(self, *more: tuple[str, Any]) -> list[str]:
        options: Options = [("job-name", self.name), ("partition", self.partition), ("nodes", 1), ("ntasks", 1),
                            ("cpus-per-task", self.cpus), ("time", self.time), ("requeue", True),
                            ("open-mode", "append"), ("chdir", self.run_dir), ("account", self.account or None),
                            ("qos", self.qos or None), *more]
        return ["#!/bin/bash", *sbatch_lines(options)]


def array_script(job: ArrayJob, tasks: range, max_parallel: int) -> str:
    """The array of tasks ``tasks`` (its SLURM task k is task ``tasks.start + k``)."""
    lines = job.header(("array", f"0-{len(tasks) - 1}%{max_parallel}"),
                       ("output", f"{job.run_dir}/submitit/%A_%a_log.out"), ("error", f"{job.run_dir}/submitit/%A_%a_log.err"))
    task = f"$((SLURM_ARRAY_TASK_ID + {tasks.start}))" if tasks.start else "$SLURM_ARRAY_TASK_ID"
    lines += ["export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false",
              # a job step: SLURM's preemption signals (SIGTERM, then SIGKILL after GraceTime) reach the task
              f"exec srun --ntasks=1 {shell_quote(job.python)} -m lmtrain.data.prepare.array_task {shell_quote(job.run_dir)} "
              f"\"{task}\""]
    return "\n".join(lines) + "\n"


def assemble_script(job: ArrayJob) -> str:
    lines = job.header(("output", f"{job.run_dir}/submitit/%j_assemble_log.out"),
                       ("error", f"{job.run_dir}/submitit/%j_assemble_log.err"))
    lines += ["export PYTHONUNBUFFERED=1",
              f"exec {shell_quote(job.python)} -m lmtrain.data.prepare.array_task {shell_quote(job.run_dir)} --assemble"]
    return "\n".join(lines) + "\n"
