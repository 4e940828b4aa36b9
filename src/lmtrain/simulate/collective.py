"""The scale harness's collective (torch-free): a star of TCP connections on rank 0.

Rank 0 listens on the port its rendezvous published (``MASTER_PORT``: no process group uses it in
the harness); every other rank connects once and names itself. :meth:`Star.allreduce_max` is what
gloo's all-reduce with MAX does for the stop flags; :meth:`Star.barrier` is an all-reduce of
nothing. Lines of JSON, one per rank per round; rank 0 answers when it has every rank's.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

CONNECT_RETRY_S = 0.05


class CollectiveError(RuntimeError):
    """A rank did not join or answer in time, or its connection closed."""


class _Line:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.file = sock, sock.makefile("rb")

    def send(self, obj: Any) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def read(self) -> Any:
        raw = self.file.readline()
        if not raw:
            raise CollectiveError("a peer's connection closed")
        return json.loads(raw)

    def close(self) -> None:
        for part in (self.file, self.sock):
            try:
                part.close()
            except OSError:
                pass


class Star:
    """One per rank per attempt; ``timeout_s`` bounds the join and every round."""

    def __init__(self, rank: int, world_size: int, addr: str, port: int, *, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.peers: list[_Line] = []  # rank 0: ranks 1.., in rank order
        self.root: _Line | None = None  # the others: rank 0
        if world_size > 1:
            self._join(addr, port)

    def _join(self, addr: str, port: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        if self.rank == 0:
            server = socket.create_server(("", port), backlog=self.world_size, reuse_port=False)
            server.settimeout(self.timeout_s)
            by_rank: dict[int, _Line] = {}
            try:
                while len(by_rank) < self.world_size - 1:
                    server.settimeout(max(0.01, deadline - time.monotonic()))
                    try:
                        sock, _ = server.accept()
                    except TimeoutError:
                        raise CollectiveError(f"{self.world_size - 1 - len(by_rank)} rank(s) did not join rank 0 "
                                              f"within {self.timeout_s:.0f}s") from None
                    sock.settimeout(self.timeout_s)
                    line = _Line(sock)
                    by_rank[int(line.read()["rank"])] = line
            finally:
                server.close()
            self.peers = [by_rank[r] for r in sorted(by_rank)]
            return
        while True:
            try:
                sock = socket.create_connection((addr, port), timeout=self.timeout_s)
                break
            except OSError as exc:  # rank 0 not listening yet
                if time.monotonic() > deadline:
                    raise CollectiveError(f"rank {self.rank} could not reach rank 0 at {addr}:{port}: {exc}") from None
                time.sleep(CONNECT_RETRY_S)
        sock.settimeout(self.timeout_s)
        self.root = _Line(sock)
        self.root.send({"rank": self.rank})

    def allreduce_max(self, values: list[float]) -> list[float]:
        """Every rank gets the element-wise maximum of every rank's ``values``."""
        try:
            if self.root is not None:
                self.root.send(values)
                return [float(v) for v in self.root.read()]
            out = list(values)
            for peer in self.peers:
                out = [max(a, float(b)) for a, b in zip(out, peer.read(), strict=True)]
            for peer in self.peers:
                peer.send(out)
            return out
        except (OSError, ValueError, CollectiveError) as exc:
            self.close()  # the others learn at once, not at their timeout
            raise CollectiveError(f"rank {self.rank}: the all-reduce failed: {exc}") from None

    def barrier(self) -> None:
        self.allreduce_max([0.0])

    def close(self) -> None:
        for line in [*self.peers, *([self.root] if self.root else [])]:
            line.close()
        self.peers, self.root = [], None
