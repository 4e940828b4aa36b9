"""The batch jobs lmlaunch submits, rendered here and nowhere else: completely, before anything
is submitted. Each is a :class:`lmcore.slurm.batch_job.BatchJob`: the script's text, which the dry
run prints and ``sbatch`` receives byte for byte (tests/unit/test_submitit_contract.py), and its
``#SBATCH`` options, from which the text's header is written and which slurmrestd receives as the
job's fields. No other module writes a line of a batch script, and nothing reads one back.

- A run's job (:func:`render_job`): submitit's layout (:func:`sbatch_script`: the header from
  :func:`executor_parameters` as submitit orders it, setup, command, teardown; submitit's runner
  finds its files by it) with lmlaunch's parts: the header comment, the profile's setup lines,
  the planned exports (launcher.submit.shell's one quoting rule), the container's lines on the host
  (the SLURM relay, the image's identity, apptainer's variables), the restart-in-place loop around
  srun (launcher.submit.restart_loop), srun's spare-node options, the task command (inside the
  container's wrapper where there is one) and the relay's teardown.
- A sweep's array (:func:`render_array_job`): the same, each task's run directory picked by
  ``SLURM_ARRAY_TASK_ID``.
- ``data prepare --on-cluster``'s jobs (:func:`array_script`, :func:`assemble_script`): a
  throttled array of slices and its final step.
- ``lmlaunch eval``'s job (:func:`render_eval_job`) and the evaluator alongside's component of a
  run's heterogeneous job: their options and shell lines from launcher.submit.hetjob.

Every ``#SBATCH`` line is one option of a list of (option, value) pairs rendered by
:func:`sbatch_lines`.

launcher.submit.submission submits the jobs (the executor's hooks and submit_script); launcher.search.array
and launcher.submit.data_cluster submit theirs through it. Pure: no I/O but reading whether a run's code
snapshot predates lmtrain.task.main.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.submit import hetjob
from launcher.submit.container_lines import container_task_command, host_lines, stop_lines
from launcher.submit.restart_loop import restart_loop_head, restart_loop_tail
from launcher.submit.shell import export_line, shell_quote
from lmcore.job.container import ContainerPlan
from lmcore.job.plan import LaunchPlan
from lmcore.run import rundir
from lmcore.run.eval_alongside import EvaluatorPlan
from lmcore.run.run_layout import BATCH_VAR
from lmcore.run.rundir import RunLayout
from lmcore.slurm import client as slurm
from lmcore.slurm.batch_job import BatchJob, options_of


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


def render_job(plan: LaunchPlan, dependency: str | None = None) -> BatchJob:
    """The run's batch job exactly as submit sends it (with the evaluator's component, if any)."""
    return with_component(sbatch_script(submit_command(plan), plan.paths.submitit_dir,
                                         **executor_parameters(plan, dependency)), plan)


def render_script(plan: LaunchPlan, dependency: str | None = None) -> str:
    """The sbatch script exactly as submit writes it."""
    return render_job(plan, dependency).text


# --------------------------------------------------------------------------- the #SBATCH lines
Options = list[tuple[str, Any]]  # (sbatch's long option, value): True a flag; None or False: left out
# submitit's defaults for the executor parameters that are options (submitit.slurm.slurm._make_sbatch_string)
SUBMITIT_DEFAULTS = {"job_name": "submitit", "time": 5, "nodes": 1, "wckey": "submitit"}
# submitit's parameters that are not sbatch options
NOT_OPTIONS = frozenset({"setup", "teardown", "signal_delay_s", "stderr_to_stdout", "srun_args", "use_srun",
                         "map_count", "array_parallelism", "additional_parameters"})


def sbatch_lines(options: Options) -> list[str]:
    """``#SBATCH --option=value`` for each option in order (``--option`` for True); a value shell-quoted
    where it needs it, as sbatch reads it back."""
    return [f"#SBATCH --{k}" if v == "" else f"#SBATCH --{k}={shlex.quote(v)}" for k, v in options_of(options)]


def submitit_options(folder: str, params: dict[str, Any]) -> Options:
    """The header of a submitit job's script, from the executor's parameters, in submitit's order
    (its keys sorted): the options given, the warning signal, the log files submitit's runner
    writes (``%A_%a`` for an array of ``map_count``), then ``additional_parameters`` over them."""
    p = {**SUBMITIT_DEFAULTS, **params}
    header = {k: v for k, v in p.items() if v is not None and k not in NOT_OPTIONS}
    header["signal"] = f"USR2@{p.get('signal_delay_s', 90)}"
    logs = _log_stem(folder, p, "0")
    if p.get("map_count") is not None:
        header["array"] = f"0-{p['map_count'] - 1}%{min(p['map_count'], p.get('array_parallelism', 256))}"
    header["output"] = f"{logs}.out"
    if not p.get("stderr_to_stdout"):
        header["error"] = f"{logs}.err"
    header["open-mode"] = "append"
    header.update(p.get("additional_parameters") or {})
    return [(k.replace("_", "-"), header[k]) for k in sorted(header)]


def _log_stem(folder: str, params: dict[str, Any], task: str) -> str:
    """submitit's log files without their suffix: ``FOLDER/%j_TASK_log`` (``%A_%a`` for an array)."""
    job = "%A_%a" if params.get("map_count") is not None else "%j"
    return str(Path(folder).expanduser().absolute() / f"{job}_{task}_log")


def sbatch_script(command: str, folder: str, **params: Any) -> BatchJob:
    """A submitit job's batch script in submitit's layout (its header, setup, srun line and teardown:
    submitit's runner finds its files by it; tests/unit/test_submitit_contract.py compares it with
    submitit's own ``_make_sbatch_string``), its header kept as the job's options."""
    options = submitit_options(folder, params)
    lines = ["#!/bin/bash", "", "# Parameters", *sbatch_lines(options)]
    if params.get("setup") is not None:
        lines += ["", "# setup", *params["setup"]]
    if params.get("use_srun", True):
        logs = _log_stem(folder, params, "%t")
        errors = [] if params.get("stderr_to_stdout") else ["--error", f"{logs}.err"]
        srun = slurm.srun_command(["--unbuffered", "--output", f"{logs}.out", *errors, *(params.get("srun_args") or [])], [])
        command = " ".join((" ".join(shlex.quote(a) for a in srun), command))
    lines += ["", "# command", "export SUBMITIT_EXECUTOR=slurm", command, ""]
    if params.get("teardown") is not None:
        lines += ["", "# teardown", *params["teardown"]]
    return BatchJob("\n".join(lines), options_of(options))


def with_component(job: BatchJob, plan: LaunchPlan) -> BatchJob:
    """The rendered job with the evaluator's component (``hetjob``) after its last ``#SBATCH`` line."""
    ev = hetjob.evaluator_of(plan)
    if ev is None:
        return job
    lines = job.text.split("\n")
    last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
    component = ["#SBATCH hetjob", *sbatch_lines(hetjob.component_options(ev))]
    return BatchJob("\n".join([*lines[: last + 1], *component, *lines[last + 1:]]), job.options, heterogeneous=True)


def render_eval_job(plan: LaunchPlan, ev: EvaluatorPlan, evaluator_file: str, *, steps: str | None,
                    time_minutes: int) -> BatchJob:
    """``lmlaunch eval RUN``'s job: the finished run's checkpoints scored on the evaluator's resources."""
    options = hetjob.eval_job_options(plan, ev, time_minutes)
    body = hetjob.eval_job_body(plan, ev, evaluator_file, steps=steps)
    return BatchJob("\n".join(["#!/bin/bash", *sbatch_lines(options), "", *body, ""]), options_of(options))


# --------------------------------------------------------------------------- the restart-in-place loop and spare nodes' srun options
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


def render_array_job(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                     dependency: str | None = None) -> BatchJob:
    """A sweep array's batch job exactly as submit_array sends it."""
    plan = array_plan(plan, sweep_dir)
    params = array_parameters(plan, run_dirs, sweep_dir, max_parallel, dependency)
    folder = str(RunLayout.of(sweep_dir).submitit)
    return sbatch_script(submit_command(plan, folder), folder, map_count=len(run_dirs), **params)


def render_array_script(plan: LaunchPlan, run_dirs: list[str], sweep_dir: str, max_parallel: int,
                        dependency: str | None = None) -> str:
    """A sweep array's sbatch script exactly as submit_array writes it."""
    return render_array_job(plan, run_dirs, sweep_dir, max_parallel, dependency).text


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

    def options(self, *more: tuple[str, Any]) -> Options:
        return [("job-name", self.name), ("partition", self.partition), ("nodes", 1), ("ntasks", 1),
                ("cpus-per-task", self.cpus), ("time", self.time), ("requeue", True), ("open-mode", "append"),
                ("chdir", self.run_dir), ("account", self.account or None), ("qos", self.qos or None), *more]

    def script(self, options: Options, body: list[str]) -> BatchJob:
        return BatchJob("\n".join(["#!/bin/bash", *sbatch_lines(options), *body]) + "\n", options_of(options))


def array_script(job: ArrayJob, tasks: range, max_parallel: int) -> BatchJob:
    """The array of tasks ``tasks`` (its SLURM task k is task ``tasks.start + k``)."""
    options = job.options(("array", f"0-{len(tasks) - 1}%{max_parallel}"),
                          ("output", f"{job.run_dir}/submitit/%A_%a_log.out"),
                          ("error", f"{job.run_dir}/submitit/%A_%a_log.err"))
    task = f"$((SLURM_ARRAY_TASK_ID + {tasks.start}))" if tasks.start else "$SLURM_ARRAY_TASK_ID"
    return job.script(options, [
        "export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false",
        # a job step: SLURM's preemption signals (SIGTERM, then SIGKILL after GraceTime) reach the task
        f"exec srun --ntasks=1 {shell_quote(job.python)} -m lmtrain.data.prepare.array_task {shell_quote(job.run_dir)} "
        f"\"{task}\""])


def assemble_script(job: ArrayJob) -> BatchJob:
    options = job.options(("output", f"{job.run_dir}/submitit/%j_assemble_log.out"),
                          ("error", f"{job.run_dir}/submitit/%j_assemble_log.err"))
    return job.script(options, [
        "export PYTHONUNBUFFERED=1",
        f"exec {shell_quote(job.python)} -m lmtrain.data.prepare.array_task {shell_quote(job.run_dir)} --assemble"])
