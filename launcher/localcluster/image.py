"""The local cluster's container image, for jobs with ``container: {runtime: podman}``.

No image registry is reachable from this machine kind, so the image is built here, offline of any
registry: a Debian root made by ``debootstrap --variant=minbase`` from the machine's own release
and mirror, with the libraries this machine's Python needs (and nothing of SLURM: a job in it
must requeue through the host, lmcore.slurm.relay), imported with ``podman import``. The
interpreter and its venv are the host's, bind-mounted by the job (``container.python: auto``).

Podman itself runs here with ``runc`` and the cgroupfs manager and without default ulimits
(crun fails on this machine's hybrid cgroup layout and on setrlimit): those settings go into
/etc/containers/containers.conf when the file is absent or was written by lmlaunch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from launcher.localcluster.daemons import ClusterError, run_checked
from launcher.localcluster.debian_root import ROOTS, apt_mirror
from lmcore.errors import UserError

IMAGE = "localhost/lmlaunch/task:latest"
HOST_PACKAGES = ("podman", "runc", "debootstrap")
# what the machine's Python and torch load, and ps for the probes; no SLURM
IMAGE_PACKAGES = ("libffi8", "zlib1g", "libbz2-1.0", "liblzma5", "libsqlite3-0", "libexpat1", "libgomp1",
                  "procps", "ca-certificates")
RELEASE_PACKAGES = {"bookworm": ("libssl3",), "trixie": ("libssl3t64",)}
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
OUR_CONF = """# written by lmlaunch (launcher/localcluster/image.py): podman on this machine kind
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
Say = Callable[[str], None]


def release() -> str:
    """This machine's Debian release name (bookworm, trixie)."""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip().strip('"')
    raise ClusterError("/etc/os-release names no VERSION_CODENAME: not a Debian machine")


def image_exists(image: str = IMAGE) -> bool:
    if shutil.which("podman") is None:
        return False
    return subprocess.run(["podman", "image", "exists", image], capture_output=True, timeout=60).returncode == 0


def ensure_podman(say: Say) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    missing = [p for p, exe in zip(HOST_PACKAGES, ("podman", "runc", "debootstrap"), strict=True)
               if shutil.which(exe, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        if os.geteuid() != 0:
            raise UserError(f"podman's packages are missing ({' '.join(missing)}): as root run `lmlaunch cluster image`",
                            exit_code=1)
        say(f"installing {' '.join(missing)} (apt-get)")
        run_checked(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, "catatonit", "conmon",
                     "uidmap", "fuse-overlayfs", "slirp4netns"], "apt-get install podman", env=env, timeout=1200)
    if os.geteuid() == 0 and (not CONTAINERS_CONF.exists() or CONTAINERS_CONF.read_text().startswith("# written by lmlaunch")):
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        CONTAINERS_CONF.write_text(OUR_CONF)


def ensure_image(say: Say, image: str = IMAGE) -> str:
    """The task image, built once (about a minute of debootstrap and apt-get); its name."""
    ensure_podman(say)
    if image_exists(image):
        return image
    if os.geteuid() != 0:
        raise UserError("building the local cluster's task image needs root: as root run `lmlaunch cluster image`",
                        exit_code=1)
    rel = release()
    root = ROOTS / f"image-{rel}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    if not (root / "usr/bin/apt-get").exists():
        shutil.rmtree(root, ignore_errors=True)  # a half-made one from an interrupted run
        root.parent.mkdir(parents=True, exist_ok=True)
        say(f"making a Debian {rel} root for the image in {root} (debootstrap)")
        run_checked(["debootstrap", "--variant=minbase", rel, str(root), apt_mirror()], "debootstrap", env=env,
                    timeout=1200)
    packages = IMAGE_PACKAGES + RELEASE_PACKAGES.get(rel, ())
    say(f"installing {len(packages)} libraries in the image root (apt-get)")
    apt = ("mount -t proc proc /proc 2>/dev/null; apt-get update -qq && apt-get install -y -qq --no-install-recommends "
           + " ".join(packages) + "; rc=$?; apt-get clean; umount /proc 2>/dev/null; exit $rc")
    run_checked(["chroot", str(root), "/bin/sh", "-c", apt], f"apt-get install in {root}", env=env, timeout=1800)
    for leftover in ("usr/bin/scontrol", "usr/bin/srun"):
        if (root / leftover).exists():
            raise ClusterError(f"{root / leftover} exists: the task image must not hold SLURM's commands")
    say(f"importing {root} as {image} (podman import)")
    tar = subprocess.Popen(["tar", "-C", str(root), "--exclude=./proc/*", "--exclude=./sys/*", "--exclude=./dev/*",
                            "-c", "."], stdout=subprocess.PIPE)
    proc = subprocess.run(["podman", "import", "--change", "CMD=/bin/bash", "-", image], stdin=tar.stdout,
                          capture_output=True, text=True, timeout=1200)
    tar.wait(timeout=60)
    if proc.returncode != 0 or tar.returncode != 0:
        raise ClusterError(f"podman import of {root} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return image
