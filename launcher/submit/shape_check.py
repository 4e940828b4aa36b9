"""Before a job is queued: whether the cluster can ever run it (``sbatch --test-only`` on its script).

SLURM queues a job that asks for more nodes than its partition holds, or more CPUs or GPUs on a node
than any node has, and leaves it pending for ever (``PartitionConfig``, ``Resources``). At scale that
is an easy mistake (``resources.nodes: 512`` on a partition of 256; ``tasks_per_node: 8`` x
``cpus_per_task: 16`` on 96-CPU nodes). The controller judges the job's exact script first; a shape it
says no node configuration can hold is refused with SLURM's words and the job's shape, nothing queued.
Any other answer (a busy controller, a timeout, a start in the future) leaves the decision to sbatch.

A run with an evaluator alongside is one heterogeneous job: every refusal of it names eval.alongside.
"""

from __future__ import annotations

from lmcore import rundir
from lmcore.errors import UserError
from lmcore.plan import LaunchPlan
from lmcore.slurm import client as slurm

# What SLURM says of a job no node or partition of the cluster can hold (22.05 to 26.05)
IMPOSSIBLE = ("Requested node configuration is not available", "Node count specification invalid",
              "More processors requested than permitted", "Requested partition configuration not available",
              "Invalid generic resource (gres) specification")


def refuse_rest_heterogeneous_job() -> None:
    raise UserError("eval.alongside: a heterogeneous job (trainer + evaluator) cannot be submitted through "
                    "slurmrestd yet (its job_desc list is not built); submit with sbatch (the profile's "
                    "submit.via: sbatch, without --rest), or score the checkpoints after with `lmlaunch eval`",
                    exit_code=2)


def judge(plan: LaunchPlan, text: str) -> None:
    """Raise UserError (exit 2) when the controller says the job's script can never run."""
    if plan.evaluator:
        _check_heterogeneous_job(plan, text)
        return
    if slurm.rest_client() is not None:  # through slurmrestd: its controller judges the job when it is submitted
        return
    try:
        ok, message = slurm.test_only("sbatch", [], script=text)
    except Exception:  # the controller did not answer in time: sbatch itself will say
        return
    if ok or not any(words in message for words in IMPOSSIBLE):
        return
    p = plan.slurm
    raise UserError(
        f"resources: the cluster cannot run this job as asked (sbatch --test-only: {message}): "
        f"nodes({p.nodes}) x tasks_per_node({p.ntasks_per_node}) x cpus_per_task({p.cpus_per_task})"
        f"{f', gpus_per_node({p.gpus_per_node})' if p.gpus_per_node else ''} on partition "
        f"'{plan.slurm.partition}'. `sinfo -p {plan.slurm.partition} -o '%D %c %G'` shows its nodes, their CPUs "
        "and GPUs; nothing was submitted", exit_code=2)


def _check_heterogeneous_job(plan: LaunchPlan, text: str) -> None:
    """A run with an evaluator alongside is one heterogeneous job: the controller judges it first
    (``sbatch --test-only``: an evaluator larger than its partition, a cluster that refuses
    heterogeneous jobs), and a refusal names eval.alongside with SLURM's words; nothing is queued."""
    if slurm.rest_client() is not None:
        refuse_rest_heterogeneous_job()
    code = rundir.RunLayout.of_plan(plan).code
    if code.is_dir() and not (code / "lmtrain" / "evaluator" / "main.py").is_file():
        raise UserError(f"eval.alongside: the run's code snapshot ({code}) predates the evaluator: resume with "
                        "--new-code, or score its checkpoints after with `lmlaunch eval`", exit_code=2)
    ok, message = slurm.test_only("sbatch", [], script=text)
    if not ok:
        raise UserError(f"eval.alongside: SLURM refuses the heterogeneous job (trainer + evaluator): {message}",
                        exit_code=2)
