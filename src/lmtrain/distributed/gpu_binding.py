"""The GPUs SLURM gave each task, and the node check that every rank has one of its own (torch-free).

Which GPUs a task has is read from ``SLURM_STEP_GPUS`` (slurmd's own numbers: the GPU's index on
the node), else ``CUDA_VISIBLE_DEVICES`` (the same numbers where the cluster has no device cgroups;
with them, CUDA renumbers a task's GPUs from 0, so two tasks would both say 0); never
``SLURM_JOB_GPUS``, which srun copies from the batch node into every task of every node. How many
CUDA shows it is ``CUDA_VISIBLE_DEVICES``'s count. Under a binding of one GPU a task
(``--gpu-bind=per_task:1``, ``single:1``, ``map_gpu:...``) a rank has exactly one and uses it as
``cuda:0``; under ``closest`` or none it has the node's GPUs of the job and uses the one at its local
rank. Each rank records what it has and the GPU it uses (lmcore.run.task_records); the first rank of
each node checks the node's records before the ranks meet (lmtrain.health.preflight): a rank
without a GPU, with several where one was bound, or sharing one with another rank fails the
attempt there with the ranks named, rather than in NCCL ("Duplicate GPU detected") or CUDA
("invalid device ordinal"). The network's HCA of each GPU goes by the same index
(:func:`lmtrain.distributed.task_env.apply_rank_env`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lmcore.job.plan import one_gpu_a_task


def _listed(environ: Mapping[str, str], *names: str) -> tuple[str, ...]:
    for name in names:
        raw = environ.get(name)
        if raw is not None and raw.strip() not in ("", "NoDevFiles"):
            return tuple(g.strip() for g in raw.split(",") if g.strip())
    return ()


def gpus_seen(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs this task has, by their index on the node: SLURM_STEP_GPUS, else
    CUDA_VISIBLE_DEVICES (empty: none)."""
    return _listed(environ, "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES")


def binding(launcher: str, bind: str | None) -> str | None:
    """The GPU binding a task is under: the profile's under SLURM; none in a local run (`lmlaunch run
    --local`, the benches), where nothing binds a GPU to a task and each rank takes its local rank's."""
    return None if launcher == "local" else bind


def gpus_of_task(environ: Mapping[str, str], launcher: str, gpus_per_node: int) -> tuple[str, ...]:
    """:func:`gpus_seen`; in a local run where no variable lists them, every GPU of the node (no SLURM
    hides any)."""
    seen = gpus_seen(environ)
    if seen or launcher != "local":
        return seen
    return tuple(str(i) for i in range(gpus_per_node))


def cuda_visible(environ: Mapping[str, str]) -> tuple[str, ...]:
    """What CUDA will show this task (CUDA_VISIBLE_DEVICES; empty: unset, every GPU of the node)."""
    return _listed(environ, "CUDA_VISIBLE_DEVICES")


def gpu_used(seen: tuple[str, ...], local_rank: int, bind: str | None) -> str | None:
    """The GPU this rank trains on (its node's index, as SLURM numbers them), None when it has none
    it can tell: one-a-task binding and not exactly one seen, or fewer seen than its local rank."""
    if one_gpu_a_task(bind):
        return seen[0] if len(seen) == 1 else None
    return seen[local_rank] if 0 <= local_rank < len(seen) else None


def cuda_index(visible: tuple[str, ...], local_rank: int) -> int:
    """The rank's device as CUDA numbers the ones it sees (``visible``: :func:`cuda_visible`): 0 when it
    sees one (bound to it), else its local rank."""
    return 0 if len(visible) == 1 else local_rank


def node_problems(records: Iterable[Any], *, bind: str | None, gpus_per_node: int) -> list[str]:
    """What is wrong with the GPUs of one node's ranks (TaskRecord-like: rank, local_rank, gpus, gpu)."""
    how = f"--gpu-bind={bind}" if bind else "no --gpu-bind (every task sees the node's GPUs)"
    problems: list[str] = []
    users: dict[str, list[Any]] = {}
    for rec in sorted(records, key=lambda r: r.rank):
        seen = rec.gpus or "none"
        if rec.gpu is None:
            want = "exactly one" if one_gpu_a_task(bind) else f"{gpus_per_node}, one per local rank"
            problems.append(f"rank {rec.rank} (local rank {rec.local_rank}) sees GPUs {seen}, not {want} under {how}")
            continue
        users.setdefault(rec.gpu, []).append(rec)
    for gpu, recs in sorted(users.items()):
        if len(recs) > 1:
            ranks = ", ".join(f"{r.rank} (local rank {r.local_rank})" for r in recs)
            problems.append(f"ranks {ranks} share GPU {gpu} under {how}: each rank needs one of its own (the "
                            "profile's gpu_bind, and a gres.conf that lists each GPU once)")
    return problems
