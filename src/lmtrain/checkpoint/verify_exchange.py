"""How the ranks' checks of a checkpoint reach rank 0 before a resume, and its verdict them
(lmtrain.checkpoint.resume_point), with no process group yet: files in the run's ``rendezvous/``.

Per node where the node's ranks share a directory in node memory (their agents' node share,
lmtrain.distributed.node_share): each rank puts its result there, the node's leader (local rank 0)
writes one file for the node (``<base>-<round>-node-<N>.json``: its ranks' count and problems),
and rank 0 adds them up until every rank is counted. The verdict is read from the shared
filesystem by each node's leader only, which copies it for its node. At 16,384 ranks on 2,048
nodes: 2,048 files a round, not 16,384, and 2,048 readers of the verdict, not 16,383.

Per rank otherwise (no node share: a local launch, pyxis): ``<base>-<round>-rank-<R>.json``, and
every rank reads the verdict.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lmcore.atomic import write_private
from lmtrain.checkpoint.completion import CheckpointError

POLL_S = 0.2


def wait_json(path: Path, wait_s: float, what: str = "the checkpoint check before resuming") -> dict[str, Any]:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        except (FileNotFoundError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise CheckpointError(f"{path.name} did not appear within {wait_s:.0f}s: did every rank start? "
                                      f"({what})") from None
            time.sleep(POLL_S)


class RankFiles:
    """One file per rank; every rank reads the verdict."""

    def __init__(self, base: Path, rank: int, world_size: int, wait_s: float) -> None:
        self.base, self.rank, self.world_size, self.wait_s = base, rank, world_size, wait_s

    def _verdict_path(self, round_: int) -> Path:
        return Path(f"{self.base}-{round_}.json")

    def publish(self, round_: int, result: dict[str, Any]) -> None:
        write_private(Path(f"{self.base}-{round_}-rank-{self.rank}.json"), json.dumps(result))

    def gather(self, round_: int) -> list[str]:
        """Rank 0: every rank's problems."""
        return [p for r in range(self.world_size)
                for p in wait_json(Path(f"{self.base}-{round_}-rank-{r}.json"), self.wait_s)["problems"]]

    def announce(self, round_: int, verdict: dict[str, Any]) -> None:
        write_private(self._verdict_path(round_), json.dumps(verdict))

    def verdict(self, round_: int) -> dict[str, Any]:
        return wait_json(self._verdict_path(round_), self.wait_s)


class NodeFiles(RankFiles):
    """One file per node through the node's share; the node's leader reads the verdict."""

    def __init__(self, base: Path, rank: int, world_size: int, wait_s: float, *, share: Path,
                 local_rank: int, node_rank: int, node_tasks: int) -> None:
        super().__init__(base, rank, world_size, wait_s)
        self.share, self.local_rank, self.node_rank, self.node_tasks = share, local_rank, node_rank, node_tasks

    def _local(self, round_: int, what: str) -> Path:
        return self.share / f"{self.base.name}-{round_}-{what}"

    def publish(self, round_: int, result: dict[str, Any]) -> None:
        self.share.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(self._local(round_, f"rank-{self.rank}.json"), json.dumps(result))
        if self.local_rank == 0:
            self._publish_node(round_)

    def _publish_node(self, round_: int) -> None:
        """The leader: once each of its node's ranks has put its result, one file for the node."""
        prefix = f"{self.base.name}-{round_}-rank-"
        deadline = time.monotonic() + self.wait_s
        while True:
            names = [n for n in os.listdir(self.share) if n.startswith(prefix) and n.endswith(".json")]
            if len(names) >= self.node_tasks:
                break
            if time.monotonic() > deadline:
                raise CheckpointError(f"{len(names)} of node {self.node_rank}'s {self.node_tasks} ranks checked "
                                      f"their share within {self.wait_s:.0f}s (the checkpoint check before resuming)")
            time.sleep(POLL_S / 4)
        problems = [p for n in sorted(names) for p in json.loads((self.share / n).read_text())["problems"]]
        write_private(Path(f"{self.base}-{round_}-node-{self.node_rank}.json"),
                      json.dumps({"ranks": len(names), "problems": problems}))

    def gather(self, round_: int) -> list[str]:
        """Rank 0: the nodes' files, until they count every rank."""
        prefix = f"{self.base.name}-{round_}-node-"
        seen: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + self.wait_s
        while sum(n["ranks"] for n in seen.values()) < self.world_size:
            for name in os.listdir(self.base.parent):
                if name.startswith(prefix) and name.endswith(".json") and name not in seen:
                    try:
                        seen[name] = json.loads((self.base.parent / name).read_text())
                    except (OSError, json.JSONDecodeError):
                        continue  # being written: read at the next look
            if sum(n["ranks"] for n in seen.values()) >= self.world_size:
                break
            if time.monotonic() > deadline:
                counted = sum(n["ranks"] for n in seen.values())
                raise CheckpointError(f"the nodes' checks counted {counted} of {self.world_size} ranks within "
                                      f"{self.wait_s:.0f}s: did every rank start? (the checkpoint check before resuming)")
            time.sleep(POLL_S)
        return [p for name in sorted(seen) for p in seen[name]["problems"]]

    def announce(self, round_: int, verdict: dict[str, Any]) -> None:
        super().announce(round_, verdict)
        write_private(self._local(round_, "verdict.json"), json.dumps(verdict))

    def verdict(self, round_: int) -> dict[str, Any]:
        local = self._local(round_, "verdict.json")
        if self.local_rank != 0:
            return wait_json(local, self.wait_s)
        verdict = super().verdict(round_)
        write_private(local, json.dumps(verdict))
        return verdict


def exchange_for(base: Path, env: Any, wait_s: float, node: tuple[Path, int] | None) -> RankFiles:
    """Per node where this rank's agent keeps a node share, ``node`` (its directory and its node's
    number of tasks: lmtrain.distributed.node_share.training_share); per rank otherwise."""
    if node is None:
        return RankFiles(base, env.rank, env.world_size, wait_s)
    share, node_tasks = node
    return NodeFiles(base, env.rank, env.world_size, wait_s, share=share, local_rank=env.local_rank,
                     node_rank=env.node_rank, node_tasks=node_tasks)
