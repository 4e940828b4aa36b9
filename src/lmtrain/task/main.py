"""Every SLURM task's process: ``python -u -m lmtrain.task.main --signal NAME FOLDER``.

submitit's own runner (``python -m submitit.core._submit FOLDER``) installs its handlers for the
warning signal and SIGTERM only after it imported numpy and unpickled the task, and they stayed
until lmtrain's entry took the signals over. A signal in that window went astray: before
submitit's handlers, the default action killed the task (a time-limit warning ended the job
FAILED, never requeued); with them, the warning signal ran ``scontrol requeue`` from inside
submitit's handler with no line in the ledger (or, for a job SLURM said had timed out, ended it),
and SIGTERM was only logged, so the attempt trained on until SIGKILL.

Here lmtrain's record-only handlers (lmtrain.preemption.signals.own_signals) are the first thing the process
does; only the interpreter's own start comes before them. Then submitit's runner runs the task as
``_submit`` would (its logs, its result and error pickles: task 0's only, :func:`run_without_result`), except that for lmtrain's task
(lmtrain.task.train_task.TrainTask) it leaves the signals alone: lmtrain's entry adopts the handlers
installed here, and a signal they recorded is acted on at the first step boundary (a stop in the
ledger, a checkpoint, a requeue). Any other callable gets submitit's handlers, as under ``_submit``.

An attempt that SLURM killed while submitit was writing its result (a requeue ends the steps as
rank 0 returns, so the kill can land inside that write) leaves ``<job>_<task>_result.pkl.save_tmp``
behind, and submitit refuses to write a result where one exists: the next attempt of the same
job and task trained to the end and then failed. The stale file is removed before the task runs
(:func:`clear_stale_result`); only this task writes it, and its earlier attempt has ended.

In a run that restarts in place with ``preemption.warm_restart``, this process becomes the task's
agent (lmtrain.task.agent) once it owns the signals: it imports the frameworks and forks the
training process (:func:`train`), again for every restart in place rank 0 decides, inside the
same srun step.

Standard library only until the signals are owned; launcher.submit.submission renders this command (and
``_submit``'s for a run whose code snapshot predates this module).
"""

from __future__ import annotations

import os
import sys

# `python -m` put the working directory, the run directory on the shared filesystem, first on sys.path:
# every import of a module from outside the run's code snapshot would look there first (a stat each),
# and a file there could shadow a module. This process imports from PYTHONPATH (the snapshot's zip) and
# its environment; the processes it starts get the directory back (their own sys.path).
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

import threading
import time
from pathlib import Path
from typing import Any

from lmtrain.preemption.signals import own_signals, release_early_signals
from lmtrain.task.agent import OWNER_ENV, TaskAgent, owner_alive, settings_here

USAGE = "usage: python -m lmtrain.task.main [--signal NAME] FOLDER"


def _args(argv: list[str]) -> tuple[str, str]:
    signal_name, rest = "USR2", list(argv)
    if rest[:1] == ["--signal"]:
        if len(rest) < 2:
            raise SystemExit(USAGE)
        signal_name, rest = rest[1], rest[2:]
    if len(rest) != 1 or rest[0].startswith("-"):
        raise SystemExit(USAGE)
    return signal_name, rest[0]


def clear_stale_result(folder: str) -> Path | None:
    """Remove this task's half-written result from an earlier attempt; the path removed, if any."""
    from submitit.core import job_environment

    os.environ["SUBMITIT_FOLDER"] = folder  # as submission.process_job sets it, for the paths
    result = job_environment.JobEnvironment().paths.result_pickle
    stale = result.with_suffix(result.suffix + ".save_tmp")
    try:
        stale.unlink()
    except FileNotFoundError:
        return None
    print(f"lmtrain: removed {stale}, a result an earlier attempt did not finish writing", file=sys.stderr)
    return stale


OWNER_POLL_S = 1.0


def watch_owner(environ: Any = None, *, poll_s: float = OWNER_POLL_S) -> threading.Thread | None:
    """In a podman container: end this process when the SLURM task that started the container is
    gone. SLURM kills a step's processes, not a container podman's conmon keeps running (seen on the
    local cluster: a SIGKILLed step left its container training), so a rank that outlived its job
    would go on writing into the run directory. The container shares the host's pids (--pid=host)."""
    env = os.environ if environ is None else environ
    raw = env.get(OWNER_ENV, "")
    if not raw.isdigit():
        return None
    owner = int(raw)

    def watch() -> None:
        while True:
            if not owner_alive(env):
                print(f"lmtrain: the SLURM task that started this container (pid {owner}) is gone: this rank "
                      "ends with it", file=sys.stderr, flush=True)
                os._exit(137)
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="lmtrain-task-owner", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    signal_name, folder = _args(sys.argv[1:] if argv is None else argv)
    owner = own_signals({"signal": signal_name})
    settings = settings_here()
    if settings is not None:
        TaskAgent(settings, owner).serve()  # returns in the training process it forks (lmtrain.task.agent)
    train(folder)


def train(folder: str) -> None:
    """The training process's body: submitit's runner on lmtrain's task, with lmtrain's signals."""
    watch_owner()
    from lmtrain import faults

    faults.point("startup.owned")  # the fault seam: a test holds the task here, before submitit's runner

    from submitit.core import job_environment, submission

    from lmtrain.task.train_task import TrainTask

    submitits = job_environment.JobEnvironment._handle_signals

    def handle_signals(env: Any, paths: Any, delayed: Any) -> None:
        if isinstance(delayed.function, TrainTask):
            return  # lmtrain's handlers, installed above, stay
        release_early_signals()
        submitits(env, paths, delayed)

    job_environment.JobEnvironment._handle_signals = handle_signals  # type: ignore[method-assign]
    if task_rank() == 0:
        clear_stale_result(folder)
        submission.process_job(folder)
    else:
        run_without_result(folder)


def task_rank() -> int:
    """This task's rank in the job, as submitit's JobEnvironment reads it (SLURM_PROCID here)."""
    from submitit.core import job_environment

    return int(job_environment.JobEnvironment().global_rank)


SUBMITTED_WAIT_S = 60  # as submitit's process_job waits for the pickled task to appear


def run_without_result(folder: str) -> None:
    """submitit's runner (``submission.process_job``) for a task other than the job's first: the same
    load, signals and call, but no result or error pickle. lmlaunch reads none of them (a run's
    outcome is its ledger and markers); task 0's stays, as submitit writes it, for its stale-file
    care above and a reader of submitit's folder. The others' were a file per rank per job: 16,384
    at 16,384 ranks (docs/scale.md). A failure still raises, its traceback on the task's stderr."""
    from submitit.core import job_environment, utils
    from submitit.core.logger import get_logger

    os.environ["SUBMITIT_FOLDER"] = folder
    env = job_environment.JobEnvironment()
    paths = env.paths
    get_logger().info(f"Starting with {env} (no result pickle: not the job's first task)")
    deadline = time.monotonic() + SUBMITTED_WAIT_S
    while not paths.submitted_pickle.exists() and time.monotonic() < deadline:
        time.sleep(1)
    if not paths.submitted_pickle.exists():
        raise RuntimeError(f"Waited for {SUBMITTED_WAIT_S} seconds but could not find submitted jobs in path:\n"
                           f"{paths.submitted_pickle}")
    delayed = utils.DelayedSubmission.load(paths.submitted_pickle)
    env._handle_signals(paths, delayed)
    delayed.result()


if __name__ == "__main__":
    main()
