"""A container's lines in the batch script, on the host (the SLURM relay the ranks inside use, the
image's identity, apptainer's variables), and the command srun starts in it for each task.
Pure: text only (launcher.submit.script and launcher.submit.hetjob render with it)."""

from __future__ import annotations

import shlex

from lmcore.job.container import PODMAN_TASK, ContainerPlan, podman_image, wrap
from lmcore.slurm.relay import RELAY_ENV, SCRIPT


def container_task_command(cp: ContainerPlan, inner: list[str]) -> str:
    """The command srun starts for each task: ``inner`` (the interpreter's arguments after
    ``cp.python``) inside the container, as one shell word list for the job script."""
    if cp.runtime != "podman":
        return shlex.join(wrap(cp, inner))
    # podman: a small script per task (in the run's code snapshot) names its container after the
    # job and the task, which the batch shell cannot (it would expand $SLURM_PROCID once for all)
    words = wrap(cp, inner)[2:]  # after "podman run"
    return f'/bin/bash "$LMLAUNCH_RUN_DIR/code/lmcore/job/{PODMAN_TASK}" ' + shlex.join(words)


def host_lines(cp: ContainerPlan, planned_env: list[str]) -> list[str]:
    """The batch script's lines on the host, before srun: the SLURM relay, the image's identity
    for the environment record (podman: its id; a file: sha256, kept beside the run while the
    file's size and time are unchanged), and for apptainer the planned variables made to win
    over the image's."""
    lines = start_lines()
    image = shlex.quote(podman_image(cp.image) if cp.runtime == "podman" else cp.image)
    if cp.runtime == "podman":
        lines.append(f"LMLAUNCH_IMAGE_ID=$(podman image inspect --format '{{{{.Id}}}}' {image} 2>/dev/null) "
                     "&& LMLAUNCH_IMAGE_ID=sha256:$LMLAUNCH_IMAGE_ID")
    elif cp.image.startswith("/"):  # a file: its sha256 (a registry reference: pulled at start, no id here)
        lines += [
            f"if [ -f {image} ]; then",
            f"  lmlaunch_key=$(stat -Lc '%n %s %Y' {image}); lmlaunch_sum=\"$LMLAUNCH_RUN_DIR/container-image.sha256\"",
            '  if [ "$(head -n1 "$lmlaunch_sum" 2>/dev/null)" != "$lmlaunch_key" ]; then',
            f"    {{ echo \"$lmlaunch_key\"; sha256sum < {image} | cut -d' ' -f1; }} > \"$lmlaunch_sum.tmp\" "
            '&& mv "$lmlaunch_sum.tmp" "$lmlaunch_sum"',
            "  fi",
            '  LMLAUNCH_IMAGE_ID=sha256:$(sed -n 2p "$lmlaunch_sum")',
            "fi",
        ]
    lines.append(f"export LMLAUNCH_IMAGE={shlex.quote(cp.runtime + ':' + cp.image)} "
                 '"LMLAUNCH_IMAGE_ID=${LMLAUNCH_IMAGE_ID:-unknown}"')
    if cp.runtime == "apptainer":
        lines += [f'export APPTAINERENV_{n}="${n}"' for n in planned_env]
    return lines


def start_lines() -> list[str]:
    """The batch script's lines (on the host, before srun) that start the relay for this job, in
    ``$LMLAUNCH_RUN_DIR/slurm-relay/$SLURM_JOB_ID`` (an array task's own run directory and id)."""
    return [
        "# the ranks run in a container without SLURM's commands: this host runs them (lmcore.slurm.relay)",
        f'export {RELAY_ENV}="$LMLAUNCH_RUN_DIR/slurm-relay/$SLURM_JOB_ID"',
        f'/bin/bash "$LMLAUNCH_RUN_DIR/code/lmcore/slurm/{SCRIPT}" "${RELAY_ENV}" $$ &',
        "lmlaunch_relay_pid=$!",
    ]


def stop_lines() -> list[str]:
    """The batch script's teardown after srun: the relay stopped, and the job's exit status kept
    srun's (a task step that failed, e.g. an image without the interpreter, is a FAILED job, not
    the relay's kill's 0 and a COMPLETED one)."""
    return ["lmlaunch_rc=$?  # srun's: the job's exit status",
            'kill -KILL "$lmlaunch_relay_pid" 2>/dev/null || true  # it ignores the job\'s signals',
            'exit "$lmlaunch_rc"']
