"""Cluster profiles: what a cluster offers and how jobs must run on it.

A profile is a YAML file in ``cluster_profiles/`` (or a directory named by
``LMLAUNCH_PROFILES_DIR``). Profiles are written by whoever knows the cluster; job specs
pick one by name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from launcher.runs.home import user_profiles_dir
from launcher.spec.profile_submit import Submission
from launcher.spec.validation import format_validation_error
from launcher.spec.yamlio import load_yaml_file
from lmcore.errors import SpecError, did_you_mean
from lmcore.job import site_options
from lmcore.job.container import ContainerSpec
from lmcore.job.network import Network
from lmcore.job.plan import gpu_bind_problem
from lmcore.job.spec import parse_slurm_time, reserved_env_reason
from lmcore.job.strict_model import StrictModel
from lmcore.search.study_storage import SweepStorage
from lmcore.text_rules import (
    ENV_NAME,
    GRES_NAME,
    SLURM_WORD,
    EnvValue,
    MemSize,
    OneLine,
    PathText,
    ShellLine,
    SlurmWord,
    brief,
)

REPO_PROFILES = Path(__file__).resolve().parents[2] / "cluster_profiles"  # a checkout (editable install)
SHIPPED_PROFILES = Path(__file__).resolve().parents[1] / "cluster_profiles"  # the same files in an installed wheel




_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
# SLURM reads --output/--error paths itself: '%' starts a filename pattern, '\\' escapes even
# inside quotes, and a #SBATCH line cannot hold a line break.
_SLURM_PATH_BAD = re.compile(r"[%\\\x00-\x1f\x7f]")


def _account() -> dict[str, str]:
    """USER/LOGNAME/HOME of this process's account from the password database (as ``~`` does)."""
    import pwd

    try:
        entry = pwd.getpwuid(os.getuid())
    except KeyError:  # a uid with no entry (some containers)
        return {}
    return {"USER": entry.pw_name, "LOGNAME": entry.pw_name, "HOME": entry.pw_dir}


def expand_path(raw: str, environ: Mapping[str, str], what: str) -> str:
    """Expand ``~`` and ``$VAR``/``${VAR}`` from ``environ``; an unset variable is an error.

    Cron, containers and some batch shells run without ``$USER``, ``$LOGNAME`` or ``$HOME``:
    those three fall back to this account's entry in the password database, as ``~`` does.
    ``what`` names where the path came from (for the message).
    """
    fallback: dict[str, str] | None = None

    def lookup(name: str) -> str | None:
        nonlocal fallback
        value = environ.get(name)
        if value:
            return value
        if name in ("USER", "LOGNAME", "HOME"):
            if fallback is None:
                fallback = _account()
            return fallback.get(name) or None
        return None

    text = raw
    if text == "~" or text.startswith("~/"):
        home = lookup("HOME")
        if not home:
            raise SpecError([f"{what} {brief(raw)} starts with ~ but HOME is not set and this account has no home"])
        text = home + text[1:]
    missing = [a or b for a, b in _VAR.findall(text) if not lookup(a or b)]
    if missing:
        raise SpecError(
            [
                f"{what} {brief(raw)} uses ${missing[0]}, which is not set (or empty) in this shell; "
                f"set {missing[0]}, or set LMLAUNCH_RUNS_ROOT to the runs root to use"
            ]
        )
    return _VAR.sub(lambda m: lookup(m.group(1) or m.group(2)) or "", text)


def check_slurm_path(path: str, what: str) -> None:
    """Reject a path that SLURM cannot take in #SBATCH --output (clear message, no broken script)."""
    bad = _SLURM_PATH_BAD.search(path)
    if bad:
        raise SpecError(
            [
                f"{what} {brief(path)} contains {bad.group()!r}, which SLURM cannot take in a "
                "#SBATCH --output path (no '%', backslash, line breaks or control characters); "
                "choose another directory"
            ]
        )


class Partition(StrictModel):
    """A SLURM partition of the cluster."""

    max_time: str
    """Longest wall-clock limit the partition accepts (SLURM time)."""
    preemptible: bool = False
    """Jobs here can be preempted (requeued) by higher-priority partitions."""
    grace_seconds: int | None = Field(None, ge=0)
    """GraceTime between SIGTERM and SIGKILL on preemption, when known."""
    nodes: int | None = Field(None, ge=1, le=1_000_000)
    """Nodes a job may have in this partition (`profile init` reads TotalNodes, or MaxNodes when lower): a job asking more, spare nodes included, is refused at validate; absent: SLURM says so at submission."""

    @field_validator("max_time")
    @classmethod
    def _t(cls, v: str) -> str:
        parse_slurm_time(v)
        return v

    @property
    def max_minutes(self) -> int:
        return parse_slurm_time(self.max_time)


class EnvVar(StrictModel):
    """A fabric variable with its reason."""

    value: EnvValue
    """Value exported in every task."""
    why: OneLine
    """One line: why this cluster needs it."""

    @field_validator("value", mode="before")
    @classmethod
    def _number_as_text(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return str(v)
        return v

    @field_validator("why")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if not v.strip() or "\n" in v.strip():
            raise ValueError("why must be one non-empty line")
        return v.strip()


class Login(StrictModel):
    """How a workstation reaches this cluster's login node (`lmlaunch --remote NAME ...`): every
    command then runs there over one OpenSSH master connection (launcher.remote.forward)."""

    ssh: OneLine
    """ssh destination: user@host or a Host alias of ~/.ssh/config (its ProxyJump, port and key apply)."""
    lmlaunch: OneLine = "lmlaunch"
    """The lmlaunch command on the login node, e.g. ~/venvs/lm/bin/lmlaunch (a login shell's PATH may lack it)."""
    require_master: bool = False
    """Never prompt: fail at once with the command that opens the master connection when none is open (clusters with MFA)."""
    control_path: OneLine = "~/.ssh/lmlaunch-%C"
    """The master connection's socket (ssh's ControlPath; %C: a hash of user, host and port)."""
    staging: OneLine = "~/.lmlaunch/incoming"
    """Directory on the login node where a submission's spec and code arrive before its run directory exists."""
    workdir: OneLine = "~"
    """Directory on the cluster that relative paths of a spec sent from the workstation start from (data.path, checkpoint.dir, model.pretrained, eval.checkpoint): where the spec would sit there, e.g. ~/project/jobs."""
    options: list[OneLine] = Field(default_factory=list, max_length=100)
    """More ssh arguments, e.g. [-F, ~/.ssh/cluster_config] or [-o, SetEnv=SLURM_CONF=/etc/slurm/x.conf]."""
    profile: OneLine | None = None
    """In a run over several clusters (clusters: [...]): the name of this cluster's profile for the lmlaunch on the login node, which submits the run's attempts there; null: this profile's own name."""


class ProfileSlurmOptions(StrictModel):
    """sbatch and srun options every job on this cluster needs that lmlaunch does not plan itself."""

    sbatch: site_options.ProfileSbatch = Field(default_factory=dict, max_length=200)
    """sbatch options by long name without dashes, e.g. {reservation: r1, hint: nomultithread}; true for a flag."""
    srun: site_options.ProfileSrun = Field(default_factory=dict, max_length=200)
    """srun options of the tasks' step, e.g. {mpi: pmix}; true for a flag."""


class Profile(StrictModel):
    """A cluster: partitions, hardware per node, filesystem, setup and fabric environment."""

    name: str
    """Profile name (the file's stem)."""
    description: OneLine = ""
    """What cluster this is."""
    partitions: dict[str, Partition] = Field(..., min_length=1, max_length=1000)
    """Partitions jobs may use, by name."""
    default_partition: SlurmWord
    """Partition used when the job names none."""
    preemptible_partition: SlurmWord | None = None
    """Low-priority partition where jobs may be preempted."""
    high_priority_partition: SlurmWord | None = None
    """High-priority partition (preempts the preemptible one)."""
    account: SlurmWord | None = None
    """Default SLURM account."""
    qos: SlurmWord | None = None
    """Default QOS."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """GPUs in each node (0: a CPU-only cluster)."""
    gres_name: str = "gpu"
    """GRES name for GPUs (gpu, or typed like gpu:h100)."""
    gpu_bind: str = "per_task:1"
    """How SLURM gives each task its GPUs (sbatch --gpu-bind): per_task:1 (one GPU a task, in task order: each rank sees exactly one, its cuda:0), single:1 or map_gpu:I,J,... (one GPU a task by the node's topology or the list), closest or none (every task sees all of the node's GPUs, and rank k uses the k-th: Lightning's own way). Every rank checks at start that it got one GPU of its own."""
    gpus_simulated: bool = False
    """The GPUs are not real: SLURM schedules and binds them (`lmlaunch cluster up --gpus`: devices without CUDA), and the ranks train on CPU behind that binding (gloo); `profile init` sets it for the local cluster."""
    cpus_per_gpu: int = Field(1, ge=1, le=1024)
    """CPU cores per GPU task (or per CPU task on a CPU-only cluster)."""
    mem_per_gpu: MemSize | None = None
    """Memory per GPU (e.g. 200G); the job's mem per node defaults to this x GPUs."""
    mem_per_node: MemSize | None = None
    """Memory a job may have on one node (`profile init` writes the smallest RealMemory of the default partition's nodes): a job asking more per node (resources.mem, or mem_per_gpu x GPUs) is refused at validate; absent: not checked (SLURM would queue it and never start it)."""
    gpu_memory: MemSize | None = None
    """Memory of one GPU (e.g. 80G): a job whose planned per-rank peak exceeds 90 % of it is refused at validate (`--force` submits anyway); absent: not checked."""
    max_tasks_per_node: int = Field(64, ge=1, le=4096)
    """Most tasks a node runs (CPU-only clusters: cores per node)."""
    exclusive: bool = False
    """Request whole nodes by default."""
    runs_root: PathText
    """Root of run directories on a filesystem every node sees (~ and $VARS expanded)."""
    object_store_credentials: PathText | None = None
    """The S3 credentials file (JSON: endpoint, access_key, secret_key, region; mode 600, readable by its owner only) that a job's ``checkpoint.dir: s3://...`` is reached with: a path every node sees (``lmlaunch cluster up --s3`` writes the local gateway's)."""
    setup: list[ShellLine] = Field(default_factory=list, max_length=1000)
    """Shell lines run in the batch script before the tasks start (module load, venv)."""
    python: OneLine = "python"
    """Python interpreter on the nodes (after setup). 'auto': the interpreter running lmlaunch (clusters that share its venv, such as local)."""
    eval_python: OneLine | None = None
    """The interpreter the evaluator runs (eval.alongside, `lmlaunch eval`): an environment with lm-eval (pip install 'lmlaunch[eval]'), kept apart from the tasks' so that its packages never slow a rank's start; null: ``python``. 'auto': the environment ``<venv>-eval`` beside the one running lmlaunch (what scripts/setup.sh makes), else that one."""
    container: ContainerSpec | None = None
    """The cluster's container runtime and what every container here needs (mounts, flags, variables, each with its reason); with an image, every job runs in it (a job spec's container section adds to it or says runtime: none)."""
    login: Login | None = None
    """How to reach this cluster from a workstation over ssh (absent: lmlaunch runs on the login node)."""
    sends_user_signal_on_preemption: bool = False
    """The cluster sets SlurmctldParameters=preempt_send_user_signal."""
    expedited_requeue: bool = False
    """The cluster sets SlurmctldParameters=enable_expedited_requeue (SLURM 26.05): jobs ask for it (sbatch --requeue=expedite), and a requeued attempt (a node failure, a preemption, the time limit) is eligible again at once, at the top of the queue, instead of after SchedulerParameters' requeue_delay (120 s by default)."""
    network: Network = Field(default_factory=Network)
    """The network: SLURM's topology (leaf switches or blocks, read by `lmlaunch profile init`), multi-node NVLink domains and each GPU's HCA (what SLURM does not know)."""
    env: dict[str, EnvVar] = Field(default_factory=dict, max_length=1000)
    """NCCL / fabric environment, each with its reason."""
    submit: Submission = Field(default_factory=Submission)
    """How lmlaunch reaches SLURM here: its commands (via: sbatch) or slurmrestd (via: rest, url, token_file)."""
    slurm_version: OneLine | None = None
    """The SLURM version `lmlaunch profile init` read off the cluster (e.g. 26.05.5); `lmlaunch doctor` says when the live one differs, and when lmlaunch was never tested on it."""
    slurm: ProfileSlurmOptions = Field(default_factory=ProfileSlurmOptions)
    """Site sbatch/srun options every job here gets (a job spec's slurm section adds to them or drops one with null)."""
    sweep_storage: SweepStorage | None = None
    """Where searches (`lmlaunch sweep` with search: optuna) keep their Optuna studies; absent: this cluster runs grid/zip/random sweeps only."""
    min_allreduce_busbw_gbps: float = Field(1.0, ge=0)
    """Least all-reduce bus bandwidth (GB/s, counted as nccl-tests do: 2(n-1)/n x bytes / time) that `lmlaunch doctor --on-nodes` accepts over the probe's nodes; 0 turns the check off. The default 1 GB/s is what even 10 GbE Ethernet gives: below it the fabric is misconfigured (NCCL on the wrong interface or on TCP instead of RDMA); set it near the fabric's measured figure to catch a degraded link."""

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvVar]) -> dict[str, EnvVar]:
        for name in v:
            ENV_NAME.check(name)
            reason = reserved_env_reason(name)
            if reason:
                raise ValueError(f"env: {name} may not be set by a cluster profile: {reason}")
        return v

    @field_validator("partitions")
    @classmethod
    def _partition_names(cls, v: dict[str, Partition]) -> dict[str, Partition]:
        for name in v:
            SLURM_WORD.check(name)
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        import shlex

        try:
            words = shlex.split(v)
        except ValueError as exc:  # the job script runs it as shell words
            raise ValueError(f"python {v!r} is not a command line ({exc})") from None
        if not words:
            raise ValueError("python must be 'auto' or an interpreter command on one line")
        return v

    @field_validator("runs_root")
    @classmethod
    def _runs_root(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("runs_root must be a directory path")
        return v


    @model_validator(mode="after")
    def _parts(self) -> Profile:
        names = list(self.partitions)
        for field in ("default_partition", "preemptible_partition", "high_priority_partition"):
            value = getattr(self, field)
            if value is not None and value not in self.partitions:
                raise ValueError(
                    f"{field} {brief(value)} is not among partitions ({', '.join(names)})"
                    f"{did_you_mean(value, names)}"
                )
        hcas = len(self.network.hca_by_gpu)
        if hcas and hcas != self.gpus_per_node:
            raise ValueError(f"network.hca_by_gpu names {hcas} HCA(s) for {self.gpus_per_node} GPUs per node: one per GPU")
        if hcas and "NCCL_IB_HCA" in self.env:
            raise ValueError("env.NCCL_IB_HCA and network.hca_by_gpu both set NCCL_IB_HCA: keep one (hca_by_gpu gives "
                             "each rank the HCA nearest its GPU)")
        try:
            GRES_NAME.check(self.gres_name)
        except ValueError as exc:
            raise ValueError(f"gres_name: {exc}") from None
        if (bad := gpu_bind_problem(self.gpu_bind, self.gpus_per_node)) is not None:
            raise ValueError(bad)
        return self

    def python_command(self, interpreter: str) -> str:
        """The interpreter command tasks run: ``python`` as written, or ``interpreter`` for auto."""
        return interpreter if self.python == "auto" else self.python


def profile_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    env = os.environ if environ is None else environ
    dirs: list[Path] = []
    extra = env.get("LMLAUNCH_PROFILES_DIR")
    if extra:
        dirs.extend(Path(p) for p in extra.split(os.pathsep) if p)
    dirs.append(user_profiles_dir(env))
    dirs.append(REPO_PROFILES if REPO_PROFILES.is_dir() else SHIPPED_PROFILES)
    return dirs


def available_profiles(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Profile name -> file; earlier directories win."""
    found: dict[str, Path] = {}
    for d in profile_dirs(environ):
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                found.setdefault(f.stem, f)
    return found


def load_profile_file(path: str | Path) -> Profile:
    loaded = load_yaml_file(path, "cluster profile")
    data = loaded.data
    if not isinstance(data, dict):
        raise SpecError(["a cluster profile must be a YAML mapping"], source=str(path))
    if "name" in data and data["name"] != Path(path).stem:
        raise SpecError(
            [f"name {brief(data['name'])} differs from the file name; a profile is named by its file ({Path(path).stem})"],
            source=str(path),
        )
    data = {"name": Path(path).stem, **data}
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, loaded, Profile), source=str(path)) from None


def load_profile(name: str, environ: Mapping[str, str] | None = None) -> Profile:
    profiles = available_profiles(environ)
    if name not in profiles:
        raise SpecError(
            [
                f"cluster: unknown profile {brief(name)}{did_you_mean(name, profiles)}; "
                f"available: {', '.join(sorted(profiles)) or 'none'}"
            ]
        )
    return load_profile_file(profiles[name])


def profile_summary(p: Profile) -> dict[str, Any]:
    return {
        "name": p.name,
        "description": p.description,
        "gpus_per_node": p.gpus_per_node,
        "partitions": {k: v.max_time for k, v in p.partitions.items()},
        "default_partition": p.default_partition,
        "runs_root": p.runs_root,
        "python": p.python,
        "env": sorted(p.env),
        "login": p.login.ssh if p.login else None,
    }


__all__ = ["Profile", "Partition", "EnvVar", "load_profile", "available_profiles", "Literal"]
