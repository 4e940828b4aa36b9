"""spec + profile -> LaunchPlan: everything the cluster will see, computed without any I/O.

The plan is the seam of the product: ``--dry-run`` prints it, ``submit`` hands it to
submitit, and each task reads it back from the run directory (``plan.json``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from launcher.core.deepspeed_config import render_deepspeed
from launcher.core.errors import SpecError, did_you_mean
from launcher.core.nccl import EnvOverride, render_env
from launcher.core.profiles import Profile, check_slurm_path
from launcher.core.spec import JobSpec, format_minutes, mem_to_mb

# 2: `trainer` is exactly the Trainer's keyword arguments (TrainerPlan); `training` holds the rest.
PLAN_VERSION = 2
READABLE_PLAN_VERSIONS = (1, 2)  # a requeued attempt reads the plan.json its submission wrote
TASK_TARGET = "lmtrain.task:TrainTask"


class PlanVersionError(ValueError):
    """plan.json was written by an lmlaunch whose plan this one cannot read."""


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
    gradient_clip_val: float | None = None  # the module clips (lmtrain.module: with every strategy alike)
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

    strategy: str  # ddp | deepspeed | fsdp (lmtrain.strategies builds the object)
    process_group_backend: str  # nccl on GPUs, gloo on CPU processes
    seed: int
    gradient_clip_val: float | None  # applied by the module (TrainerPlan.gradient_clip_val is None)


@dataclass(frozen=True)
class Topology:
    nodes: int
    tasks_per_node: int
    world_size: int
    accelerator: str  # "gpu" | "cpu"
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int


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
    task_output: str = ""  # each task's stdout (srun --output), %t = task rank
    task_error: str = ""  # each task's stderr (srun --error)


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
    preemption: dict[str, Any]
    spec: dict[str, Any]
    notes: tuple[str, ...] = field(default_factory=tuple)
    rendezvous: dict[str, str] = field(default_factory=dict)
    """How MASTER_PORT is chosen: a shell command run on the batch host at every start."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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
        return cls(
            **{
                **d,
                "trainer": TrainerPlan(**d["trainer"]),
                "training": TrainingPlan(**d["training"]),
                "topology": Topology(**d["topology"]),
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
    training = TrainingPlan(strategy=t["strategy"], process_group_backend=t["process_group_backend"],
                            seed=int(t["seed"]), gradient_clip_val=t["gradient_clip_val"])
    return {**d, "version": PLAN_VERSION, "trainer": dataclasses.asdict(trainer),
            "training": dataclasses.asdict(training)}


def _topology(spec: JobSpec, profile: Profile, problems: list[str]) -> Topology:
    r = spec.resources
    if r.gpus_per_node > profile.gpus_per_node:
        problems.append(
            f"resources.gpus_per_node({r.gpus_per_node}) is above what profile '{profile.name}' "
            f"nodes have: gpus_per_node({profile.gpus_per_node})"
        )
    tasks = spec.tasks_per_node
    if r.gpus_per_node == 0 and tasks > profile.max_tasks_per_node:
        problems.append(
            f"resources.tasks_per_node({tasks}) is above profile '{profile.name}' "
            f"max_tasks_per_node({profile.max_tasks_per_node})"
        )
    world = r.nodes * tasks
    mbs = spec.data.micro_batch_size
    gbs = spec.trainer.global_batch_size
    per_step = mbs * world
    if gbs % per_step:
        problems.append(
            f"trainer.global_batch_size({gbs}) is not a multiple of data.micro_batch_size({mbs}) "
            f"x world_size({world}) = {per_step}; world_size = resources.nodes({r.nodes}) x "
            f"{'gpus_per_node' if r.gpus_per_node else 'tasks_per_node'}({tasks})"
        )
    return Topology(
        nodes=r.nodes,
        tasks_per_node=tasks,
        world_size=world,
        accelerator="gpu" if r.gpus_per_node > 0 else "cpu",
        micro_batch_size=mbs,
        grad_accum=gbs // per_step,
        global_batch_size=gbs,
    )


def _slurm(
    spec: JobSpec, profile: Profile, topo: Topology, paths: RunPaths, problems: list[str]
) -> SlurmParams:
    r = spec.resources
    by_kind = {
        "default": profile.default_partition,
        "preemptible": profile.preemptible_partition,
        "high_priority": profile.high_priority_partition,
    }
    partition = r.partition or by_kind[r.partition_kind] or profile.default_partition
    if r.partition is None and by_kind[r.partition_kind] is None:
        problems.append(
            f"resources.partition_kind({r.partition_kind}): profile '{profile.name}' has no "
            f"{r.partition_kind} partition; its partitions: {', '.join(profile.partitions)}"
        )
    elif partition not in profile.partitions:
        problems.append(
            f"resources.partition '{partition}' is not a partition of profile '{profile.name}'"
            f"{did_you_mean(partition, profile.partitions)}; allowed: {', '.join(profile.partitions)}"
        )
    else:
        part = profile.partitions[partition]
        if r.time_minutes > part.max_minutes:
            problems.append(
                f"resources.time({r.time}) = {r.time_minutes} min is above partition '{partition}' "
                f"max_time({part.max_time}) = {part.max_minutes} min"
            )
    cpus = r.cpus_per_task or profile.cpus_per_gpu
    mem = r.mem
    if mem is None and profile.mem_per_gpu and r.gpus_per_node:
        mem = f"{mem_to_mb(profile.mem_per_gpu) * r.gpus_per_node}M"
    gres = None
    if r.gpus_per_node:
        gres = f"{profile.gres_name}:{r.gpus_per_node}"
    signal_name = spec.preemption.signal
    # submitit's file names (submitit.core.utils.JobPaths): the batch shell writes task 0's
    # name, each srun task its own.
    submitit_dir = PurePosixPath(paths.submitit_dir)
    return SlurmParams(
        job_name=spec.name,
        partition=partition,
        nodes=topo.nodes,
        ntasks_per_node=topo.tasks_per_node,
        cpus_per_task=cpus,
        gpus_per_node=r.gpus_per_node,
        gres=gres,
        mem=mem,
        time_minutes=r.time_minutes,
        time=format_minutes(r.time_minutes),
        account=r.account or profile.account,
        qos=r.qos or profile.qos,
        constraint=r.constraint,
        exclusive=profile.exclusive if r.exclusive is None else r.exclusive,
        signal=f"{signal_name}@{spec.preemption.warning_seconds}",
        signal_name=signal_name,
        warning_seconds=spec.preemption.warning_seconds,
        requeue=True,
        open_mode="append",
        output=str(submitit_dir / "%j_0_log.out"),
        error=str(submitit_dir / "%j_0_log.err"),
        task_output=str(submitit_dir / "%j_%t_log.out"),
        task_error=str(submitit_dir / "%j_%t_log.err"),
    )


def _trainer_plans(spec: JobSpec, topo: Topology, run_dir: str) -> tuple[TrainerPlan, TrainingPlan, list[str]]:
    t = spec.trainer
    notes = []
    precision = t.precision
    if topo.accelerator == "cpu" and precision == "16-mixed":
        precision = "bf16-mixed"
        notes.append("16-mixed needs CUDA: this CPU run uses bf16-mixed")
    validate = t.limit_val_batches > 0
    trainer = TrainerPlan(
        accelerator=topo.accelerator,
        devices=topo.tasks_per_node,
        num_nodes=topo.nodes,
        precision=precision,
        max_steps=t.max_steps,
        accumulate_grad_batches=topo.grad_accum,
        # Lightning counts batches; the spec counts optimizer steps (null: once, at the end).
        val_check_interval=(t.val_check_interval or t.max_steps) * topo.grad_accum if validate else None,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        default_root_dir=run_dir,
    )
    training = TrainingPlan(
        strategy=t.strategy,
        process_group_backend="nccl" if topo.accelerator == "gpu" else "gloo",
        seed=t.seed,
        gradient_clip_val=t.gradient_clip_val,
    )
    return trainer, training, notes


def _strategy_problems(spec: JobSpec, topo: Topology) -> list[str]:
    """Combinations that cannot run as planned, refused before any queue time is spent.

    Every strategy runs on CPU processes too (DeepSpeed with its CPU accelerator, FSDP as
    FSDP2); what cannot is offloading to a CPU the job already runs on."""
    t = spec.trainer
    problems = []
    if topo.accelerator == "cpu" and (t.offload_optimizer or t.offload_params):
        what = "trainer.offload_optimizer" if t.offload_optimizer else "trainer.offload_params"
        problems.append(
            f"{what} moves state from GPUs to the CPU, and this job runs on CPU processes "
            f"(resources.gpus_per_node is 0): remove it (DeepSpeed's CPU Adam it would need is "
            f"not built here: DS_BUILD_OPS=0)"
        )
    return problems


def run_paths(spec: JobSpec, runs_root: str) -> RunPaths:
    run_dir = PurePosixPath(runs_root) / spec.name
    ckpt = spec.checkpoint.dir or str(run_dir / "checkpoints")
    return RunPaths(
        run_dir=str(run_dir),
        submitit_dir=str(run_dir / "submitit"),
        logs_dir=str(run_dir / "logs"),
        checkpoint_dir=str(ckpt),
        heartbeat=str(run_dir / "metrics" / "heartbeat.jsonl"),
        ledger=str(run_dir / "attempts.jsonl"),
        plan_json=str(run_dir / "plan.json"),
        spec_yaml=str(run_dir / "spec.yaml"),
        deepspeed_json=str(run_dir / "deepspeed.json") if spec.trainer.strategy == "deepspeed" else None,
    )


def make_plan(
    spec: JobSpec, profile: Profile, *, runs_root: str, python: str | None = None
) -> LaunchPlan:
    """The whole launch, as data. Raises SpecError with the arithmetic when it cannot work.

    ``runs_root`` is absolute and already expanded (see :func:`launcher.resolve.runs_root_for`);
    ``python`` is the interpreter command tasks run (default: the profile's ``python``; a
    profile with ``python: auto`` needs it given).
    """
    if not runs_root.startswith("/"):
        raise SpecError([f"runs root '{runs_root}' must be an absolute path"])
    check_slurm_path(runs_root, "runs root")
    if python is None:
        if profile.python == "auto":
            raise SpecError(
                [f"profile '{profile.name}' has python: auto; the plan needs the interpreter path"]
            )
        python = profile.python
    problems: list[str] = []
    topo = _topology(spec, profile, problems)
    problems += _strategy_problems(spec, topo)
    paths = run_paths(spec, runs_root)
    slurm = _slurm(spec, profile, topo, paths, problems)
    if problems:
        raise SpecError(problems)
    env = render_env(spec, profile, run_dir=paths.run_dir, cpus_per_task=slurm.cpus_per_task)
    trainer, training, trainer_notes = _trainer_plans(spec, topo, paths.run_dir)
    notes = tuple(trainer_notes)
    deepspeed = None
    if training.strategy == "deepspeed":
        deepspeed = render_deepspeed(spec, world_size=topo.world_size, grad_accum=topo.grad_accum)
    srun_args: tuple[str, ...] = ()
    if profile.container is not None:
        srun_args = (f"--container-image={profile.container.image}",)
        if profile.container.mounts:
            srun_args += (f"--container-mounts={','.join(profile.container.mounts)}",)
    part = profile.partitions[slurm.partition]
    if part.preemptible:
        grace = f"{part.grace_seconds} s" if part.grace_seconds is not None else "the partition's GraceTime"
        signal = (
            f"SIG{slurm.signal_name} and SIGTERM"
            if profile.sends_user_signal_on_preemption
            else "SIGTERM only (the cluster does not send the user signal on preemption)"
        )
        notes += (
            f"partition '{slurm.partition}' is preemptible: on preemption the tasks get {signal}, "
            f"then SIGKILL after {grace}; the job checkpoints and requeues",
        )
    preemption = {
        **spec.preemption.model_dump(),
        "cluster_sends_user_signal": profile.sends_user_signal_on_preemption,
        "grace_seconds": profile.partitions[slurm.partition].grace_seconds,
    }
    return LaunchPlan(
        version=PLAN_VERSION,
        run_name=spec.name,
        profile=profile.name,
        topology=topo,
        slurm=slurm,
        env=env.values,
        env_reasons=env.reasons,
        env_overrides=env.overrides,
        passthrough=env.passthrough,
        setup=tuple(profile.setup),
        python=python,
        srun_args=srun_args,
        deepspeed=deepspeed,
        trainer=trainer,
        training=training,
        task={"target": TASK_TARGET, "run_dir": paths.run_dir},
        paths=paths,
        preemption=preemption,
        spec=spec.model_dump(mode="json"),
        notes=notes,
        rendezvous={
            "master_addr": "global rank 0's node (lmtrain.env.rendezvous)",
            "master_port": (
                "a free port rank 0 binds on its node at every attempt, published in "
                "<run_dir>/rendezvous/ (Lightning's job-id port collides between jobs)"
            ),
        },
    )
