"""Spare nodes (``resources.spare_nodes``), as submit plans them: the nodes a job asks for with
the arithmetic, and what submit refuses before queueing. The batch script's restart-in-place loop
and srun's spare-node options are rendered by launcher.submit.script (the one renderer);
lmtrain.preemption.spares decides which nodes a restart leaves out."""

from __future__ import annotations

from lmcore.errors import UserError
from lmcore.job.plan import LaunchPlan
from lmcore.slurm import client as slurm


def asked_nodes(plan: LaunchPlan) -> str:
    """The nodes a job asks SLURM for, with the arithmetic where it keeps spares."""
    s = plan.slurm
    if not s.spare_nodes:
        return f"{s.nodes} nodes"
    return f"resources.nodes({s.run_nodes}) + resources.spare_nodes({s.spare_nodes}) = {s.nodes} nodes"


def spare_problems(plan: LaunchPlan) -> list[str]:
    """What ``submit`` refuses before queueing a job with spare nodes: an allocation larger than its
    partition (SLURM would take it and leave it pending for ever, or refuse it without the arithmetic)."""
    if not plan.slurm.spare_nodes:
        return []
    try:
        part = slurm.partition_config(plan.slurm.partition)
    except UserError:
        return []  # doctor says why SLURM cannot be asked; the submission will say it too
    total = (part or {}).get("TotalNodes", "")
    if total.isdigit() and plan.slurm.nodes > int(total):
        return [f"resources.spare_nodes: the job asks for {asked_nodes(plan)}, and partition "
                f"'{plan.slurm.partition}' holds {total} (scontrol show partition: TotalNodes={total}); "
                f"lower resources.spare_nodes to at most {max(int(total) - plan.slurm.run_nodes, 0)}"]
    return []
