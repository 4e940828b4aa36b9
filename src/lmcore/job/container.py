"""Containers the tasks run in: the profile's and the spec's ``container`` sections, merged, and
rendered for the runtime (pure: no I/O).

- ``pyxis`` (SLURM's SPANK plugin over enroot): srun's own ``--container-image``,
  ``--container-mounts``, ``--container-workdir`` and ``--container-env`` options.
- ``apptainer``: the task command is ``apptainer exec [--nv] --bind SRC:DST,... [--pwd DIR] IMAGE``.
- ``podman``: the task command is ``podman run --rm --network=host --ipc=host --pid=host
  --env NAME ... --volume SRC:DST ... IMAGE``, the container named after the job and the task
  (an earlier attempt's container of the same task, left by a SIGKILLed client, is removed first).

What runs where: the ranks run inside; the batch script stays on the host, where SLURM's commands
are. The ranks' SLURM commands (the job's state, requeue, node exclusion) go through the batch
step's relay (lmcore.slurm.relay), so an image without ``scontrol`` still requeues.

The batch script's lines for a container (its host lines, the task command srun starts) are
rendered by launcher.submit.script from the plan's ``ContainerPlan``. Every string here reaches the
job script shell-quoted; mount paths and images follow the text
rules below, which keep out what the runtimes use as separators (``,`` and ``:`` in paths).
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pydantic import Field, field_validator

from lmcore.job.strict_model import StrictModel
from lmcore.text_rules import EnvName, OneLine, TextRule

Runtime = Literal["pyxis", "apptainer", "podman"]
RUNTIMES: tuple[str, ...] = ("pyxis", "apptainer", "podman")

IMAGE = TextRule(
    "a container image",
    r"[A-Za-z0-9_./:@#+=~-]+",
    "an image name, reference or file (letters, digits and _ . / : @ # + = ~ -), e.g. "
    "docker://nvcr.io/nvidia/pytorch:25.01-py3, /images/train.sif or localhost/train:1",
    1024,
)
MOUNT = TextRule(
    "a bind mount",
    r"/[^\s,:\x00-\x1f\x7f-\x9f]*(:/[^\s,:\x00-\x1f\x7f-\x9f]*)?(:(ro|rw))?",
    "SRC[:DST[:ro|rw]] with absolute paths holding no spaces, commas or colons",
    4096,
)
FLAG = TextRule(
    "a runtime flag", r"-[^\x00-\x1f\x7f-\x9f]*", "one argument starting with '-', e.g. --nv or --security-opt=label=disable",
    1024,
)
if TYPE_CHECKING:  # to mypy each is the str it checks
    ImageText: TypeAlias = str
    MountText: TypeAlias = str
    FlagText: TypeAlias = str
else:
    ImageText, MountText, FlagText = IMAGE.annotated, MOUNT.annotated, FLAG.annotated
# Variables every task needs from its environment, whatever the spec passes: SLURM's own (SLURM_*
# and SLURMD_NODENAME, which the task records name their node by), what
# submitit reads, lmlaunch's, and the fabric and threading families the profile's presets set.
PODMAN_TASK = "podman_task.sh"  # beside this module, in the run's code snapshot too
PASSED_FAMILIES = ("SLURM*", "SUBMITIT_*", "LMLAUNCH_*", "NCCL_*", "GLOO_*", "FI_*", "UCX_*", "CUDA_*",
                   "NVIDIA_*", "OMP_*", "MKL_*", "TORCH_*", "HF_*", "WANDB_*")


class Mount(StrictModel):
    """A bind mount with the reason the cluster needs it."""

    path: MountText
    """SRC[:DST[:ro|rw]] (DST defaults to SRC)."""
    why: OneLine
    """One line: why the tasks need it (shown by the dry run)."""


class Flag(StrictModel):
    """A runtime flag with the reason the cluster needs it."""

    flag: FlagText
    """One argument for the runtime's run/exec command (pyxis: an srun option)."""
    why: OneLine
    """One line: why."""


def _with_why(v: Any, key: str, what: str) -> Any:
    """A bare string in a list of mounts or flags is that entry with a default reason."""
    if isinstance(v, list):
        return [{key: x, "why": what} if isinstance(x, str) else x for x in v]
    return v


class ContainerSpec(StrictModel):
    """Run the tasks in a container. In a profile: the cluster's runtime and what every container
    there needs (the fabric's devices and libraries, with a reason each); a profile section with no
    image runs nothing in a container until a job names one. In a job spec: each key set here
    replaces the profile's (mounts, env and flags add to its lists); ``runtime: none`` runs on the host."""

    runtime: Literal["pyxis", "apptainer", "podman", "none"] | None = None
    """pyxis, apptainer or podman (none: no container for this job); default: the profile's, else pyxis."""
    image: ImageText | None = None
    """Image: a reference (docker://registry/name:tag works for all three), a file (.sif, .sqsh) or a local name."""
    mounts: list[Mount] = Field(default_factory=list, max_length=200)
    """Bind mounts SRC[:DST[:ro|rw]] or {path, why}; the runs root, the data, the checkpoint directory and a host interpreter (python: auto) are mounted at their own paths without being listed."""
    env: list[EnvName] = Field(default_factory=list, max_length=500)
    """Names of more variables passed from the task's environment into the container (the planned ones, SLURM*, NCCL_* and similar families always are)."""
    workdir: OneLine | None = None
    """Working directory inside the container (default: the run directory)."""
    flags: list[Flag] = Field(default_factory=list, max_length=200)
    """More arguments for the runtime (apptainer exec, podman run; pyxis: srun options) as flag strings or {flag, why}."""
    python: OneLine | None = None
    """The interpreter inside the image (default: python). auto: the host's own interpreter and venv, bind-mounted at their paths (an image that holds only the system libraries)."""

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} is not an absolute path: the working directory inside the container")
        return v

    @field_validator("python")
    @classmethod
    def _words(cls, v: str | None) -> str | None:
        try:
            if v is not None and not shlex.split(v):
                raise ValueError("an empty command")
        except ValueError as exc:
            raise ValueError(f"{v!r} is not a command line ({exc}): e.g. python, /opt/conda/bin/python or auto") from None
        return v

    @field_validator("mounts", mode="before")
    @classmethod
    def _mounts(cls, v: Any) -> Any:
        return _with_why(v, "path", "listed in the container section")

    @field_validator("flags", mode="before")
    @classmethod
    def _flags(cls, v: Any) -> Any:
        return _with_why(v, "flag", "listed in the container section")


@dataclass(frozen=True)
class ContainerPlan:
    """The container as the job script uses it (plan.json's ``container``)."""

    runtime: str
    image: str
    python: str  # the interpreter command inside
    mounts: list[dict[str, str]]  # {src, dst, mode, why}
    env: list[str]  # names (and NAME_* families) passed from the task's environment
    workdir: str
    flags: list[dict[str, str]]  # {flag, why}
    srun_args: list[str] = field(default_factory=list)  # pyxis: srun's --container-* options
    prefix: list[str] = field(default_factory=list)  # apptainer/podman: argv before the interpreter
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ContainerPlan:
        return cls(**d)


def merged(profile: ContainerSpec | None, spec: ContainerSpec | None) -> ContainerSpec | None:
    """The job's container: the spec's keys over the profile's (its lists added); None when the
    result names no image or says ``runtime: none``."""
    if profile is None and spec is None:
        return None
    base = profile or ContainerSpec()
    over = spec or ContainerSpec()
    out = ContainerSpec.model_construct(
        runtime=over.runtime or base.runtime or "pyxis",
        image=over.image or base.image,
        mounts=[*base.mounts, *over.mounts],
        env=[*base.env, *(n for n in over.env if n not in base.env)],
        workdir=over.workdir or base.workdir,
        flags=[*base.flags, *over.flags],
        python=over.python or base.python,
    )
    if out.runtime == "none" or not out.image:
        return None
    return out


def problems(c: ContainerSpec) -> list[str]:
    """What cannot work, in the planner's words."""
    out: list[str] = []
    if c.runtime == "pyxis" and c.python == "auto":
        out.append("container.python(auto) mounts the host's interpreter, which pyxis cannot: its mounts are "
                   "the profile's and the spec's only; name the image's interpreter (e.g. python)")
    return out


def _mount_parts(text: str) -> tuple[str, str, str]:
    parts = text.split(":")
    src = parts[0]
    dst = parts[1] if len(parts) > 1 and parts[1].startswith("/") else src
    mode = parts[-1] if parts[-1] in ("ro", "rw") and len(parts) > 1 else ""
    return posixpath.normpath(src), posixpath.normpath(dst), mode


def render(c: ContainerSpec, *, host_python: str, needed: list[tuple[str, str]], planned_env: list[str],
           run_dir: str, gpus_per_node: int) -> ContainerPlan:
    """The container for one job: ``needed`` are (host path, why) the tasks must see at the same
    path (the runs root, data, checkpoints, a host interpreter); ``planned_env`` the names the plan
    exports (passed in by name, as the spec's passthrough)."""
    mounts: list[dict[str, str]] = []
    seen: set[str] = set()
    for entry in c.mounts:
        src, dst, mode = _mount_parts(entry.path)
        mounts.append({"src": src, "dst": dst, "mode": mode, "why": entry.why})
        seen.add(dst)
    for path, why in needed:
        p = posixpath.normpath(path)
        if not any(p == d or p.startswith(d.rstrip("/") + "/") for d in seen):
            mounts.append({"src": p, "dst": p, "mode": "", "why": why})
            seen.add(p)
    env = sorted({*PASSED_FAMILIES, *(n for n in {*planned_env, *c.env}
                                      if not any(n.startswith(f[:-1]) for f in PASSED_FAMILIES))})
    flags = [{"flag": f.flag, "why": f.why} for f in c.flags]
    python = host_python if c.python == "auto" else (c.python or "python")
    workdir = c.workdir or run_dir
    notes: list[str] = []
    image = str(c.image)
    srun_args: list[str] = []
    prefix: list[str] = []
    binds = ",".join(m["src"] + (f":{m['dst']}" if m["dst"] != m["src"] or m["mode"] else "")
                     + (f":{m['mode']}" if m["mode"] else "") for m in mounts)
    if c.runtime == "pyxis":
        srun_args = [f"--container-image={_pyxis_image(image)}", f"--container-workdir={workdir}"]
        if mounts:  # pyxis takes SRC:DST[:FLAGS] only
            srun_args.append("--container-mounts=" + ",".join(
                f"{m['src']}:{m['dst']}" + (f":{m['mode']}" if m["mode"] else "") for m in mounts))
        srun_args.append(f"--container-env={','.join(sorted({*planned_env, *c.env}))}")
        srun_args += [f["flag"] for f in flags]
        notes.append("pyxis passes the task's environment into the container; --container-env makes the planned "
                     "variables win over the image's own")
    elif c.runtime == "apptainer":
        if gpus_per_node > 0 and not any(f["flag"] == "--nv" for f in flags):
            flags.insert(0, {"flag": "--nv", "why": "GPU nodes: the host's NVIDIA driver libraries and devices"})
        prefix = ["apptainer", "exec", *(f["flag"] for f in flags)]
        if binds:
            prefix += ["--bind", binds]
        prefix += ["--pwd", workdir, image]
        notes.append("apptainer passes the task's environment; the planned variables are also exported as "
                     "APPTAINERENV_* so that the image's own values do not win")
    else:
        if gpus_per_node > 0 and not any(f["flag"].startswith("--device") for f in flags):
            flags.insert(0, {"flag": "--device=nvidia.com/gpu=all",
                             "why": "GPU nodes: the GPUs through the NVIDIA container toolkit's CDI spec"})
        prefix = ["podman", "run", "--rm", "--network=host", "--ipc=host",
                  "--pid=host", *(f"--env={n}" for n in env)]
        prefix += [f"--volume={m['src']}:{m['dst']}" + (f":{m['mode']}" if m["mode"] else "") for m in mounts]
        prefix += [f"--workdir={workdir}", *(f["flag"] for f in flags), podman_image(image)]
        notes.append("podman shares the host's network (gloo/NCCL rendezvous), IPC (shared memory) and process ids "
                     "(signals, `lmlaunch stacks`); an earlier attempt's container of the same task is removed first")
    return ContainerPlan(runtime=str(c.runtime), image=image, python=python, mounts=mounts, env=env,
                         workdir=workdir, flags=flags, srun_args=srun_args, prefix=prefix, notes=notes)


def _pyxis_image(image: str) -> str:
    """pyxis/enroot write a registry as ``registry#name:tag``: docker://nvcr.io/x:t -> nvcr.io#x:t."""
    if image.startswith("docker://"):
        ref = image[len("docker://"):]
        host, _, rest = ref.partition("/")
        if rest and ("." in host or ":" in host or host == "localhost"):
            return f"{host}#{rest}"
        return ref
    return image


def podman_image(image: str) -> str:
    return image[len("docker://"):] if image.startswith("docker://") else image


def wrap(cp: ContainerPlan, inner: list[str]) -> list[str]:
    """``cp.python`` with ``inner`` run inside the container, as an argv on the host (pyxis: the
    argv itself, srun's options put it in the container)."""
    argv = [*shlex.split(cp.python), *inner]
    return argv if cp.runtime == "pyxis" else [*cp.prefix, *argv]


def trial_argv(cp: ContainerPlan, inner: list[str], exists: Callable[[str], bool]) -> list[str]:
    """:func:`wrap` for a try on the login node before anything exists: without the mounts whose
    source is not there yet and the working directory (the run directory before submission, inside
    the mounted runs root: a runtime would make it, writing where nothing was submitted). Pure:
    ``exists`` answers for a host path."""
    argv = wrap(cp, inner)
    if cp.runtime == "podman":
        return [a for a in argv if not a.startswith("--workdir=")
                and not (a.startswith("--volume=") and not exists(a.removeprefix("--volume=").split(":")[0]))]
    if cp.runtime != "apptainer":
        return argv
    out: list[str] = []
    words = iter(argv)
    for a in words:
        if a in ("--bind", "--pwd"):
            value = next(words, "")
            if a == "--bind":
                kept = [b for b in value.split(",") if exists(b.split(":")[0])]
                out += ["--bind", ",".join(kept)] if kept else []
            continue
        out.append(a)
    return out


