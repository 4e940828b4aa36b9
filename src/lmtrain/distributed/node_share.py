"""What the task agents of one node look at on the shared filesystem, looked at once per node.

Every rank's agent (lmtrain.task.agent) used to read rank 0's verdict file once a second while its
training process ran, and each rank stat'ed the run's profile request at every logging step: a
metadata operation per rank per second on Lustre or GPFS, 16,384 a second at 16,384 ranks
(docs/scale.md). Now one agent per node, the node's leader (SLURM local rank 0), looks at the shared
files and copies what changed into a directory of the node's own memory (``/dev/shm``, or
``LMLAUNCH_NODE_LOCAL``); the node's other agents and training processes read the copies there:

- rank 0's verdict (``rendezvous/<key>.next``): the leader copies it; rank 0's agent writes it there
  too, for its own node;
- the profile request (``profile-request.json``): the leader copies it at each look; a training
  process polls its node's copy (:data:`NODE_SHARE_VAR`, set by its agent);
- readiness for a restart in place: each agent says it is ready in the node's directory; the
  leader, once its whole node is, writes one file for the node (``ready/node-<N>``, its count of
  ready ranks) where rank 0's agent adds them up: files per node, not per rank.

In a container the node's tasks must see one ``/dev/shm`` (:func:`shares_dev_shm`). Rank 0 is the first task of node 0 (SLURM's block and cyclic distributions both place it so), so it
is node 0's leader and counts its own node's agents in the node's directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

NODE_SHARE_VAR = "LMLAUNCH_NODE_SHARE"  # a training process's: its node's shared directory
NODE_LOCAL_VAR = "LMLAUNCH_NODE_LOCAL"  # where node directories are made (default /dev/shm)


def shares_dev_shm(runtime: str | None) -> bool:
    """Whether a node's tasks see one /dev/shm: without a container; in podman's (``--ipc=host``,
    lmcore.job.container: checked on this machine) and apptainer's (the host's /dev bound by default).
    Pyxis (enroot) gives a container its own: the agents then each look at the shared files, as
    before node sharing."""
    return runtime in (None, "none", "podman", "apptainer")


def tasks_on_node(environ: Mapping[str, str], node_rank: int) -> int | None:
    """This step's number of tasks on node ``node_rank`` (SLURM_STEP_TASKS_PER_NODE, "4(x2),3"),
    None when SLURM did not say."""
    from hostlist import parse_slurm_tasks_per_node

    raw = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    try:
        counts = parse_slurm_tasks_per_node(raw)
    except Exception:  # not SLURM's notation: no sharing
        return None
    return int(counts[node_rank]) if 0 <= node_rank < len(counts) else None


@dataclass(frozen=True)
class NodeShare:
    dir: Path  # the node's own directory (node memory, not the shared filesystem)
    local_rank: int
    node_rank: int
    node_tasks: int
    job_prefix: str = ""  # the directory's name up to its batch mark: this job's on this host
    node_suffix: str = ""  # and from the node's name on

    @property
    def leader(self) -> bool:
        return self.local_rank == 0

    @classmethod
    def of_task(cls, environ: Mapping[str, str], job_id: str, batch: str) -> NodeShare | None:
        """This task's node share, or None where a task cannot know its node (no SLURM step)."""
        try:
            local, node = int(environ["SLURM_LOCALID"]), int(environ["SLURM_NODEID"])
        except (KeyError, ValueError):
            return None
        tasks = tasks_on_node(environ, node)
        name = environ.get("SLURMD_NODENAME") or ""
        if tasks is None or not name:
            return None
        base, prefix = Path(environ.get(NODE_LOCAL_VAR) or "/dev/shm"), f"lmlaunch-{os.getuid()}-{job_id}-b"
        return cls(base / f"{prefix}{batch or 0}-{name}", local, node, tasks, prefix, f"-{name}")

    # -- the leader's copies --------------------------------------------------------------------
    def copy(self, shared: Path, name: str) -> str | None:
        """The leader: ``shared``'s text, copied into the node's directory as ``name`` when it
        changed (one open of the shared file); None when it is not there."""
        try:
            text = shared.read_text()
        except OSError:
            return None
        local = self.dir / name
        try:
            if not local.is_file() or local.read_text() != text:
                self.put(name, text)
        except OSError:
            pass  # the node's copy is a convenience: the next look tries again
        return text

    def copy_if_changed(self, shared: Path, name: str, seen: dict[str, float]) -> None:
        """The leader: ``shared`` copied when its mtime changed since the last look (one stat)."""
        try:
            mtime = os.stat(shared).st_mtime
        except OSError:
            return
        if seen.get(name) == mtime:
            return
        seen[name] = mtime
        try:
            self.put(name, shared.read_text())
        except OSError:
            seen.pop(name, None)

    def put(self, name: str, text: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.dir / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, self.dir / name)

    def read(self, name: str) -> str | None:
        try:
            return (self.dir / name).read_text()
        except OSError:
            return None

    # -- readiness for a restart in place --------------------------------------------------------
    def say_ready(self, key: str) -> None:
        ready = self.dir / f"ready-{key}"
        ready.mkdir(parents=True, exist_ok=True)
        (ready / str(self.local_rank)).touch()

    def ready_here(self, key: str) -> int:
        """How many of this node's agents said they are ready (the leader not among them)."""
        try:
            return len(os.listdir(self.dir / f"ready-{key}"))
        except OSError:
            return 0

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def remove_earlier(self) -> list[Path]:
        """A leader at its start: this job's directories of earlier runs of its batch script on this
        node (a requeue or a restart by srun ends a step with SIGKILL, before its leader could remove
        its own); the ones removed."""
        prefix, suffix = self.job_prefix, self.node_suffix
        gone: list[Path] = []
        if not prefix or not suffix:
            return gone
        for old in self.dir.parent.glob(f"{prefix}*"):
            if old != self.dir and old.name.endswith(suffix) and old.name[len(prefix):-len(suffix)].replace("-", "").isdigit():
                shutil.rmtree(old, ignore_errors=True)
                gone.append(old)
        return gone


def node_ready_name(node_rank: int) -> str:
    return f"node-{node_rank}"


def ready_ranks(ready_dir: Path) -> int:
    """Rank 0's agent: the ranks the other nodes' leaders said are ready (each file holds its node's count)."""
    total = 0
    try:
        names = os.listdir(ready_dir)
    except OSError:
        return 0
    for name in names:
        try:
            total += int((ready_dir / name).read_text().strip() or 0)
        except (OSError, ValueError):
            continue  # being written: counted at the next look
    return total


def training_share(environ: Mapping[str, str], node_rank: int) -> tuple[Path, int] | None:
    """A training process's node share and its node's number of tasks, where its agent keeps one
    and SLURM says how many tasks the node runs (lmtrain.checkpoint.verify_exchange); else None."""
    share = environ.get(NODE_SHARE_VAR)
    tasks = tasks_on_node(environ, node_rank) if share else None
    return (Path(share), tasks) if share and tasks else None


def local_copy(shared: Path) -> Path:
    """What a training process polls for ``shared`` (the profile request): its node's copy when its
    agent keeps one, else the shared file itself."""
    share = os.environ.get(NODE_SHARE_VAR)
    return Path(share) / shared.name if share else shared
