"""Who am I and how do I reach the others: SLURM's (or the local launcher's) environment,
and a rendezvous that gives each job attempt its own MASTER_PORT.

Lightning's SLURMEnvironment derives MASTER_PORT from the last 4 digits of the job id
(+15000), which collides between jobs on one node (and between a job and its requeue when the
old processes have not released the port yet). Instead global rank 0 binds a free port on its
node and publishes ``{addr, port, attempt}`` in ``<run_dir>/rendezvous/<job>-<restart>.json``
(atomic rename); the other ranks wait for that file. MASTER_ADDR/MASTER_PORT are then set in
the environment before Lightning reads them (its SLURMEnvironment honours both).

The attempt number (1-based, docs/run-directory.md) is decided by rank 0 from the ledger and
published the same way, so every rank names its log ``logs/attempt-<N>/rank-<R>.log`` alike.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hostlist import expand_hostlist  # SLURM hostlist notation: n[1-3,7],gpu-[01-02]-ib

from lmcore.atomic import write_private
from lmcore.job.network import group_of_node
from lmcore.run.run_layout import BATCH_VAR, GENERATION_VAR
from lmcore.run.rundir import RunLayout
from lmcore.run.task_records import TaskRecord, write_task_record

log = logging.getLogger("lmtrain")

LOCAL_LAUNCHER_VAR = "LMTRAIN_LAUNCHER"  # "local": started by lmtrain.local.launch, not by srun
RENDEZVOUS_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TaskEnv:
    launcher: str  # "slurm" | "local"
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    num_nodes: int
    job_id: str
    restart_count: int
    nodes: tuple[str, ...]
    step_id: int = 0  # SLURM_STEP_ID: each srun of a job that restarts in place is a new step
    generation: int = 0  # restarts in place inside this srun step before this start (lmtrain.task.agent)
    batch: str = ""  # the batch script's run (BATCH_VAR): job ids of two clusters may be the same

    @property
    def rendezvous_key(self) -> str:
        """One per start of the ranks: the job, SLURM's requeues, and the srun step (a restart in
        place keeps the job and its restart count; a key without the step let a rank read the
        attempt before's rendezvous and wait on a master that was gone), and the generation: a restart
        the task agents fork inside one srun step. With the batch script's own mark: another
        cluster's job of the same id, in a run directory the clusters share, is another key."""
        key = f"{self.job_id}-{self.restart_count}" + (f"-b{self.batch}" if self.batch else "")
        key = f"{key}-s{self.step_id}" if self.step_id else key
        return f"{key}-g{self.generation}" if self.generation else key

    @property
    def node_name(self) -> str:
        """This task's node as SLURM names it (the job's node list, by this task's node index)."""
        if 0 <= self.node_rank < len(self.nodes):
            return self.nodes[self.node_rank]
        return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _int(environ: dict[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return int(value)
    if default is None:
        raise RuntimeError(f"none of {', '.join(names)} is set: is this task started by srun or lmtrain.local.launch?")
    return default


def read_env(environ: dict[str, str] | None = None) -> TaskEnv:
    env = dict(os.environ if environ is None else environ)
    if env.get(LOCAL_LAUNCHER_VAR) == "local":
        world = _int(env, "WORLD_SIZE")
        return TaskEnv(
            launcher="local",
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK"),
            node_rank=_int(env, "NODE_RANK", default=0),
            world_size=world,
            num_nodes=1,
            job_id=env.get("LMTRAIN_JOB_ID", f"local-{os.getppid()}"),
            restart_count=0,
            nodes=(socket.gethostname(),),
        )
    if "SLURM_PROCID" not in env:
        raise RuntimeError(
            "not inside a SLURM task (SLURM_PROCID is unset) and not started by `lmlaunch run --local`"
        )
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = env.get("SLURM_JOB_ID", "unknown")
    # the step's nodes first: a job with spare nodes runs its ranks on some of the allocation's, and
    # SLURM_NODEID counts within the step (the job's list also stays as it was after a node failed)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return TaskEnv(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID"),
        node_rank=_int(env, "SLURM_NODEID"),
        world_size=_int(env, "SLURM_NTASKS"),
        num_nodes=_int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", default=1),
        job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", default=0),
        nodes=tuple(expand_hostlist(nodelist)) if nodelist else (socket.gethostname(),),
        step_id=_step_id(env),
        generation=int(env[GENERATION_VAR]) if env.get(GENERATION_VAR, "").isdigit() else 0,
        batch=env.get(BATCH_VAR, "") if env.get(BATCH_VAR, "").replace("-", "").isalnum() else "",
    )


def _step_id(env: dict[str, str]) -> int:
    value = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    return int(value) if value.isdigit() else 0


# Where rendezvous ports are drawn from: below the kernel's ephemeral range, above the well-known and
# registered services lmlaunch's own daemons use (the local clusters' SLURM and MariaDB ports < 20000:
# launcher/localcluster/config.py, three SLURM versions 5000 apart).
PORT_FLOOR = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` ("" : every interface) right now, drawn below the kernel's
    ephemeral range. The OS hands out ports for ``bind(0)`` and for every outgoing connection (gloo's
    and NCCL's included) from that range, so a port taken there, released and bound again a moment
    later by the rendezvous store may meanwhile be another connection's (EADDRINUSE, seen with many
    jobs on one machine); below it only explicit binds compete. Falls back to a port the OS picks."""
    low = _ephemeral_low()
    if low - 1 - PORT_FLOOR >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randint(PORT_FLOOR, low - 1)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _resolvable(host: str) -> bool:
    try:
        socket.gethostbyname(host)
        return True
    except OSError:
        return False


def main_address(env: TaskEnv) -> str:
    """Rank 0's reachable address: the first node's name if it resolves, else this host."""
    if env.launcher == "local":
        return "127.0.0.1"
    first = env.nodes[0] if env.nodes else socket.gethostname()
    if _resolvable(first):
        return first
    host = socket.gethostname()
    return socket.gethostbyname(host) if _resolvable(host) else "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int
    attempt: int
    resume: str | None = None  # the checkpoint (step-<S>) rank 0 chose; every rank resumes from it


def rendezvous(
    env: TaskEnv,
    run_dir: str | Path,
    *,
    attempt: int | None,
    resume: str | None = None,
    timeout_s: float = RENDEZVOUS_TIMEOUT_S,
) -> Rendezvous:
    """Rank 0 (with ``attempt`` given) publishes address, port, attempt and the checkpoint to
    resume from (``resume``: rank 0 lists the checkpoints, the others use its choice); others
    wait for it.

    Sets MASTER_ADDR and MASTER_PORT in os.environ (the local launcher's, already set, are kept
    and published as they are; a SLURM task's inherited ones are not its own and are ignored).
    """
    path = RunLayout.of(run_dir).rendezvous_file(env.rendezvous_key)
    if env.rank == 0:
        if attempt is None:
            raise ValueError("rank 0 must decide the attempt number")
        # A SLURM task inherits the submitting shell's environment (sbatch --export=ALL): a
        # MASTER_PORT there belongs to another process (seen: every job submitted from one test
        # process took the same port, and all but the first died of EADDRINUSE). Only the local
        # launcher sets these for its ranks.
        own = env.launcher != "slurm"
        addr = (os.environ.get("MASTER_ADDR") if own else None) or main_address(env)
        port = int((os.environ.get("MASTER_PORT") if own else None) or free_port())
        rv = Rendezvous(addr=addr, port=port, attempt=attempt, resume=resume)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(rv.__dict__))
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                rv = Rendezvous(**json.loads(path.read_text()))
                break
            except (FileNotFoundError, json.JSONDecodeError):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {env.rank}: rank 0 did not publish {path} within {timeout_s:.0f}s "
                        "(did rank 0 start? is the run directory on a filesystem all nodes share?)"
                    ) from None
                time.sleep(0.2)
    os.environ["MASTER_ADDR"] = rv.addr
    os.environ["MASTER_PORT"] = str(rv.port)
    return rv


def cluster_environment(env: TaskEnv) -> Any:
    """Lightning's cluster plugin: SLURM without Lightning's auto-requeue (lmtrain owns signals),
    or the plain environment of the local launcher (LOCAL_RANK/NODE_RANK/WORLD_SIZE)."""
    if env.launcher == "slurm":
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        return SLURMEnvironment(auto_requeue=False)
    from lightning.pytorch.plugins.environments import LightningEnvironment

    return LightningEnvironment()


def apply_rank_env(rank_env: dict[str, Any], local_rank: int, environ: Any = None, *, gpu: str | None = None
                   ) -> dict[str, str]:
    """Set this task's own value of each variable that differs by rank (the plan's ``rank_env``, e.g.
    NCCL_IB_HCA from the profile's network.hca_by_gpu), before NCCL reads it: by ``gpu``, the index on
    its node of the GPU SLURM gave it, where the variable has values by GPU (two jobs on one node:
    the second's local rank 0 may hold GPU 2), else by local rank; the names and values set."""
    target = os.environ if environ is None else environ
    done = {}
    for name, spec in rank_env.items():
        by_gpu, values = spec.get("by_gpu") or [], spec.get("by_local_rank") or []
        if by_gpu and gpu is not None and gpu.isdigit() and int(gpu) < len(by_gpu):
            target[name] = done[name] = str(by_gpu[int(gpu)])
        elif values:
            target[name] = done[name] = str(values[local_rank % len(values)])
    return done


def begin_task(run_dir: str | Path, plan: Any) -> None:
    """A task's first acts: its own value of each variable that differs by rank (network.hca_by_gpu's
    NCCL_IB_HCA, by the GPU SLURM gave it), before NCCL starts; then its record, with them and its
    GPUs, for `lmlaunch stacks`, the layout and the GPU check (even if it gets stuck starting)."""
    env = read_env()
    gpus: tuple[str, ...] | None = None
    gpu = None
    if plan.slurm.gpus_per_node:  # the GPUs SLURM gave it, checked on its node at preflight
        from lmtrain.distributed.gpu_binding import binding, gpu_used, gpus_of_task

        gpus = gpus_of_task(os.environ, env.launcher, plan.slurm.gpus_per_node)
        gpu = gpu_used(gpus, env.local_rank, binding(env.launcher, plan.slurm.gpu_bind))
    applied = apply_rank_env(plan.rank_env, env.local_rank, gpu=gpu) if plan.rank_env else {}
    record_this_task(run_dir, plan, rank_env=applied, gpus=None if gpus is None else (",".join(gpus), gpu))


def record_this_task(run_dir: str | Path, plan: Any = None, *, rank_env: dict[str, str] | None = None,
                     gpus: tuple[str, str | None] | None = None) -> None:
    """Write this process's record (with ``plan``, a LaunchPlan: the node's switch or block and the
    rank's place in the mesh; ``gpus``: the GPUs it has and the one it uses); a failure costs only
    ``lmlaunch stacks`` and the layout and GPU checks, never the task."""
    try:
        env = read_env()
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        where: dict[str, Any] = {}
        if plan is not None:
            par = plan.parallelism
            where = {"stage": (env.rank // par.tensor) % par.pipeline, "replica": par.data_rank(env.rank)}
            groups = (plan.placement or {}).get("groups") or {}
            where["group"] = group_of_node(groups, node)
        if gpus is not None:
            where["gpus"], where["gpu"] = gpus
        write_task_record(run_dir, TaskRecord(
            rank=env.rank, local_rank=env.local_rank, node=node,
            pid=os.getpid(), job_id=env.job_id, restart_count=env.restart_count, python=sys.executable,
            time=time.time(), rank_env=rank_env or None, **where,
        ), node=env.node_rank)
    except Exception as exc:  # any failure here costs only the stacks command
        logging.getLogger("lmtrain").warning("could not record this task for `lmlaunch stacks`: %s", exc)


LEAVE_S = 60.0  # the most a rank waits for torch.distributed to part before it exits anyway


def leave_process_group(*, within_s: float = LEAVE_S) -> bool:
    """Part from the other ranks before this process exits: destroy every process group while
    the interpreter is still whole. A rank that exits with gloo's worker threads still alive can
    abort in its C++ teardown ("terminate called without an active exception",
    https://github.com/pytorch/pytorch/issues/190489): the job trained to the end and SLURM
    records it FAILED. Seen once on the local cluster (a 2-rank CPU job, its rank 1 aborted after
    the attempt's end line); reproduced with 5 gloo ranks that exit after an all_gather: 3 aborts
    in 60 processes without this call, none with it.

    lmtrain.task.entry calls it only when this rank's attempt ended well (exit 0): parting while a peer
    is still in a collective can hang (torchtitan parts on success only, for that reason). Bounded
    all the same: the parting runs in a thread this rank stops waiting for after ``within_s``. True
    when the groups were destroyed (or there were none)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return True
    import threading

    done = threading.Event()

    def part() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group already gone: nothing left to part from
            log.warning("leaving the process group: %s", exc)
        forget_deepspeed_groups()
        done.set()

    threading.Thread(target=part, name="lmtrain-leave-process-group", daemon=True).start()
    if not done.wait(within_s):
        log.warning("the process group did not part within %.0f s: this rank exits without it", within_s)
        return False
    return True


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the groups of its first engine in module globals (deepspeed.utils.groups)
    and hands them to every later engine of the process: once the process group is destroyed, a
    second engine fails at its first broadcast ("Group ... is not registered"). Seen in the GPU
    bench, which trains (a) and (b) in one process. Reloading the module resets its globals in
    the module object every DeepSpeed module already holds."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        import importlib

        importlib.reload(groups)


def process_group_timeout(plan: Any) -> timedelta:
    """The plan's collective timeout (spec ``watchdog.collective_timeout_s``) as the timedelta the
    Lightning strategies and torch.distributed take."""
    return timedelta(seconds=plan.job_spec().watchdog.collective_timeout_s)
