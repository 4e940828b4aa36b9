"""`lmlaunch doctor` for a job that runs in a container (lmcore.job.container): the image, the
runtime, and the interpreter inside, checked on the login node where they can be. The nodes'
side is `doctor --on-nodes`, whose probe runs inside the container (launcher.doctor.nodes).

Facts are gathered by :func:`container_checks`; :func:`judge_image` and :func:`judge_runtime`
are pure."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from launcher.doctor.checks import FAIL, OK, WARN, Check
from lmcore.job.container import ContainerPlan, trial_argv, wrap
from lmcore.job.plan import LaunchPlan
from lmcore.slurm import client as slurm

INSIDE_TIMEOUT_S = 180.0
ON_NODES = "`lmlaunch doctor SPEC --on-nodes` runs the node probe inside the container on the nodes"


def judge_image(box: ContainerPlan, *, local_name_exists: bool | None, file_size: int | None) -> Check:
    """``local_name_exists``: podman knows the name here (None: not asked); ``file_size``: the
    image file's size (None: no such file)."""
    image = box.image
    if image.startswith("/"):
        if file_size is None:
            return Check("container image", FAIL, f"{image}: no such image file here (the nodes read the same path)")
        return Check("container image", OK, f"{image}: {file_size / 1e9:.2f} GB image file", {"bytes": file_size})
    if "://" in image or "#" in image:
        return Check("container image", OK, f"{image}: a registry reference, pulled by the nodes when the job "
                                            f"starts (not checked here; {ON_NODES})")
    if local_name_exists is None:
        return Check("container image", WARN, f"{image}: {box.runtime} is not on this machine to look the name up; "
                                              f"{ON_NODES}")
    if not local_name_exists:
        hint = " (the local cluster's: `lmlaunch cluster image`)" if image.startswith("localhost/lmlaunch/") else ""
        return Check("container image", FAIL, f"{image}: podman has no image of that name here{hint}")
    return Check("container image", OK, f"{image}: known to podman here")


def judge_runtime(box: ContainerPlan, *, command_here: bool) -> Check:
    what = {"pyxis": "srun's --container-image (the pyxis plugin)", "apptainer": "apptainer",
            "podman": "podman"}[box.runtime]
    if command_here:
        return Check("container runtime", OK, f"{what} is present here")
    return Check("container runtime", WARN, f"{what} is not present on this machine; the nodes may have it: {ON_NODES}")


def _pyxis_here() -> bool:
    return slurm.srun_has_option("--container-image")


def runtime_inside(plan: LaunchPlan, box: ContainerPlan) -> Check:
    """The interpreter inside the image imports the training stack (lmtrain itself comes from
    the run's code snapshot, mounted with the runs root)."""
    argv = wrap(box, ["-c", "import torch, lightning, transformers; print(torch.__version__)"])
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=INSIDE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Check("runtime", FAIL, f"`{box.python}` in {box.image} did not import the runtime within "
                                      f"{INSIDE_TIMEOUT_S:.0f} s")
    except OSError as exc:
        return Check("runtime", FAIL, f"{box.runtime} could not be started: {exc}")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return Check("runtime", FAIL, f"`{box.python}` in {box.image} cannot import the runtime: {last}")
    return Check("runtime", OK, f"`{box.python}` in {box.image} imports torch {proc.stdout.strip()}, lightning and "
                                "transformers")


def _image_check(box: ContainerPlan, here: bool) -> Check:
    exists = None
    if box.runtime == "podman" and here and not box.image.startswith("/"):
        name = box.image.removeprefix("docker://")
        exists = subprocess.run(["podman", "image", "exists", name], capture_output=True, timeout=60).returncode == 0
    path = Path(box.image)
    size = path.stat().st_size if box.image.startswith("/") and path.is_file() else None
    return judge_image(box, local_name_exists=exists, file_size=size)


def container_checks(plan: LaunchPlan) -> list[Check]:
    """Image, runtime and the interpreter inside, as far as this machine can tell."""
    box = ContainerPlan.from_json(plan.container or {})
    here = _pyxis_here() if box.runtime == "pyxis" else shutil.which(box.runtime) is not None
    checks = [_image_check(box, here), judge_runtime(box, command_here=here)]
    if box.runtime == "pyxis" or not here:
        checks.append(Check("runtime", WARN, f"the interpreter inside {box.image} is not tried here; {ON_NODES}"))
    elif checks[0].status != FAIL:
        checks.append(runtime_inside(plan, box))
    return checks


START_S = 60.0  # the most `submit` waits for the interpreter to start inside the image


def submit_notes(plan: LaunchPlan) -> list[str]:
    """What submit could not try of a container job here: a runtime this machine lacks (a login
    node without apptainer: the nodes must have it)."""
    if plan.container is None:
        return []
    box = ContainerPlan.from_json(plan.container)
    if box.runtime == "pyxis" or shutil.which(box.runtime) is not None:
        return []
    return [f"container.runtime {box.runtime} is not installed on this machine: its image and interpreter were not "
            f"tried here; the nodes must have it (`lmlaunch doctor SPEC` tries it there)"]


def submit_problems(plan: LaunchPlan) -> list[str]:
    """What ``submit`` refuses before queueing a container job (``--force`` submits anyway): an image
    the runtime here does not have, or an interpreter the image lacks (``python -c pass`` in it: a
    second or two; doctor imports the whole runtime). A task that cannot start its interpreter fails
    its job at once on the nodes; this says so before the queue wait. Where nothing can be tried
    here (pyxis, a runtime this machine lacks, an image pulled from a registry): nothing."""
    if plan.container is None:
        return []
    box = ContainerPlan.from_json(plan.container)
    if box.runtime == "pyxis" or shutil.which(box.runtime) is None:
        return []
    image = _image_check(box, True)
    if image.status == FAIL:
        return [f"container.image: {image.message}"]
    if "://" in box.image or "#" in box.image:  # pulled by the nodes: not fetched here
        return []
    try:
        argv = trial_argv(box, ["-c", "pass"], lambda path: Path(path).exists())
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=START_S, check=False)
    except subprocess.TimeoutExpired:  # slow here says nothing of the nodes
        return []
    except OSError as exc:
        return [f"container.runtime: {box.runtime} could not be started here: {exc}"]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [f"container.python: `{box.python}` does not start in {box.image} (exit {proc.returncode}): {last}"]
    return []
