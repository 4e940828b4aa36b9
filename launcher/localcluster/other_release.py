"""The local cluster on the other Debian release's SLURM (24.11 on Debian 12, 22.05 on Debian 13).

`up` makes the release's Debian root once (debian_root.py), writes the cluster's client wrappers
into ``<state>/bin`` and runs the ordinary `up` (cluster.py) inside the root, where that SLURM is
the native one: the same daemons, configuration, accounting and nodes, under its own state
directory and ports. `down` stops the daemons by their pid files from outside and unmounts the
root's shared paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from launcher.localcluster import debian_root
from launcher.localcluster.config import Layout, Settings, primary_root
from launcher.localcluster.daemons import ClusterError, flocked

Say = Callable[[str], None]
UP_TIMEOUT_S = 900  # a first `up` installs SLURM into the root and initialises MariaDB
RESULT = "lmlaunch-inside-result: "


def ensure_root(version: str, say: Say) -> Path:
    """``version``'s Debian root, made or completed once (one `up` at a time)."""
    with flocked(primary_root(version).parent / f".root-{version}.lock"):
        return debian_root.ensure_root(version, say)


def up(version: str, root: Path, layout: Layout, wanted: Settings, say: Say) -> bool:
    """Start ``version``'s cluster at ``layout`` as ``wanted`` in ``root`` (made by
    :func:`ensure_root`); True when it already ran so."""
    debian_root.write_wrappers(root, layout.bin)
    request = {"state": str(layout.root), "settings": json.loads(wanted.to_json())}
    argv = debian_root.inside(root, [sys.executable, "-m", "launcher.localcluster.inside", "up", json.dumps(request)])
    env = {**os.environ, "LMLAUNCH_CLUSTER_PRIMARY": str(primary_root(version)), "PYTHONUNBUFFERED": "1"}
    env.pop("SLURM_CONF", None)  # inside, the cluster's own (the layout's) is used
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    tail: list[str] = []
    was_up = None
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith(RESULT):
            was_up = bool(json.loads(line[len(RESULT):])["was_up"])
            continue
        tail = (tail + [line])[-30:]
        say(line)
    code = proc.wait(timeout=UP_TIMEOUT_S)
    if code != 0 or was_up is None:
        raise ClusterError(f"starting the SLURM {version} cluster in {root} failed (exit {code}):\n" + "\n".join(tail))
    return was_up


def start_daemon(version: str, layout: Layout, daemon: str, say: Say, node: str | None = None) -> None:
    """cluster.start_daemon of ``version``'s cluster at ``layout``, run inside its root."""
    root = debian_root.root_dir(version)
    request = {"state": str(layout.root), "daemon": daemon, "node": node}
    argv = debian_root.inside(root, [sys.executable, "-m", "launcher.localcluster.inside", "start", json.dumps(request)])
    env = {**os.environ, "LMLAUNCH_CLUSTER_PRIMARY": str(primary_root(version)), "PYTHONUNBUFFERED": "1"}
    env.pop("SLURM_CONF", None)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=UP_TIMEOUT_S, check=False)
    for line in proc.stdout.splitlines():
        say(line)
    if proc.returncode != 0:
        raise ClusterError(f"starting {daemon}{' ' + node if node else ''} of the SLURM {version} cluster in {root} "
                           f"failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")


def release_root(version: str, say: Say) -> None:
    """After `down` of ``version``'s primary cluster: the root's munged is stopped by then, so its
    mounts can go (`up` mounts them again)."""
    root = debian_root.root_dir(version)
    if root.exists() and os.geteuid() == 0:
        points = debian_root.unmount(root)
        if points:
            say(f"unmounted {len(points)} shared path(s) from {root}")

