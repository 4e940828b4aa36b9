"""What a rank's process does to the run directory, counted by phase (the scale harness's counters).

Python-level and LD_PRELOAD-free: an audit hook (PEP 578) sees every ``open`` (the builtin's and
``os.open``), ``os.mkdir``, ``os.rename``/``os.replace``, ``os.remove``/``os.unlink``, ``os.rmdir``,
``os.listdir`` and ``os.scandir``; ``stat`` and ``lstat``, which raise no audit event, are wrapped in
``os`` and ``posix`` (pathlib, os.path and importlib look them up at each call: an import's stats of
the run's code snapshot count). Only paths under the run directory count.
The phase is what the rank is doing (:data:`PHASES`); the harness's step loop moves it. At exit each
process writes ``<counts_dir>/<job>-<rank>-<pid>.json`` (``simulate.counts_dir``, outside the run
directory, so the counts never count themselves): ``{"rank", "node", "job", "pid", "phases": {phase:
{op: n}}, "steps": {phase: n}}``. A forked process (the task agent's training process) starts from
zero. bench/scale.py adds them up.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

FRAMEWORKS = frozenset({"torch", "lightning", "transformers", "deepspeed"})  # what a harness rank must not import
PHASES = ("start", "step", "log_step", "checkpoint", "stop", "end", "agent", "agent_wait",
          "thread lmtrain-straggler-watch")  # and any other thread's, by its name
_EVENTS = {
    "open": "open", "os.mkdir": "mkdir", "os.rename": "rename", "os.replace": "rename", "os.remove": "remove",
    "os.unlink": "remove", "os.rmdir": "rmdir", "os.listdir": "listdir", "os.scandir": "listdir",
}


def path_kind(rel: str) -> str:
    """A path under the run directory with its numbers made N and the code snapshot's files one kind
    (``logs/attempt-N/rank-N.log``, ``code/*``)."""
    rel = rel.lstrip("/")
    if rel == "code" or rel.startswith("code/"):
        return "code/*"
    return re.sub(r"[0-9a-f]{16,}|\d+", "N", rel) or "."


class _Counts:
    def __init__(self) -> None:
        self.root = ""
        self.out: Path | None = None
        self.who: dict[str, Any] = {}
        self.phase = "start"
        self.ops: dict[str, Counter[str]] = {}
        self.paths: dict[str, Counter[str]] = {}  # phase -> "op kind-of-path" -> n: which files they were
        self.steps: Counter[str] = Counter()
        self.busy = threading.local()

    def reset(self) -> None:
        self.ops, self.paths, self.steps, self.phase = {}, {}, Counter(), "start"
        self.who = {**self.who, "pid": os.getpid()}

    def add(self, op: str, path: Any) -> None:
        if getattr(self.busy, "on", False):
            return
        try:
            text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
        except (TypeError, ValueError):
            return
        if text.startswith(self.root):
            # another thread's (rank 0's straggler watch) under its own name, not the step it runs beside
            thread = threading.current_thread()
            phase = self.phase if thread is threading.main_thread() else f"thread {thread.name}"
            self.ops.setdefault(phase, Counter())[op] += 1
            self.paths.setdefault(phase, Counter())[f"{op} {path_kind(text[len(self.root):])}"] += 1

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        op = _EVENTS.get(event)
        if op is None or not args:
            return
        if op == "open":
            mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            op = "open_write" if writes else "open_read"
        self.add(op, args[0])

    def write(self) -> None:
        if self.out is None:
            return
        self.busy.on = True
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            name = f"{self.who.get('job', '?')}-{self.who.get('rank', '?')}-{os.getpid()}.json"
            data = {**self.who, "pid": os.getpid(), "phases": {p: dict(c) for p, c in self.ops.items()},
                    "paths": {p: dict(c) for p, c in self.paths.items()},
                    "steps": dict(self.steps), "frameworks": sorted(FRAMEWORKS & set(sys.modules))}
            (self.out / name).write_text(json.dumps(data, sort_keys=True))
        except OSError as exc:
            print(f"lmtrain: could not write the filesystem counts: {exc}", file=sys.stderr)
        finally:
            self.busy.on = False


_COUNTS: _Counts | None = None


def install(run_dir: str | Path, counts_dir: str | Path, who: dict[str, Any]) -> None:
    """Count this process's operations under ``run_dir`` from now on (once per process)."""
    global _COUNTS
    if _COUNTS is not None:
        _COUNTS.who.update(who)
        return
    counts = _COUNTS = _Counts()
    counts.root, counts.out, counts.who = os.path.abspath(run_dir), Path(counts_dir), dict(who)
    sys.addaudithook(counts.hook)
    import posix  # importlib's stats call posix.stat, not os.stat

    for name in ("stat", "lstat"):
        real = getattr(os, name)

        def counted(path: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            counts.add("stat", path)
            return _real(path, *args, **kwargs)

        setattr(os, name, counted)
        setattr(posix, name, counted)
    os.register_at_fork(after_in_child=counts.reset)
    atexit.register(counts.write)


def install_from_plan(plan: dict[str, Any], role: str, phase_now: str, environ: Any = None) -> None:
    """:func:`install` when the plan's spec asks for counts (``simulate.counts_dir``), this SLURM
    task (``role``: task or agent) named from its environment; then the phase ``phase_now``."""
    sim = ((plan.get("spec") or {}).get("simulate") or {})
    if not sim.get("counts_dir"):
        return
    env = os.environ if environ is None else environ
    install((plan.get("paths") or {}).get("run_dir") or ".", sim["counts_dir"],
            {"rank": env.get("SLURM_PROCID"), "job": env.get("SLURM_JOB_ID"), "node": env.get("SLURMD_NODENAME"),
             "role": role})
    phase(phase_now)


def note(**fields: Any) -> None:
    """More of who this process is (its attempt, once the rendezvous said it)."""
    if _COUNTS is not None:
        _COUNTS.who.update(fields)


def phase(name: str) -> None:
    if _COUNTS is not None:
        _COUNTS.phase = name


def step_done(kind: str) -> None:
    """One step of ``kind`` (``step`` or ``log_step``) ended: its phase's step count."""
    if _COUNTS is not None:
        _COUNTS.steps[kind] += 1


def flush() -> None:
    """Write the counts now (a process that ends with os._exit runs no atexit)."""
    if _COUNTS is not None:
        _COUNTS.write()
