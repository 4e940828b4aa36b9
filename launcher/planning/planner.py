"""spec + profile -> LaunchPlan (``lmcore.job.plan``): everything the cluster will see,
computed without any I/O. Every problem is collected and raised at once (SpecError), with the
arithmetic that does not work."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import PurePosixPath

from launcher.planning import gpus, mesh_notes
from launcher.planning.deepspeed_config import render_deepspeed
from launcher.planning.evaluator import plan_evaluator
from launcher.planning.host_memory import node_memory_problem
from launcher.planning.placement import merge_env, plan_placement
from launcher.planning.planned_env import render_env
from launcher.planning.run_paths import run_paths
from launcher.spec.profiles import Profile, check_slurm_path
from lmcore.errors import SpecError, did_you_mean
from lmcore.job import container, pipeline_stages, site_options
from lmcore.job.parallelism import Parallelism
from lmcore.job.plan import (
    PLAN_VERSION,
    TASK_TARGET,
    LaunchPlan,
    PreemptionPlan,
    RunPaths,
    SlurmParams,
    Topology,
    TrainerPlan,
    TrainingPlan,
)
from lmcore.job.spec import JobSpec, format_minutes, mem_to_mb
from lmcore.run import rundir


def _topology(spec: JobSpec, profile: Profile, problems: list[str]) -> Topology:
    r = spec.resources
    counted = gpus.count_problems(spec, profile)  # a root cause: the batch arithmetic below is left out then
    problems += counted
    tasks = spec.tasks_per_node
    if r.gpus_per_node == 0 and tasks > profile.max_tasks_per_node:
        problems.append(
            f"resources.tasks_per_node({tasks}) is above profile '{profile.name}' "
            f"max_tasks_per_node({profile.max_tasks_per_node})"
        )
    world = r.nodes * tasks
    per_node = f"{'gpus_per_node' if r.gpus_per_node else 'tasks_per_node'}({tasks})"
    tp = _tensor_parallel(spec, tasks, per_node, problems)
    pp = spec.trainer.pipeline_parallel_size
    if tp is not None and world % (tp * pp):
        problems.append(f"world_size({world}) = resources.nodes({r.nodes}) x {per_node} is not a multiple of "
                        f"trainer.tensor_parallel_size({tp}) x trainer.pipeline_parallel_size({pp}) = {tp * pp}: "
                        f"world_size = data_parallel x tensor_parallel x pipeline_parallel")
        tp = None
    dp = max(world // ((tp or 1) * pp), 1)
    mbs = spec.data.micro_batch_size
    gbs = spec.trainer.global_batch_size
    if pp > 1 and tp is not None:
        mbs = pipeline_stages.microbatch_size(spec.trainer, mbs, dp, problems)
    per_step = mbs * dp
    if gbs % per_step and tp is not None and not counted:  # (a TP size that does not fit said so already)
        ranks = f"world_size({world})"
        if tp * pp > 1:
            split = (f"trainer.tensor_parallel_size({tp})" if pp == 1 else f"trainer.pipeline_parallel_size({pp})" if tp == 1
                     else f"(trainer.tensor_parallel_size({tp}) x trainer.pipeline_parallel_size({pp}))")
            ranks = f"data-parallel size({dp}) = world_size({world}) / {split}"
        problems.append(
            f"trainer.global_batch_size({gbs}) is not a multiple of data.micro_batch_size({mbs}) "
            f"x {ranks} = {per_step}; world_size = resources.nodes({r.nodes}) x {per_node}"
        )
    accum = max(gbs // per_step, 1)
    par = Parallelism.of_trainer(spec.trainer, world, tensor=tp or 1, microbatches=accum if pp > 1 else 1)
    if pp > 1:
        problems += pipeline_stages.schedule_problems(par, spec.trainer.pipeline_split, spec.model.type, spec.model.config)
    return Topology(
        nodes=r.nodes,
        tasks_per_node=tasks,
        world_size=world,
        accelerator=gpus.accelerator(profile, r.gpus_per_node),
        micro_batch_size=mbs,
        grad_accum=1 if pp > 1 else accum,  # a pipeline's microbatches are its accumulation, inside one step
        global_batch_size=gbs,
        parallelism=par,
    )


def _tensor_parallel(spec: JobSpec, tasks: int, per_node: str, problems: list[str]) -> int | None:
    """The tensor-parallel size, when a TP group fits inside one node (its all-reduces run on every
    layer: across nodes they would cross the fabric twice per block); else the problem, and None."""
    tp = spec.trainer.tensor_parallel_size
    if tp > 1 and tasks % tp:
        problems.append(
            f"trainer.tensor_parallel_size({tp}) must divide the ranks of one node, {per_node}, so that "
            f"each tensor-parallel group stays inside a node"
            + (f" (it is above {tasks})" if tp > tasks else f" ({tasks} = {tasks // tp} x {tp} + {tasks % tp})")
        )
        return None
    seq = spec.data.seq_len
    if spec.trainer.sequence_parallel and seq % tp:
        problems.append(f"trainer.sequence_parallel: data.seq_len({seq}) is not divisible by "
                        f"trainer.tensor_parallel_size({tp}): each rank holds seq_len / {tp} positions")
    return tp


def _partition(spec: JobSpec, profile: Profile, problems: list[str]) -> str:
    """The spec's partition (by name, or by kind from the profile), checked against the profile."""
    r = spec.resources
    by_kind = {
        "default": profile.default_partition,
        "preemptible": profile.preemptible_partition,
        "high_priority": profile.high_priority_partition,
    }
    partition = r.partition or by_kind[r.partition_kind] or profile.default_partition
    if r.partition is None and by_kind[r.partition_kind] is None:
        problems.append(f"resources.partition_kind({r.partition_kind}): profile '{profile.name}' has no "
                        f"{r.partition_kind} partition; its partitions: {', '.join(profile.partitions)}")
    elif partition not in profile.partitions:
        problems.append(
            f"resources.partition '{partition}' is not a partition of profile '{profile.name}'"
            f"{did_you_mean(partition, profile.partitions)}; allowed: {', '.join(profile.partitions)}"
        )
    else:
        part = profile.partitions[partition]
        if r.time_minutes > part.max_minutes:
            problems.append(f"resources.time({r.time}) = {r.time_minutes} min is above partition '{partition}' "
                            f"max_time({part.max_time}) = {part.max_minutes} min")
        if part.nodes is not None and r.nodes + r.spare_nodes > part.nodes:
            spares = f" + resources.spare_nodes({r.spare_nodes}) = {r.nodes + r.spare_nodes}" if r.spare_nodes else ""
            problems.append(f"resources.nodes({r.nodes}){spares} is above the {part.nodes} node(s) of partition "
                            f"'{partition}' (profile '{profile.name}'): the job would never start")
    return partition


def _slurm(
    spec: JobSpec, profile: Profile, topo: Topology, paths: RunPaths, problems: list[str]
) -> SlurmParams:
    r = spec.resources
    partition = _partition(spec, profile, problems)
    cpus = r.cpus_per_task or profile.cpus_per_gpu
    mem = r.mem
    if mem is None and profile.mem_per_gpu and r.gpus_per_node:
        mem = f"{mem_to_mb(profile.mem_per_gpu) * r.gpus_per_node}M"
    if r.mem or r.gpus_per_node <= profile.gpus_per_node:  # (more GPUs than a node has: said, the root cause)
        problems += filter(None, [node_memory_problem(mem, r.mem, profile.name, profile.mem_per_node,
                                                      f"mem_per_gpu({profile.mem_per_gpu}) x gpus_per_node({r.gpus_per_node})")])
    gres = f"{profile.gres_name}:{r.gpus_per_node}" if r.gpus_per_node else None
    signal_name = spec.preemption.signal
    # submitit's file names (submitit.core.utils.JobPaths): the batch shell writes task 0's
    # name, each srun task its own.
    submitit_dir = PurePosixPath(paths.submitit_dir)
    return SlurmParams(
        job_name=spec.name,
        partition=partition,
        nodes=topo.nodes + r.spare_nodes,
        spare_nodes=r.spare_nodes,
        ntasks_per_node=topo.tasks_per_node,
        cpus_per_task=cpus,
        gpus_per_node=r.gpus_per_node,
        gres=gres,
        gpu_bind=gpus.gpu_bind(profile, r.gpus_per_node),
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
        requeue_expedite=profile.expedited_requeue,
        open_mode="append",
        output=str(submitit_dir / "%j_0_log.out"),
        error=str(submitit_dir / "%j_0_log.err"),
        task_output=str(submitit_dir / rundir.SUBMITIT_NODE_LOG.format(job="%j", node="%n", ext="out")),
        task_error=str(submitit_dir / rundir.SUBMITIT_NODE_LOG.format(job="%j", node="%n", ext="out")),  # the same file
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


def _container(spec: JobSpec, profile: Profile, paths: RunPaths, runs_root: str, python: str,
               host_python_dirs: tuple[str, ...], env: Mapping[str, str], problems: list[str]
               ) -> container.ContainerPlan | None:
    """The job's container (profile's section, the spec's over it), or None: no image named."""
    c = container.merged(profile.container, spec.container)
    if c is None:
        if spec.container is not None and spec.container.runtime != "none":  # the spec asked for one
            runtime = spec.container.runtime or "pyxis"
            problems.append(f"container.runtime({runtime}) has no image: set container.image in the spec or in profile "
                            f"'{profile.name}' (a reference such as docker://nvcr.io/nvidia/pytorch:25.01-py3, a file, "
                            "or a local name)")
        return None
    problems += container.problems(c)
    needed = [(runs_root, "the runs root: the run directory, its code snapshot, logs and checkpoints")]
    for store in spec.data.stores:
        data = PurePosixPath(store.path)
        needed.append((str(data if data.is_absolute() else PurePosixPath(paths.run_dir) / data), "the training data"))
    if spec.checkpoint.local_dir:
        needed.append((spec.checkpoint.local_dir, "checkpoint.dir, outside the runs root"))
    if spec.model.pretrained and spec.model.pretrained.startswith("/"):
        needed.append((spec.model.pretrained, "model.pretrained"))
    if c.python == "auto":
        needed += [(d, "python: auto, the host's interpreter and its packages") for d in host_python_dirs]
    return container.render(c, host_python=python, needed=needed,
                            planned_env=sorted({*env, *spec.env.passthrough}), run_dir=paths.run_dir,
                            gpus_per_node=spec.resources.gpus_per_node)


RENDEZVOUS = {
    "master_addr": "global rank 0's node (lmtrain.distributed.task_env.rendezvous)",
    "master_port": (
        "a free port rank 0 binds on its node at every attempt, published in "
        "<run_dir>/rendezvous/ (Lightning's job-id port collides between jobs)"
    ),
}


def make_plan(
    spec: JobSpec,
    profile: Profile,
    *,
    runs_root: str,
    python: str | None = None,
    exclude: Mapping[str, str] | None = None,
    host_python_dirs: tuple[str, ...] = (),
    eval_python: str | None = None,
) -> LaunchPlan:
    """The whole launch, as data. Raises SpecError with the arithmetic when it cannot work.

    ``runs_root`` is absolute and already expanded (see :func:`launcher.planning.resolve.runs_root_for`);
    ``python`` is the interpreter command tasks run (default: the profile's ``python``; a
    profile with ``python: auto`` needs it given); ``exclude``: node -> why, the nodes the user's
    record for this profile excludes (``launcher.spec.excluded_nodes``, read by the caller);
    ``host_python_dirs``: the directories a host interpreter lives in (its venv and base install),
    mounted into a container whose ``python`` is ``auto``; ``eval_python``: the evaluator's (default: ``python``).
    """
    if not runs_root.startswith("/"):
        raise SpecError([f"runs root '{runs_root}' must be an absolute path"])
    check_slurm_path(runs_root, "runs root")
    python = _interpreter(profile, python)
    problems: list[str] = []
    topo = _topology(spec, profile, problems)
    problems += _strategy_problems(spec, topo)
    paths = run_paths(spec, profile, runs_root, uses_deepspeed=topo.parallelism.zero, problems=problems)
    slurm = _slurm(spec, profile, topo, paths, problems)
    evaluator = plan_evaluator(spec, profile, slurm, paths, problems, eval_python or python)
    if problems:
        raise SpecError(problems)
    slurm = dataclasses.replace(slurm, exclude=",".join(sorted(exclude))) if exclude else slurm
    env = render_env(spec, profile, run_dir=paths.run_dir, cpus_per_task=slurm.cpus_per_task)
    trainer, training, trainer_notes = _trainer_plans(spec, topo, paths.run_dir)
    deepspeed = render_deepspeed(spec, world_size=topo.world_size, grad_accum=topo.grad_accum) if topo.parallelism.zero else None
    box = _container(spec, profile, paths, runs_root, python, host_python_dirs, env.values, problems)
    slurm, srun_args, site_notes = _site_options(spec, profile, slurm)
    placed = plan_placement(spec.resources.placement, profile.network, topo, slurm, profile=profile.name)
    if problems or placed.problems:  # an impossible placement among them: nothing is submitted
        raise SpecError(problems + placed.problems)
    slurm, env_notes = placed.slurm, merge_env(placed, env.values, env.reasons)
    if box is not None:
        srun_args = (*box.srun_args, *srun_args)
    notes = (*trainer_notes, *(box.notes if box is not None else ()), *site_notes, *placed.notes, *env_notes,
             *_placement_notes(profile, slurm, exclude or {}), *mesh_notes.tensor_parallel(topo, env.values, env.reasons),
             *mesh_notes.pipeline(topo), *mesh_notes.sharding(topo), *_agreement_notes(spec), *_slurm_notes(slurm, profile))
    preemption = PreemptionPlan.of(
        spec.preemption,
        cluster_sends_user_signal=profile.sends_user_signal_on_preemption,
        grace_seconds=profile.partitions[slurm.partition].grace_seconds,
    )
    return LaunchPlan(
        version=PLAN_VERSION, run_name=spec.name, profile=profile.name, topology=topo, slurm=slurm,
        env=env.values, env_reasons=env.reasons, env_overrides=env.overrides, passthrough=env.passthrough,
        setup=tuple(profile.setup), python=python, srun_args=srun_args, deepspeed=deepspeed, trainer=trainer,
        training=training, task={"target": TASK_TARGET, "run_dir": paths.run_dir}, paths=paths,
        preemption=preemption, spec=spec.model_dump(mode="json"), notes=tuple(notes),
        container=box.to_json() if box is not None else None, rendezvous=dict(RENDEZVOUS), placement=placed.record,
        rank_env=placed.rank_env, evaluator=evaluator.to_json() if evaluator is not None else None,
    )


def _slurm_notes(s: SlurmParams, profile: Profile) -> list[str]:
    """What the plan says of its allocation: how the tasks get their GPUs, and its spare nodes."""
    notes = gpus.notes(profile, s)
    if s.spare_nodes:
        notes.append(f"resources.spare_nodes({s.spare_nodes}): SLURM allocates {s.nodes} nodes (--nodes={s.nodes} "
                     f"--no-kill), the ranks run on {s.run_nodes} (srun --nodes={s.run_nodes}); a node that fails, or "
                     "on which the rank that died first died twice, is left out of the next restart in place and a "
                     "spare takes its place")
    return notes


def _interpreter(profile: Profile, python: str | None) -> str:
    """The interpreter command the tasks run: the caller's, else the profile's (``auto`` needs one)."""
    if python is not None:
        return python
    if profile.python == "auto":
        raise SpecError([f"profile '{profile.name}' has python: auto; the plan needs the interpreter path"])
    return profile.python


def _site_options(spec: JobSpec, profile: Profile, slurm: SlurmParams) -> tuple[SlurmParams, tuple[str, ...], list[str]]:
    """The site's sbatch and srun options (the profile's, then the spec's): the sbatch ones on the
    SLURM parameters, the srun ones as arguments, and a note for each option lmlaunch does not know."""
    sbatch_options = site_options.merged(profile.slurm.sbatch, spec.slurm.sbatch)
    srun_options = site_options.merged(profile.slurm.srun, spec.slurm.srun)
    notes = site_options.unknown_notes("sbatch", sbatch_options) + site_options.unknown_notes("srun", srun_options)
    return (dataclasses.replace(slurm, site_options=sbatch_options), tuple(site_options.as_args(srun_options)),
            list(notes))


def _placement_notes(profile: Profile, slurm: SlurmParams, exclude: Mapping[str, str]) -> list[str]:
    """What the user should know of where the job runs and how it is stopped there: the
    partition's preemption, the excluded nodes."""
    notes = []
    part = profile.partitions[slurm.partition]
    if part.preemptible:
        grace = f"{part.grace_seconds} s" if part.grace_seconds is not None else "the partition's GraceTime"
        signal = (
            f"SIG{slurm.signal_name} and SIGTERM"
            if profile.sends_user_signal_on_preemption
            else "SIGTERM only (the cluster does not send the user signal on preemption)"
        )
        notes.append(f"partition '{slurm.partition}' is preemptible: on preemption the tasks get {signal}, "
                     f"then SIGKILL after {grace}; the job checkpoints and requeues")
    for node, why in sorted(exclude.items()):
        notes.append(f"node {node} is excluded (sbatch --exclude): {why}; a passing `lmlaunch doctor SPEC --on-nodes` "
                     f"clears it")
    return notes


def _agreement_notes(spec: JobSpec) -> list[str]:
    """A stop agreed every k steps runs up to k - 1 steps more before its checkpoint."""
    k = spec.preemption.agree_every_n_steps
    if k <= 1:
        return []
    return [f"preemption.agree_every_n_steps={k}: a stop is agreed at the next multiple of {k} steps, so up to "
            f"{k - 1} more steps run before its checkpoint; they must fit in the warning "
            f"({spec.preemption.warning_seconds} s) and in GraceTime on preemption"]
