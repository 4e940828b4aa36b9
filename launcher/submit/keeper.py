"""The batch script's lines that start the job's keeper (lmtrain.task.keeper) in a job with spare nodes.

With ``sbatch --no-kill`` (spare nodes) SLURM ends the job FAILED, never requeued, when the batch
script's own node fails, and rank 0 is gone with it; the keeper, one small step on another node,
requeues the job then. It is started at the top of the restart loop, again whenever it is not
running (its node failed and the ranks restart in place without it), never on the batch script's
node nor on a node the ranks left out, and only once the ranks' step runs: ``--overlap`` lets it
share the CPUs, memory and GPUs that step holds, but a step without it (the ranks' first) does not
share with a step already there, so a keeper started first moved the ranks off their nodes (seen
on a GPU job: the ranks on n1 and n3, the spare n2). A job in a container has none (its interpreter is the
container's; the keeper would run on the host's): docs/preemption.md says so.
"""

from __future__ import annotations

import shlex

from lmcore.job.plan import LaunchPlan

KEEPER_STEP = "lmlaunch-keeper"  # the keeper's step name (squeue -s): not the ranks' step


def keeper_lines(plan: LaunchPlan) -> list[str]:
    """Lines inside the restart loop, before the ranks' srun; none without spare nodes."""
    if not plan.slurm.spare_nodes or plan.container is not None or not plan.preemption.restart_in_place:
        return []
    log = shlex.quote(f"{plan.paths.submitit_dir}/") + '"$SLURM_JOB_ID"_keeper.log'  # opened by the keeper itself
    command = " ".join(shlex.quote(x) for x in [*shlex.split(plan.python), "-m", "lmtrain.task.keeper"])
    return [
        "# lmlaunch: the job's keeper, on another node: SLURM ends a job with spare nodes (--no-kill) FAILED, never "
        "requeued, when this script's node fails; the keeper requeues it then (lmtrain.task.keeper). It starts once "
        "the ranks' step runs: a step started before would hold the CPUs of a node the ranks' step needs",
        'if [ -z "$lmlaunch_keeper" ] || ! kill -0 "$lmlaunch_keeper" 2>/dev/null; then',
        "  (for _ in $(seq 600); do",
        f'     squeue -h -s -j "$SLURM_JOB_ID" -o %j 2>/dev/null | grep -qvx -e {KEEPER_STEP} -e batch -e extern && break',
        "     sleep 1; done",
        f'   srun --overlap --job-name={KEEPER_STEP} --nodes=1 --ntasks=1 '
        '--exclude="$SLURMD_NODENAME${lmlaunch_exclude:+,$lmlaunch_exclude}" '
        f'--kill-on-bad-exit=0 --quiet {command} "$LMLAUNCH_RUN_DIR" {log}) < /dev/null &',
        "  lmlaunch_keeper=$!",
        "fi",
    ]
