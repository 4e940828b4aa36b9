"""`python -m lmtrain.health.node_probe`: what `lmlaunch doctor --on-nodes` runs on every node of a short
job (one task per node), after the profile's setup lines and with the plan's environment.

Each task measures its node (a GEMM, a memory copy, a write+fsync into the checkpoint
filesystem, the interfaces its ``*_SOCKET_IFNAME`` variables select), then all tasks time one
all-reduce together, and each prints one line ``MARK {json}`` (``lmcore.node_facts``).
The GEMM and the memory copy start together (a barrier on the job's store before each), so nodes
that share hardware are compared under the same load, and each is the best of COMPUTE_PASSES
short passes (a node starved for a moment by another process is not slow); the write+fsync takes turns in up to
WRITE_ROUNDS groups (a shared filesystem would otherwise charge one node's fsync with the others'
data), WRITE_PASSES times over, and a node's figure is its best pass: a disk is shared with
whatever else runs on the machine, and one pass caught by another process's flush measured a
healthy node at a third of its peer (215 against 660 MB/s), while a node that is really slow is
slow in every pass. Every figure is time-bounded: a few seconds per node in all.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmcore.node_facts import IFNAME_VARS, MARK, AllReduce, NodeFacts, select_interfaces
from lmtrain.distributed.task_env import TaskEnv, read_env, rendezvous

STORE_TIMEOUT_S = 120.0
WRITE_CHUNK = 4 << 20
WRITE_ROUNDS = 8  # the write+fsync measurement in up to 8 turns: a few seconds even on many nodes
WRITE_PASSES = 3  # each node's write+fsync figure is its best of 3 passes (below)
# The GEMM and the copy alike: the best of 3 passes of a third of --seconds each. One 1-s GEMM of
# a healthy node that other processes starved measured 1.6 against its peer's 33.7 GFLOP/s.
COMPUTE_PASSES = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_gflops(device: torch.device, seconds: float) -> float:
    """Square matmuls for about ``seconds``: 2 n^3 flops each (fp32 on CPU, bf16 on CUDA)."""
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)  # (n, n)
    b = torch.randn(n, n, device=device, dtype=dtype)  # (n, n)
    torch.matmul(a, b)  # warm-up: thread pool, kernels
    _sync(device)
    count, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        count += 1
        if count % 4 == 0:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * n**3 * count / elapsed / 1e9


def copy_gbps(device: torch.device, seconds: float, mb: int) -> float:
    """Copies of an ``mb`` MiB tensor into another for about ``seconds``: each reads and writes it."""
    src = torch.ones(mb << 18, device=device, dtype=torch.float32)  # (mb MiB / 4 bytes,)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    count, start = 0, time.perf_counter()
    while True:
        dst.copy_(src)
        count += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * src.numel() * 4 * count / elapsed / 1e9


def nearest_existing(path: Path) -> Path:
    """The checkpoint directory, or its nearest existing parent: creating the run's own
    directories before `submit` would make the run look submitted already."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_mbps(directory: Path, mb: int, node: str) -> float:
    """Write ``mb`` MiB (incompressible), fsync, delete; MB/s of write+fsync."""
    chunk = os.urandom(WRITE_CHUNK)
    path = directory / f".lmlaunch-node-probe-{node}-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(max(1, (mb << 20) // WRITE_CHUNK)):
            os.write(fd, chunk)
        os.fsync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return max(1, (mb << 20) // WRITE_CHUNK) * WRITE_CHUNK / elapsed / 1e6


class Barrier:
    """All tasks of the job reach the same point (on the store: no process group needed)."""

    def __init__(self, store: dist.Store, world: int) -> None:
        self.store, self.world, self.n = store, world, 0

    def __call__(self) -> None:
        self.n += 1
        key = f"barrier/{self.n}"
        self.store.add(key, 1)
        deadline = time.monotonic() + STORE_TIMEOUT_S
        while self.store.add(key, 0) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {self.n}: not every node arrived within {STORE_TIMEOUT_S:.0f} s")
            time.sleep(0.01)

    def leave(self, rank: int) -> None:
        """Rank 0 holds the store: it waits until every other task has left."""
        if rank:
            self.store.add("left", 1)
            return
        deadline = time.monotonic() + STORE_TIMEOUT_S
        while self.store.add("left", 0) < self.world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)


def all_reduce(store: dist.Store, rank: int, world: int, backend: str, device: torch.device, mb: int,
               iters: int, blocker: str | None) -> AllReduce:
    nbytes = mb << 20
    if world < 2:
        return AllReduce(backend, world, nbytes, None, None, skipped="one node: no network to measure")
    if blocker:
        return AllReduce(backend, world, nbytes, None, None, skipped=blocker)
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=STORE_TIMEOUT_S))
        x = torch.ones(nbytes // 4, device=device, dtype=torch.float32)  # (mb MiB / 4 bytes,)
        dist.all_reduce(x)  # warm-up: connections, buffers
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        _sync(device)
        seconds = (time.perf_counter() - start) / iters
        dist.destroy_process_group()
    except Exception as exc:  # reported, not raised: the node figures still come back
        return AllReduce(backend, world, nbytes, None, None, error=f"{type(exc).__name__}: {exc}")
    return AllReduce(backend, world, nbytes, seconds, 2 * (world - 1) / world * nbytes / seconds / 1e9)


def _best_of(barrier: Barrier, what: str, errors: dict[str, str], fn: Any, *args: Any) -> float | None:
    """COMPUTE_PASSES measurements, every node's starting together: the best (or None)."""
    figures = []
    for _ in range(COMPUTE_PASSES):
        barrier()
        figure = _measure(what, errors, fn, *args)
        figures += [figure] if figure is not None else []
    return max(figures) if figures and what not in errors else None


def _measure(what: str, errors: dict[str, str], fn: Any, *args: Any) -> float | None:
    try:
        return round(float(fn(*args)), 3)
    except Exception as exc:
        errors[what] = f"{type(exc).__name__}: {exc}"
        return None


def _write_turns(barrier: Barrier, env: TaskEnv, errors: dict[str, str], target: Path, write_mb: int,
                 node: str) -> float | None:
    """The best write figure of this rank. Writes take turns (WRITE_ROUNDS groups of ranks, one
    after the other): on a filesystem the nodes share, one node's fsync also flushes what the
    others wrote meanwhile (ext4's ordered journal), so simultaneous writes measured ~370 against
    ~1,900 MB/s on two nodes of one disk."""
    rounds = min(env.world_size, WRITE_ROUNDS)
    passes: list[float] = []
    for _ in range(WRITE_PASSES):
        for turn in range(rounds):
            if env.rank % rounds == turn:
                figure = _measure("write_mbps", errors, write_mbps, target, write_mb, node)
                passes += [figure] if figure is not None else []
            barrier()
    return max(passes) if passes and "write_mbps" not in errors else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmtrain.health.node_probe")
    p.add_argument("--workdir", required=True, help="a directory every node sees (the rendezvous file)")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--seconds", type=float, default=1.0, help="per compute figure")
    p.add_argument("--copy-mb", type=int, default=64)
    p.add_argument("--write-mb", type=int, default=64)
    p.add_argument("--allreduce-mb", type=int, default=16)
    p.add_argument("--allreduce-iters", type=int, default=5)
    a = p.parse_args(argv)

    env = read_env()
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    threads = int(os.environ.get("SLURM_CPUS_PER_TASK") or os.cpu_count() or 1)
    if cuda:
        torch.cuda.set_device(device)  # NCCL binds the current device
    else:
        torch.set_num_threads(threads)
    backend = "nccl" if cuda else "gloo"
    rv = rendezvous(env, a.workdir, attempt=1 if env.rank == 0 else None)
    store = dist.TCPStore(rv.addr, rv.port, env.world_size, env.rank == 0,
                          timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
    barrier = Barrier(store, env.world_size)
    errors: dict[str, str] = {}

    available = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    ifenv = {v: os.environ[v] for v in IFNAME_VARS if os.environ.get(v)}
    mine = next((v for v, lib in IFNAME_VARS.items() if lib == backend), "")
    # Every task says whether its backend's variable can work here; one that cannot would leave
    # the others waiting in init_process_group, so then nobody starts it.
    own = select_interfaces(mine, ifenv[mine], available) if mine in ifenv else None
    store.set(f"ifname/{env.rank}", "" if own is None or own.ok else f"{node}: {own.why}")

    gemm = _best_of(barrier, "gemm_gflops", errors, gemm_gflops, device, a.seconds / COMPUTE_PASSES)
    mem = _best_of(barrier, "mem_gbps", errors, copy_gbps, device, a.seconds / COMPUTE_PASSES, a.copy_mb)
    barrier()
    target = nearest_existing(Path(a.checkpoint_dir))
    write = _write_turns(barrier, env, errors, target, a.write_mb, node)
    blockers = [store.get(f"ifname/{r}").decode() for r in range(env.world_size)]
    blocker = next((b for b in blockers if b), None)
    ar = all_reduce(store, env.rank, env.world_size, backend, device, a.allreduce_mb, a.allreduce_iters,
                    f"{blocker}: the all-reduce was not tried" if blocker else None)
    facts = NodeFacts(
        node=node, rank=env.rank,
        device=f"cuda: {torch.cuda.get_device_name(device)}" if cuda else f"cpu ({torch.get_num_threads()} threads)",
        gemm_gflops=gemm, mem_gbps=mem, write_mbps=write, write_path=str(target),
        interfaces=tuple(available), ifname_env=ifenv, allreduce=ar, errors=errors,
    )
    print(MARK + json.dumps(facts.to_json()), flush=True)
    barrier.leave(env.rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
