"""The zygote process (lmtrain.local.zygote has the why): imports the frameworks once, then forks each
local rank from itself on request and reports its exit; and the rules both sides apply.

Run as a script, ``python -u -P zygote_serve.py SOCKET`` (lmtrain.local.zygote.Zygote.spawn), so that it
imports nothing of lmtrain: a rank imports lmtrain from its own PYTHONPATH. Standard library only.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "lightning.pytorch", "transformers")
SHARED_ENV = "LMTRAIN_ZYGOTE"  # the socket of a zygote kept by the caller (tests), used when it is up
MAY_DIFFER = frozenset({
    "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH",
    "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME", "TOKENIZERS_PARALLELISM", "PWD", "OLDPWD", "_",
})
# DS_: DeepSpeed's (DS_ACCELERATOR, ...), read when deepspeed is imported, which the zygote never does
MAY_DIFFER_PREFIXES = ("LMTRAIN_", "LMLAUNCH_", "PYTEST_", "SLURM_", "NCCL_", "TORCH_NCCL_", "DS_")
NOT_PRELOADED = ("lmtrain", "launcher", "deepspeed")  # the zygote refuses to serve if an import pulled one in
START_TIMEOUT_S = 120.0


def differences(zygote_env: Mapping[str, str], env: Mapping[str, str], added: Mapping[str, str] | None = None) -> list[str]:
    """The variables whose difference forbids forking a process with ``env`` from the zygote.
    ``added``: what the zygote's imports set themselves (torch sets TORCHINDUCTOR_CACHE_DIR, ...);
    a process that imported those too has them, one that did not would get them from its imports."""
    added = added or {}
    keys = set(zygote_env) | set(env)
    return sorted(k for k in keys if zygote_env.get(k) != env.get(k)
                  and k not in MAY_DIFFER and not k.startswith(MAY_DIFFER_PREFIXES)
                  and not (k in added and env.get(k) in (None, added[k])))


def forkable(cmd: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``python [-u] -m MODULE ARGS`` or ``python [-u] SCRIPT ARGS`` with this interpreter:
    ("module" | "script", target, args); anything else None (started as a plain process)."""
    if not cmd or cmd[0] != sys.executable:
        return None
    rest = list(cmd[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return "script", rest[0], rest[1:]
    return None


def serve(path: str) -> int:
    """Import :data:`PRELOAD`, say ``ready`` on stdout, then fork ranks on request until stdin
    closes. Single-threaded: requests, exits and stdin are polled in one loop."""
    import importlib

    # Listening before the imports: a client that connects meanwhile waits for its answer.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    env = dict(os.environ)  # what the imports saw; requests are compared with it
    # The collector paused while they load, what they made frozen after (as
    # lmtrain.observe.startup.imports_without_gc does for a task; this script imports no lmtrain): a third
    # less CPU, and a forked rank's collections leave the preloaded objects alone.
    gc.disable()
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        gc.freeze()
        gc.enable()
    # what the imports set themselves (torch sets TORCHINDUCTOR_CACHE_DIR, ...): a fresh rank gets it too
    added = {k: v for k, v in os.environ.items() if k not in env}
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    ours = [m for m in NOT_PRELOADED if m in sys.modules]
    if threads != 1 or ours:
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
        print(f"not serving: {threads} threads after the imports {names}, preloaded {ours}", file=sys.stderr)
        listener.close()
        Path(path).unlink(missing_ok=True)
        return 1
    base_path = [p for p in sys.path if p]  # -P: no script directory; PYTHONPATH was left out
    # Ctrl-C in the launcher's terminal reaches the whole process group: the ranks act on it (the
    # launcher then stops them); the zygote lives on to report their exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("ready", flush=True)
    conns: dict[socket.socket, bytes] = {}
    children: dict[int, socket.socket] = {}
    stdin_open = True
    while stdin_open or children:
        watch: list[Any] = [listener, *conns] + ([sys.stdin] if stdin_open else [])
        ready, _, _ = select.select(watch, [], [], 0.1)
        for r in ready:
            if r is sys.stdin:
                if not sys.stdin.readline():
                    stdin_open = False
            elif r is listener:
                conn, _ = listener.accept()
                conns[conn] = b""
            else:
                _serve_one(r, conns, children, listener, env, added, base_path)
        _reap(children)
        if not stdin_open and not children:
            break
    listener.close()
    return 0


def _serve_one(conn: Any, conns: dict[Any, bytes], children: dict[int, Any], listener: Any, env: dict[str, str],
               added: Any, base_path: Any) -> None:
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
    except OSError:
        msg, fds = b"", []
    if not msg:
        conns.pop(conn, None)
        conn.close()
        return
    conns[conn] += msg
    if b"\n" not in conns[conn]:
        for fd in fds:
            os.close(fd)
        return
    request = json.loads(conns.pop(conn).split(b"\n", 1)[0])
    if request.get("hello"):
        conn.sendall(json.dumps({"executable": sys.executable, "env": env, "added": added}).encode() + b"\n")
        conn.close()
        return
    diff = differences(env, request["env"], added)
    if len(fds) != 2 or diff:
        conn.sendall(json.dumps({"refused": f"environment differs in {diff}" if diff else "no descriptors"}).encode() + b"\n")
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    try:
        pid = os.fork()
    except OSError as exc:  # no memory or processes left: the launcher starts a plain process
        conn.sendall(json.dumps({"refused": f"fork failed: {exc}"}).encode() + b"\n")
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    if pid == 0:
        for other in (listener, conn, *conns):
            other.close()
        _become(request, fds, added, base_path)  # never returns
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except OSError:
            pass
        conn.close()


def _become(request: dict, fds: list[int], added: dict[str, str], base_path: list[str]) -> None:
    """In the forked child: take the request's descriptors, environment, directory, path and
    argv, run its command, and exit as the interpreter would."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update({**added, **request["env"]})
        os.chdir(request["cwd"])
        kind, target, args = forkable(request["argv"]) or ("", "", [])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        first = os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(target))
        sys.path[:] = [first, *extra, *base_path]
        sys.argv[:] = [target, *args]
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
        _after_fork_in_rank()
        code = _run(kind, target)
    finally:
        _exit_like_the_interpreter(code)


def _after_fork_in_rank() -> None:
    """What the preloaded frameworks read from the environment at import and a rank needs as its own."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    for name in ("lightning.fabric.utilities.rank_zero", "lightning_utilities.core.rank_zero",
                 "lightning.pytorch.utilities.rank_zero"):
        module = sys.modules.get(name)
        guard = getattr(module, "rank_zero_only", None)
        if guard is not None and hasattr(guard, "rank"):
            guard.rank = next((int(os.environ[k]) for k in ("RANK", "LOCAL_RANK") if os.environ.get(k, "").isdigit()), 0)


def _run(kind: str, target: str) -> int:
    import runpy
    import traceback

    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit_like_the_interpreter(code: int) -> None:
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at exit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code & 0xFF)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
