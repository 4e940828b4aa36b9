"""The plan: everything the cluster will see, as typed records (``launcher.planning.planner`` makes it
from a spec and a profile, without any I/O).

The plan is the seam of the product: ``--dry-run`` prints it, ``submit`` hands it to
submitit, and each task reads it back from the run directory (``plan.json``), through
:meth:`LaunchPlan.from_dict`, which reads older plan versions too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmcore.job.parallelism import Parallelism
from lmcore.job.spec import JobSpec, PreemptionSpec

# 2: `trainer` is exactly the Trainer's keyword arguments (TrainerPlan); `training` holds the rest.
# 3: how the model is split is one record, `topology.parallelism` (was training.strategy and
#    topology.tensor_parallel_size / sequence_parallel).
PLAN_VERSION = 3
READABLE_PLAN_VERSIONS = (1, 2, 3)  # a requeued attempt reads the plan.json its submission wrote
TASK_TARGET = "lmtrain.task.train_task:TrainTask"


class PlanVersionError(ValueError):
    """plan.json was written by an lmlaunch whose plan this one cannot read."""


@dataclass(frozen=True)
class EnvOverride:
    """A profile variable the job replaced."""

    name: str
    profile_value: str
    job_value: str


@dataclass(frozen=True)
class TrainerPlan:
    """Exactly the keyword arguments lmtrain builds ``lightning.Trainer`` with; the dry run
    prints them. Only what exists on the allocation is added there: the strategy object (from
    :class:`TrainingPlan`), loggers, callbacks and ``enable_model_summary`` (rank 0 only). When
    the data turns out to have no validation split, the run uses :meth:`without_validation`."""

    accelerator: str
    devices: int
    num_nodes: int
    precision: str
    max_steps: int
    accumulate_grad_batches: int
    val_check_interval: int | None  # in batches (steps x accumulation); None: no validation
    limit_val_batches: int
    log_every_n_steps: int
    default_root_dir: str
    max_epochs: int = -1
    check_val_every_n_epoch: int | None = None  # validation by step count, not by epoch
    num_sanity_val_steps: int = 0
    gradient_clip_val: float | None = None  # the module clips (lmtrain.model.module: with every strategy alike)
    use_distributed_sampler: bool = False  # lmtrain's resumable sampler shards the data
    enable_checkpointing: bool = False  # lmtrain owns checkpoints (atomic, complete-marked)
    enable_progress_bar: bool = False  # a progress bar would sync the host every step

    def kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def val_every_n_steps(self) -> int | None:
        if self.val_check_interval is None:
            return None
        return self.val_check_interval // self.accumulate_grad_batches

    def without_validation(self) -> TrainerPlan:
        return dataclasses.replace(self, val_check_interval=None, limit_val_batches=0)


@dataclass(frozen=True)
class TrainingPlan:
    """What the allocation builds besides the Trainer's arguments."""

    process_group_backend: str  # nccl on GPUs, gloo on CPU processes
    seed: int
    gradient_clip_val: float | None  # applied by the module (TrainerPlan.gradient_clip_val is None)


@dataclass(frozen=True)
class PreemptionPlan:
    """spec.preemption, and what the profile says about the cluster's preemption."""

    signal: str  # the warning signal: USR1, USR2, URG, XCPU or HUP
    warning_seconds: int
    max_requeues: int
    max_timeouts: int
    max_crash_retries: int
    no_progress_attempts: int
    cluster_sends_user_signal: bool  # SlurmctldParameters=preempt_send_user_signal
    grace_seconds: int | None  # the partition's GraceTime, when the profile knows it
    agree_every_n_steps: int = 1  # stop agreement every K step boundaries (plans before it: 1)
    restart_in_place: bool = False  # a crash retried inside the allocation (plans before it: requeued)
    warm_restart: bool = False  # restarts in place forked by each task's agent (plans before it: a new srun each)

    @classmethod
    def of(cls, spec: PreemptionSpec, *, cluster_sends_user_signal: bool = False,
           grace_seconds: int | None = None) -> PreemptionPlan:
        """The spec's settings (their defaults live in :class:`lmcore.job.spec.PreemptionSpec`
        only) and what the profile says about the cluster."""
        return cls(**spec.model_dump(), cluster_sends_user_signal=cluster_sends_user_signal,
                   grace_seconds=grace_seconds)


@dataclass(frozen=True)
class Topology:
    nodes: int
    tasks_per_node: int
    world_size: int
    accelerator: str  # "gpu" | "cpu"
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    parallelism: Parallelism  # how the model is split over the world (lmcore.job.parallelism)

    @property
    def data_parallel_size(self) -> int:
        """Model replicas: ranks that read different samples (tensor-parallel ranks read the same)."""
        return self.parallelism.data_parallel_size

    def batch_arithmetic(self) -> str:
        """How the global batch is made, with the device mesh when the model is split."""
        par = self.parallelism
        if (par.tensor, par.pipeline) == (1, 1):
            return (f"micro_batch({self.micro_batch_size}) x accumulation({self.grad_accum}) x "
                    f"world_size({self.world_size}) = global_batch({self.global_batch_size})")
        sp = ", sequence parallel" if par.sequence_parallel else ""
        dims = [f"data_parallel({par.data_parallel_size})"]
        dims += [f"tensor_parallel({par.tensor}{sp}, inside each node)"] if par.tensor > 1 else []
        dims += [f"pipeline_parallel({par.pipeline})"] if par.pipeline > 1 else []
        steps = f"microbatches({par.microbatches})" if par.pipeline > 1 else f"accumulation({self.grad_accum})"
        return (f"mesh: {' x '.join(dims)} = world_size({self.world_size}); "
                f"micro_batch({self.micro_batch_size}) x {steps} x "
                f"data_parallel({self.data_parallel_size}) = global_batch({self.global_batch_size})")

    def to_json(self) -> dict[str, Any]:
        """As JSON: the fields, the mesh as lmcore.job.parallelism writes it, and the data-parallel size."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "parallelism"}
        return {**d, "parallelism": self.parallelism.to_json(), "data_parallel_size": self.data_parallel_size}

    def arithmetic(self) -> str:
        return (f"nodes({self.nodes}) x tasks_per_node({self.tasks_per_node}) = world_size({self.world_size}); "
                f"{self.batch_arithmetic()}")


# sbatch --gpu-bind values under which each task sees exactly one GPU (else all of its node's of the job)
ONE_GPU_A_TASK = ("per_task:", "single:", "map_gpu:")


def one_gpu_a_task(bind: str | None) -> bool:
    return bind is not None and bind.startswith(ONE_GPU_A_TASK)


# the sbatch --gpu-bind values a profile may name: each gives every task one GPU, or every task all of them
GPU_BIND = re.compile(r"per_task:1|single:1|closest|none|map_gpu:\d+(?:,\d+)*")


def gpu_bind_problem(bind: str, gpus_per_node: int) -> str | None:
    """What is wrong with a profile's ``gpu_bind`` for nodes of ``gpus_per_node`` GPUs (None: nothing)."""
    if not GPU_BIND.fullmatch(bind):
        return (f"gpu_bind {bind[:60]!r} is not one lmlaunch renders; allowed: per_task:1, single:1, map_gpu:I,J,... "
                "(one GPU a task), closest or none (every task sees the node's GPUs)")
    mapped = bind.removeprefix("map_gpu:").split(",") if bind.startswith("map_gpu:") else []
    if mapped and (len(mapped) != gpus_per_node or len(set(mapped)) != len(mapped)):
        return (f"gpu_bind {bind}: map_gpu names each of the {gpus_per_node} GPUs of a node once, in the order of the "
                "node's tasks")
    return None


@dataclass(frozen=True)
class SlurmParams:
    """The sbatch parameters, one source for the script and for submitit."""

    job_name: str
    partition: str
    nodes: int
    ntasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int  # 0: no GRES
    gres: str | None
    mem: str | None
    time_minutes: int
    time: str
    account: str | None
    qos: str | None
    constraint: str | None
    exclusive: bool
    signal: str  # e.g. "USR2@120": to every task of every step (no B:)
    signal_name: str
    warning_seconds: int
    requeue: bool
    open_mode: str
    output: str  # the batch shell's stdout (#SBATCH --output), as submitit writes it
    error: str  # the batch shell's stderr (#SBATCH --error)
    task_output: str = ""  # the tasks' stdout (srun --output): a file per node (%n), each line "R: " (srun --label)
    task_error: str = ""  # the tasks' stderr (srun --error): the same file as their stdout
    exclude: str | None = None  # sbatch --exclude: nodes `doctor --on-nodes --exclude-bad` found bad (plan notes say why)
    site_options: dict[str, str | bool] = field(default_factory=dict)  # the profile's and the spec's slurm.sbatch (true: a flag)
    spare_nodes: int = 0  # of ``nodes`` (sbatch --nodes): allocated, kept idle, swapped in for a failed node
    requeue_expedite: bool = False  # sbatch --requeue=expedite (the profile's expedited_requeue)
    gpu_bind: str | None = None  # sbatch --gpu-bind (the profile's gpu_bind; launcher.planning.gpus); None: SLURM's default

    @property
    def run_nodes(self) -> int:
        """The nodes the ranks run on (srun --nodes): the allocation less its spares."""
        return self.nodes - self.spare_nodes


@dataclass(frozen=True)
class RunPaths:
    run_dir: str
    submitit_dir: str
    logs_dir: str
    checkpoint_dir: str
    heartbeat: str
    ledger: str
    plan_json: str
    spec_yaml: str
    deepspeed_json: str | None
    checkpoint_store: str | None = None  # s3://BUCKET/PREFIX: complete checkpoints also kept there (lmcore.objects)
    checkpoint_store_credentials: str | None = None  # the profile's object_store_credentials (a path, never the keys)


@dataclass(frozen=True)
class LaunchPlan:
    version: int
    run_name: str
    profile: str
    topology: Topology
    slurm: SlurmParams
    env: dict[str, str]
    env_reasons: dict[str, str]
    env_overrides: tuple[EnvOverride, ...]
    passthrough: tuple[str, ...]
    setup: tuple[str, ...]
    python: str
    srun_args: tuple[str, ...]
    deepspeed: dict[str, Any] | None
    trainer: TrainerPlan
    training: TrainingPlan
    task: dict[str, Any]
    paths: RunPaths
    preemption: PreemptionPlan
    spec: dict[str, Any]  # the validated job spec as JSON (job_spec() gives it typed)
    notes: tuple[str, ...] = field(default_factory=tuple)
    rendezvous: dict[str, str] = field(default_factory=dict)
    """How MASTER_PORT is chosen: a shell command run on the batch host at every start."""
    memory: dict[str, Any] | None = None
    """One rank's planned memory (launcher.planning.memory.Breakdown.to_json); None where it was not estimated."""
    container: dict[str, Any] | None = None
    """The container the tasks run in (lmcore.job.container.ContainerPlan.to_json); None: on the host."""
    placement: dict[str, Any] | None = None
    """Where the nodes sit in the network (launcher.planning.placement: within, the sbatch options, the profile's groups, the rank layout); None: the cluster has no topology and nothing was asked."""
    rank_env: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Variables whose value differs by rank (name -> {"by_gpu": [...], "by_local_rank": [...], "why": ...}): each task sets its own, by the index of the GPU SLURM gave it where given, before torch.distributed starts (lmtrain.distributed.task_env.apply_rank_env)."""
    evaluator: dict[str, Any] | None = None
    """The evaluator alongside the training: the heterogeneous job's second component (lmcore.run.eval_alongside.EvaluatorPlan.to_json); None: none."""
    trial: dict[str, Any] | None = None
    """The search trial this run is (lmcore.search.study.TrialPlan.to_json): its rank 0 reports the metric to the study; None: not a trial."""

    @property
    def parallelism(self) -> Parallelism:
        """How the model is split over the ranks (the planner made it; everyone asks it)."""
        return self.topology.parallelism

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["topology"]["parallelism"] = self.parallelism.to_json()
        return d

    def job_spec(self) -> JobSpec:
        """The job spec, typed (validated again: cheap, and the runtime never indexes strings)."""
        return JobSpec.model_validate(self.spec)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LaunchPlan:
        """A plan.json as written by this lmlaunch or an older one (``READABLE_PLAN_VERSIONS``);
        any other raises :class:`PlanVersionError` saying what to do."""
        version = d.get("version") if isinstance(d, dict) else None
        if version not in READABLE_PLAN_VERSIONS:
            raise PlanVersionError(
                f"plan version {version!r}: this lmlaunch reads plan versions "
                f"{', '.join(map(str, READABLE_PLAN_VERSIONS))} (it writes {PLAN_VERSION}). The run was planned "
                f"by {'a newer' if isinstance(version, int) and version > PLAN_VERSION else 'another'} lmlaunch: "
                f"run it with that one, or start it again (`lmlaunch submit SPEC --new`)"
            )
        if version == 1:
            d = _upgrade_v1(d)
        if d["version"] == 2:
            d = _upgrade_v2(d)
        topology = dict(d["topology"])
        topology["parallelism"] = Parallelism.from_json(topology["parallelism"])
        return cls(
            **{
                **d,
                "trainer": TrainerPlan(**d["trainer"]),
                "training": TrainingPlan(**d["training"]),
                "preemption": PreemptionPlan(**d["preemption"]),
                "topology": Topology(**topology),
                "slurm": SlurmParams(**d["slurm"]),
                "paths": RunPaths(**d["paths"]),
                "env_overrides": tuple(EnvOverride(**o) for o in d["env_overrides"]),
                "passthrough": tuple(d["passthrough"]),
                "setup": tuple(d["setup"]),
                "srun_args": tuple(d["srun_args"]),
                "notes": tuple(d.get("notes", ())),
            }
        )


def _upgrade_v1(d: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept the spec's trainer settings in one dict; the entry derived the Trainer's
    arguments from it exactly as :func:`_trainer_plans` does now."""
    t = d["trainer"]
    accum = int(t["accumulate_grad_batches"])
    validate = int(t["limit_val_batches"]) > 0
    trainer = TrainerPlan(
        accelerator=t["accelerator"], devices=int(t["devices"]), num_nodes=int(t["num_nodes"]),
        precision=t["precision"], max_steps=int(t["max_steps"]), accumulate_grad_batches=accum,
        val_check_interval=int(t["val_check_interval"] or t["max_steps"]) * accum if validate else None,
        limit_val_batches=int(t["limit_val_batches"]), log_every_n_steps=int(t["log_every_n_steps"]),
        default_root_dir=d["paths"]["run_dir"],
    )
    training = {"strategy": t["strategy"], "process_group_backend": t["process_group_backend"],
                "seed": int(t["seed"]), "gradient_clip_val": t["gradient_clip_val"]}
    return {**d, "version": 2, "trainer": dataclasses.asdict(trainer), "training": training}


def _upgrade_v2(d: dict[str, Any]) -> dict[str, Any]:
    """Version 2 named the strategy in ``training`` and the tensor-parallel size in ``topology``."""
    training, topology = dict(d["training"]), dict(d["topology"])
    par = Parallelism.of(training.pop("strategy"), topology["world_size"],
                         zero_stage=(d.get("spec") or {}).get("trainer", {}).get("zero_stage"),
                         tensor=topology.pop("tensor_parallel_size", 1),
                         sequence_parallel=topology.pop("sequence_parallel", False))
    return {**d, "version": PLAN_VERSION, "training": training, "topology": {**topology, "parallelism": par.to_json()}}


MODEL_STATE_ROWS = ("parameters", "gradients", "optimizer states")


def planned_model_states(memory: Mapping[str, Any] | None) -> int | None:
    """One rank's planned model states (parameters, gradients, optimizer states) from a plan's
    ``memory`` (launcher.planning.memory.Breakdown.to_json); None where the plan has none."""
    if not memory:
        return None
    rows = {r.get("name"): int(r.get("bytes") or 0) for r in memory.get("rows") or [] if isinstance(r, Mapping)}
    return sum(rows.get(k, 0) for k in MODEL_STATE_ROWS)
