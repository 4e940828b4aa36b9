"""`cluster up --gpus 4 | h100:4 | none`: GPUs that the local cluster's SLURM schedules for real on
nodes that have none (pure but for :func:`make_devices`).

Each node declares ``Gres=gpu:TYPE:N``; gres.conf (beside slurm.conf, ``AutoDetect=off``) names N
character devices per node under the cluster's state, ``<state>/gpus/<node>/nvidia0..N-1``. They
are /dev/null underneath (major 1, minor 3): slurmd refuses regular files ("not a valid character
or block device"), and a device number of the NVIDIA driver's would reach a real GPU on a machine
that has one. SLURM then allocates them as on a GPU cluster: it refuses more per node than declared
or another type, gives two jobs on one node disjoint GPUs, and sets each task's
``CUDA_VISIBLE_DEVICES`` / ``SLURM_STEP_GPUS`` by the binding asked for. Nothing can run CUDA on
them: jobs on such a cluster train on CPU behind the binding (a profile's ``gpus_simulated``).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TYPE = "h100"  # a type whose memory profile init knows, so the memory fit works on it
MAX_PER_NODE = 16
USAGE = "N or TYPE:N (N GPUs a node, 1 to 16; TYPE h100 when not given, e.g. a100:4), or none"
_SYNTAX = re.compile(r"(?:([a-z][a-z0-9_]*):)?(\d+)")
NULL_DEVICE = (1, 3)  # /dev/null's major and minor


@dataclass(frozen=True)
class LocalGpus:
    type: str
    per_node: int

    @property
    def text(self) -> str:
        return f"{self.type}:{self.per_node}"

    @property
    def gres(self) -> str:
        """A node's Gres= in slurm.conf."""
        return f"gpu:{self.type}:{self.per_node}"

    def device_files(self, state: Path, node: str) -> list[Path]:
        return [state / "gpus" / node / f"nvidia{k}" for k in range(self.per_node)]

    def render_gres_conf(self, state: Path, node_names: tuple[str, ...]) -> str:
        lines = ["# Written by `lmlaunch cluster up --gpus` (launcher/localcluster/gpus.py): fake GPUs,",
                 "# character devices that are /dev/null underneath; nothing runs CUDA on them.",
                 "AutoDetect=off"]
        for node in node_names:
            files = state / "gpus" / node / f"nvidia[0-{self.per_node - 1}]" if self.per_node > 1 else \
                self.device_files(state, node)[0]
            lines.append(f"NodeName={node} Name=gpu Type={self.type} File={files}")
        return "\n".join(lines) + "\n"


def parse(text: str | None) -> LocalGpus | None:
    """``--gpus`` as given (None or "none": a CPU-only cluster)."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    m = _SYNTAX.fullmatch(text.strip().lower())
    if not m:
        raise ValueError(f"--gpus {text!r}: expected {USAGE}")
    count = int(m.group(2))
    if not 1 <= count <= MAX_PER_NODE:
        raise ValueError(f"--gpus {text!r}: {count} GPUs a node; the local cluster's nodes take 1 to {MAX_PER_NODE}")
    return LocalGpus(m.group(1) or DEFAULT_TYPE, count)


def make_devices(gpus: LocalGpus | None, state: Path, node_names: tuple[str, ...]) -> list[Path]:
    """The device files gres.conf names (made as root; those of GPUs or nodes no longer declared
    are removed); the files made or kept. None: no GPUs, the directory goes."""
    top = state / "gpus"
    if gpus is None:
        remove_devices(state)
        return []
    wanted = {p for node in node_names for p in gpus.device_files(state, node)}
    if top.is_dir():
        for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir() and not any(w.is_relative_to(path) for w in wanted):
                shutil.rmtree(path)
            elif not path.is_dir() and path not in wanted:
                path.unlink()
    for path in sorted(wanted):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and stat.S_ISCHR(path.stat().st_mode):
            continue
        path.unlink(missing_ok=True)
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*NULL_DEVICE))
    return sorted(wanted)


def remove_devices(state: Path) -> bool:
    """`cluster down`: the fake devices go with the daemons; True when there were some."""
    top = state / "gpus"
    if not top.is_dir():
        return False
    shutil.rmtree(top)
    return True
