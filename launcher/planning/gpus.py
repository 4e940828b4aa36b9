"""How a job's tasks get their GPUs (pure): the binding SLURM is asked for, the accelerator the ranks
train on, and what the plan says about both.

SLURM's defaults give every task all of a node's GPUs (``--gres=gpu:N`` or ``--gpus-per-node=N``
alone); a profile's ``gpu_bind`` (sbatch ``--gpu-bind``) gives each task one of them instead, and
each rank checks at start that it got one of its own (lmtrain.distributed.gpu_binding). On a cluster
whose GPUs are simulated (the local cluster's ``cluster up --gpus``: devices without CUDA) SLURM
schedules and binds them all the same, and the ranks train on CPU behind that binding.
"""

from __future__ import annotations

from launcher.spec.profiles import Profile
from lmcore.job.plan import SlurmParams, one_gpu_a_task
from lmcore.job.spec import JobSpec


def count_problems(spec: JobSpec, profile: Profile) -> list[str]:
    """More GPUs a node than the profile's nodes have (said first, naming the profile's GPUs), or tasks
    that are not one per GPU: the caller leaves out what follows from them (the world size's batch
    arithmetic)."""
    r = spec.resources
    if r.gpus_per_node > profile.gpus_per_node:
        if profile.gpus_per_node == 0:
            return [f"resources.gpus_per_node({r.gpus_per_node}): profile '{profile.name}' has no GPUs (its "
                    "gpus_per_node is 0, a CPU cluster): gpus_per_node: 0 runs tasks_per_node tasks on CPU (gloo), "
                    "or name a GPU cluster's profile"]
        return [f"resources.gpus_per_node({r.gpus_per_node}) is above what profile '{profile.name}' nodes have: "
                f"gpus_per_node({profile.gpus_per_node})"]
    if r.gpus_per_node > 0 and r.tasks_per_node not in (None, r.gpus_per_node):
        return [f"resources.tasks_per_node({r.tasks_per_node}) must equal resources.gpus_per_node({r.gpus_per_node}): "
                "one task per GPU"]
    return []


def accelerator(profile: Profile, gpus_per_node: int) -> str:
    """What the ranks train on: a GPU job on simulated GPUs trains on CPU."""
    return "gpu" if gpus_per_node > 0 and not profile.gpus_simulated else "cpu"


def gpu_bind(profile: Profile, gpus_per_node: int) -> str | None:
    """sbatch --gpu-bind for a job of ``gpus_per_node`` (None: no GPUs, or the profile says none)."""
    if gpus_per_node == 0 or profile.gpu_bind == "none":
        return None
    return profile.gpu_bind


def notes(profile: Profile, slurm: SlurmParams) -> list[str]:
    if slurm.gpus_per_node == 0:
        return []
    bind = slurm.gpu_bind
    sim = profile.gpus_simulated
    how = (f"each task gets one GPU of its own (--gpu-bind={bind}){'' if sim else ' and uses it as cuda:0'}"
           if one_gpu_a_task(bind) else f"every task sees the node's {slurm.gpus_per_node} GPUs "
           f"(--gpu-bind={bind or 'none'}){'' if sim else ' and rank k uses the k-th'}")
    said = [f"GPUs: {slurm.gres} a node; {how}; each rank records the GPU it got and stops at start if it shares "
            "one or has none"]
    if profile.gpus_simulated:
        said.append(f"profile '{profile.name}' has simulated GPUs (gpus_simulated): SLURM schedules and binds them, "
                    "and the ranks train on CPU behind that binding (gloo)")
    return said
