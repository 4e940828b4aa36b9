"""The task environment: the profile's fabric preset, the runtime's own variables and the
job's overrides, each with the reason it is set. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.spec.profiles import Profile
from lmcore.job.parallelism import DataParallel
from lmcore.job.plan import EnvOverride
from lmcore.job.spec import JobSpec
from lmcore.run.rundir import CODE_DIR, CODE_ZIP


@dataclass(frozen=True)
class PlannedEnv:
    """The environment the plan gives every task (lmtrain.distributed.task_env.TaskEnv is what a task finds)."""

    values: dict[str, str]
    reasons: dict[str, str]
    overrides: tuple[EnvOverride, ...]
    passthrough: tuple[str, ...]


def render_env(spec: JobSpec, profile: Profile, *, run_dir: str, cpus_per_task: int) -> PlannedEnv:
    values: dict[str, str] = {}
    reasons: dict[str, str] = {}

    def put(name: str, value: str, why: str) -> None:
        values[name] = value
        reasons[name] = why

    put("PYTHONUNBUFFERED", "1", "logs appear as they are written, not when a buffer fills")
    put("OMP_NUM_THREADS", str(cpus_per_task), "one intra-op thread per allocated core, no oversubscription")
    put("TOKENIZERS_PARALLELISM", "false", "no tokenizer thread pools forked into DataLoader workers")
    put("LMLAUNCH_RUN_DIR", run_dir, "where the task finds its plan, checkpoints and heartbeat")
    if profile.gpus_per_node > 0 or spec.resources.gpus_per_node > 0:
        # torch >= 2.2 reads the TORCH_NCCL_* names; the NCCL_* spellings are deprecated.
        for name, value, why in (
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3",
             "a failed or timed-out collective tears down the process group instead of hanging"),
            ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1",
             "on a collective timeout the NCCL watchdog writes its flight recorder (which collective, which ranks)"),
            ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000",
             "the flight recorder keeps the last 2000 collectives (0 records nothing to dump)"),
            ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{run_dir}/logs/nccl-flight-rank-",
             "the flight recorder dump goes into the run directory (torch appends the rank)"),
        ):
            put(name, value, why)
    if DataParallel(spec.trainer.strategy) is DataParallel.ZERO and spec.resources.gpus_per_node == 0:
        put(
            "DS_ACCELERATOR",
            "cpu",
            "DeepSpeed on CPU processes: its CPU accelerator (gloo), not CUDA detection",
        )
    for name, var in profile.env.items():
        put(name, var.value, var.why)

    overrides = []
    for name, value in spec.env.vars.items():
        if name in values and values[name] != value:
            overrides.append(EnvOverride(name, values[name], value))
        put(name, value, "set by the job spec (env.vars)")
    code = f"{run_dir}/{CODE_DIR}/{CODE_ZIP}"
    extra = values.get("PYTHONPATH")
    put("PYTHONPATH", f"{code}:{extra}" if extra else code,
        "the run's code snapshot first: every attempt, requeues included, runs the code it was submitted with "
        "(its zip: a process's imports open one file, not a few hundred)"
        + (f" (then {reasons['PYTHONPATH']})" if extra else "")
        + "; a PYTHONPATH the job already has (the cluster's modules, the profile's setup) is kept after it")
    return PlannedEnv(
        values=values,
        reasons=reasons,
        overrides=tuple(overrides),
        passthrough=tuple(spec.env.passthrough),
    )
