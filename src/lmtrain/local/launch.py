"""The local multi-process launcher: N processes on this machine, the same entry as a SLURM task.

``lmlaunch run job.yaml --local --devices N`` writes a run directory like ``submit`` does (plan
made for 1 node x N tasks on CPU) and calls :func:`launch`, which starts ``python -m
lmtrain.task.entry RUN_DIR`` N times with the environment Lightning's LightningEnvironment reads
(RANK, LOCAL_RANK, NODE_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the plan's own
variables. Rank 0's output is streamed; every rank also writes its
``logs/attempt-<N>/rank-<R>.log``. If one process fails the others are stopped, and the exit
code of the first failure is returned.

No torch import here: the CLI imports this module.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

from lmcore.run.rundir import RunLayout
from lmtrain.distributed.task_env import free_port
from lmtrain.local.zygote import SHARED_ENV as ZYGOTE_ENV, Forked, Zygote, forkable

TERMINATE_GRACE_S = 15.0
PEERS_EXIT_S = 20.0  # after one rank failed: how long the others get to fail in a collective and say so


def planned_over(base: Mapping[str, str], plan_env: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the plan's variables over it, a PYTHONPATH ``base`` has kept after the plan's
    (a cluster's modules: the batch script's rule, launcher.submit.shell.INHERITED_AFTER)."""
    env = {**base, **plan_env}
    if base.get("PYTHONPATH") and "PYTHONPATH" in plan_env:
        env["PYTHONPATH"] = f"{plan_env['PYTHONPATH']}{os.pathsep}{base['PYTHONPATH']}"
    return env


def worker_env(
    rank: int,
    nprocs: int,
    *,
    port: int,
    job_id: str,
    plan_env: Mapping[str, str],
    base: Mapping[str, str] | None = None,
    threads: int = 1,
) -> dict[str, str]:
    """The environment of local rank ``rank``: SLURM's variables removed (this is not a SLURM
    task even inside an salloc shell), the plan's variables, and the rendezvous. A PYTHONPATH this
    process has (a cluster's modules) is kept after the plan's, as the batch script keeps it."""
    env = planned_over({k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")},
                       plan_env)
    env.update(
        {
            "LMTRAIN_LAUNCHER": "local",
            "LMTRAIN_JOB_ID": job_id,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def launch(
    run_dir: str | Path,
    nprocs: int,
    *,
    plan_env: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
    out: TextIO | None = None,
    threads_per_proc: int | None = None,
) -> int:
    """Run ``command`` (default: the lmtrain entry on ``run_dir``) in ``nprocs`` local processes."""
    run_dir = Path(run_dir)
    out = out or sys.stdout
    cmd = list(command) if command else [sys.executable, "-u", "-m", "lmtrain.task.entry", str(run_dir)]
    threads = threads_per_proc or max(1, (os.cpu_count() or 1) // nprocs)
    port = free_port("127.0.0.1")
    job_id = f"local-{os.getpid()}-{int(time.time())}"
    side_logs = RunLayout.of(run_dir).local_logs
    side_logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen | Forked] = []
    pump: threading.Thread | None = None
    envs = [worker_env(rank, nprocs, port=port, job_id=job_id, plan_env=plan_env or {}, threads=threads)
            for rank in range(nprocs)]
    zygote = _zygote_for(cmd, nprocs, envs[0], side_logs)
    try:
        for rank, env in enumerate(envs):
            if rank == 0:
                p = start_rank(zygote, cmd, env, run_dir, None)
                pump = threading.Thread(target=_pump, args=(p.stdout, out), daemon=True)
                pump.start()
            else:
                # Other ranks tee into their own rank log; this file keeps what came before it.
                with open(side_logs / f"rank-{rank}.out", "ab") as f:
                    p = start_rank(zygote, cmd, env, run_dir, f)
            procs.append(p)
        code = _wait_all(procs, on_first_failure=lambda rank, rc: _words_for(run_dir, rank, rc, procs[rank].pid))
    except KeyboardInterrupt:
        _terminate(procs)
        raise
    finally:
        if pump is not None:
            pump.join(timeout=5)
        if zygote is not None:
            zygote.close()
            if zygote.proc is not None:  # this launch's: its socket's directory goes too
                shutil.rmtree(Path(zygote.path).parent, ignore_errors=True)
            if zygote.refusals:  # why ranks started as plain processes after all
                with open(side_logs / "zygote.log", "a") as log:
                    log.writelines(f"plain process: {why}\n" for why in zygote.refusals)
    return code


def _zygote_for(cmd: Sequence[str], nprocs: int, env: Mapping[str, str], side_logs: Path) -> Zygote | None:
    """The ranks' zygote (lmtrain.local.zygote): the shared one LMTRAIN_ZYGOTE names, else one of this
    launch when it starts two or more ranks (one import instead of one per rank). LMTRAIN_ZYGOTE=off:
    plain processes."""
    if os.environ.get(ZYGOTE_ENV) == "off" or forkable(cmd) is None:
        return None
    shared = Zygote.shared()
    if shared is not None or nprocs < 2:
        return shared
    with open(side_logs / "zygote.log", "ab") as log:
        return Zygote.start(env, Path(tempfile.mkdtemp(prefix="lmtrain-zygote-")) / "sock", log=log)


def start_rank(zygote: Zygote | None, cmd: Sequence[str], env: Mapping[str, str], cwd: Path,
           log: BinaryIO | None) -> subprocess.Popen | Forked:
    """One rank: forked by the zygote when it can, else a plain process. ``log`` None: output on
    ``.stdout`` (text lines), else into ``log``."""
    if zygote is not None:
        read_end, write_end = os.pipe() if log is None else (-1, log.fileno())
        try:
            forked = zygote.fork(cmd, env, cwd, write_end, write_end)
        finally:
            if log is None:
                os.close(write_end)
        if forked is not None:
            if log is None:
                forked.stdout = open(read_end, encoding="utf-8", errors="replace")
            return forked
        if log is None:
            os.close(read_end)
    if log is None:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)


def _pump(stream: TextIO, out: TextIO) -> None:
    for line in stream:
        out.write(line)
        out.flush()


def _wait_all(procs: list[subprocess.Popen | Forked], on_first_failure: Callable[[int, int], None] | None = None) -> int:
    """Wait for every process; on the first failure stop the rest and return its code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            if on_first_failure is not None:
                on_first_failure(codes.index(failed[0]), failed[0])
            # the others fail in their next collective and write how the attempt ended: give
            # them that time before stopping them (a SIGTERM now would read as a preemption)
            deadline = time.monotonic() + PEERS_EXIT_S
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.2)
            _terminate(procs)
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _words_for(run_dir: Path, rank: int, code: int, pid: int) -> None:
    """The first rank to fail died of a signal (or exited without its own last words): say so for
    it, where rank 0 looks for the first death (lmtrain.preemption.first_death), before the others are stopped."""
    from lmcore.run.rundir import LastWords, Ledger

    attempt = Ledger(RunLayout.of(run_dir).ledger).next_attempt() - 1
    if attempt < 1:
        return
    try:
        LastWords.say_for(run_dir, attempt, rank=rank, node=socket.gethostname(), pid=pid, code=code,
                          source="local launcher")
    except OSError:
        pass


def _terminate(procs: list[subprocess.Popen | Forked]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
