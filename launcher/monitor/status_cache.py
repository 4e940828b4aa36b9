"""What `lmlaunch status` last read from each run directory, kept between calls.

A status refresh over many runs spent most of its time opening and parsing the same unchanged
files again (heartbeat tail, ledger, checkpoint pointer, markers, plan: 5 reads x 1000 runs).
The run directory stays the only truth: this cache holds, per run directory, the *identity* of
each file a row is built from (inode, size, mtime in ns; or absent) and a compact copy of what
was read. One ``stat`` per watched file tells whether the copy is current; only runs with a changed
file are read again. A file changed within the last ``RACY_S`` seconds is never cached: it may
change again within the file system's timestamp granularity without its identity moving.

The compact copy keeps exactly the lines ``monitor.build_row`` looks at (the last step line,
the last line with a step or max_steps, the last line, and the first step line of the last
attempt for the rate), so a row built from it is the row built from the full reading
(pinned by tests/unit/test_status_cache.py).

Stored at ``$LMLAUNCH_HOME/cache/run-files.json`` (private, rewritten atomically only when an
entry changed); a missing, corrupt or foreign-version file only costs one full reading.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher.monitor.eval_rows import Evaluation
from launcher.monitor.run_files import Checkpoint, RunFiles, read_run_files
from launcher.runs.registry import lmlaunch_home
from lmcore.atomic import write_private
from lmcore.run.eval_alongside import EVAL_DIR
from lmcore.run.rundir import HEARTBEAT, LEDGER, checkpoint_dir_of

CACHE_FILE = "cache/run-files.json"
VERSION = 9  # 5: every end line of the ledger (metrics counts them); 6: its straggler lines; 7: restarts in place, spares; 8: the start's nodes and their groups; 9: the evaluator alongside
RACY_S = 2.0
FEW = 32  # up to this many run directories are read directly when the cache is big (plain `status`
BIG_CACHE_BYTES = 1 << 20  # of thousands of mostly finished runs: ~1 KB per cached run)
# the files a status row is built from, relative to the run directory. "" is the directory
# itself: DONE, CANCELLED and plan.json are only ever created, removed or replaced by rename,
# each of which moves the directory's mtime, so they need no stat of their own.
# eval/: the evaluator's state is replaced by rename after every scored checkpoint's line, and its
# srun's exit record is removed at each start: both move the directory's mtime.
WATCHED = ("", HEARTBEAT, LEDGER, EVAL_DIR)  # and the checkpoint directory (the plan says where)
ROW_KEYS = ("time", "event", "step", "max_steps", "attempt", "loss", "tokens_per_s", "mfu", "documents", "tokens", "task", "error", "job_id")  # heartbeat keys build_row reads


def identity(run_dir: str, checkpoint_dir: str) -> tuple[list[Any], int] | None:
    """[(ino, size, mtime_ns) or None per watched file], newest mtime; None when unreadable.
    A checkpoint becomes the newest complete one by renames inside its directory (the
    directory's mtime moves), and ``latest`` is replaced last."""
    ident: list[Any] = []
    newest = 0
    paths = [os.path.join(run_dir, rel) if rel else run_dir for rel in WATCHED] + [checkpoint_dir]
    for i, path in enumerate(paths):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if i == 0:
                return [None] * len(paths), 0  # no run directory: nothing to read, nothing racy
            ident.append(None)
            continue
        except OSError:
            return None
        ident.append([st.st_ino, st.st_size, st.st_mtime_ns])
        newest = max(newest, st.st_mtime_ns)
    return ident, newest


def compact_heartbeat(beats: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The heartbeat lines build_row uses, in their order."""
    if not beats:
        return []
    keep: set[int] = {len(beats) - 1}
    for want in (lambda b: b.get("event") == "step",
                 lambda b: b.get("step") is not None,
                 lambda b: bool(b.get("max_steps")),
                 lambda b: bool(b.get("error"))):
        i = next((i for i in range(len(beats) - 1, -1, -1) if want(beats[i])), None)
        if i is not None:
            keep.add(i)
    steps = [i for i, b in enumerate(beats) if b.get("event") == "step" and b.get("step") is not None and b.get("time")]
    if steps:
        last = beats[steps[-1]].get("attempt")
        keep.add(steps[-1])
        keep.add(next(i for i in steps if beats[i].get("attempt") == last))
    return [{k: beats[i][k] for k in ROW_KEYS if k in beats[i]} for i in sorted(keep)]


STRAGGLER_KEYS = ("event", "attempt", "state", "rank", "node", "factor", "against", "step")


def compact_ledger(ledger: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's start, end and straggler lines in order (build_row counts attempts from the
    starts, reads the state of a job SLURM forgot from its last end and the slow ranks from the
    straggler lines; `metrics` counts the ends by reason) and its last ``eval`` line (an eval run's
    result), with the keys they read."""
    out: list[dict[str, Any]] = []
    for e in ledger:
        if e.get("event") == "start":
            start = {"event": "start", "attempt": e.get("attempt"), "job_id": e.get("job_id")}
            out.append({**start, **{k: e[k] for k in ("spares", "groups", "nodes", "world_size") if k in e}})
        elif e.get("event") == "end":
            out.append({"event": "end", "attempt": e.get("attempt"), "job_id": e.get("job_id"),
                        "reason": e.get("reason"), "requeued": e.get("requeued"),
                        "detail": str(e.get("detail") or "")[:200],
                        **{k: e[k] for k in ("end_step", "restart", "left_out") if k in e}})
        elif e.get("event") == "straggler":  # the slow ranks status shows (lmtrain.health.straggler_watch)
            out.append({k: e.get(k) for k in STRAGGLER_KEYS})
    evals = [e for e in ledger if e.get("event") == "eval"]
    if evals:
        out.append({k: evals[-1].get(k) for k in ("event", "step", "val_loss", "perplexity")})
    return out


def _to_json(f: RunFiles) -> dict[str, Any]:
    ck = f.checkpoint
    return {
        "heartbeat": compact_heartbeat(f.heartbeat),
        "ledger": compact_ledger(f.ledger),
        "checkpoint": [ck.step, ck.path, ck.mtime] if ck else None,
        "done": f.done,
        "cancelled": f.cancelled,
        "plan_time": f.plan_time,
        "exists": f.exists,
        "evaluation": f.evaluation.to_json() if f.evaluation is not None else None,
    }


def _from_json(d: Mapping[str, Any]) -> RunFiles:
    ck = d.get("checkpoint")
    return RunFiles(
        heartbeat=list(d["heartbeat"]),
        ledger=list(d["ledger"]),
        checkpoint=Checkpoint(int(ck[0]), str(ck[1]), float(ck[2])) if ck else None,
        done=bool(d["done"]),
        cancelled=bool(d["cancelled"]),
        plan_time=d.get("plan_time"),
        exists=bool(d["exists"]),
        evaluation=Evaluation.from_json(d["evaluation"]) if d.get("evaluation") else None,
    )


def _path(environ: Mapping[str, str] | None) -> Path:
    return lmlaunch_home(environ) / CACHE_FILE


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _load(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("runs"), dict):
        return {}
    return data["runs"]


def _save(path: Path, entries: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(path, json.dumps({"version": VERSION, "runs": entries}, separators=(",", ":")))
    except OSError:
        pass  # a cache that cannot be written only costs the next status a full reading


def read_all(run_dirs: Sequence[str], environ: Mapping[str, str] | None = None) -> list[RunFiles]:
    """RunFiles (with the plan's time limit) for each run directory, from the cache where every
    watched file is unchanged, read afresh otherwise. Entries of runs not asked about are kept
    (``status RUN`` must not empty the cache that ``status`` filled) while their directory
    exists; those of removed or archived directories are dropped."""
    path = _path(environ)
    if len(run_dirs) <= FEW and _size(path) > BIG_CACHE_BYTES:  # a few directories cost less to read
        return [read_run_files(Path(d), with_plan_time=True) for d in run_dirs]  # than a cache of thousands
    cached = _load(path)
    changed = False
    now_ns = time.time_ns()
    out: list[RunFiles] = []
    for run_dir in run_dirs:
        entry = cached.get(run_dir)
        # the plan names the checkpoint directory; a new plan moves the run directory's mtime
        ckpt_dir = entry.get("ckpt_dir") if isinstance(entry, dict) else None
        ckpt_dir = ckpt_dir if isinstance(ckpt_dir, str) else str(checkpoint_dir_of(run_dir))
        got = identity(run_dir, ckpt_dir)
        if got is not None and isinstance(entry, dict) and entry.get("id") == got[0]:
            try:
                out.append(_from_json(entry["files"]))
                continue
            except (KeyError, TypeError, ValueError, IndexError):
                pass  # a damaged entry: read afresh
        files = read_run_files(Path(run_dir), with_plan_time=True)
        out.append(files)
        if got is None or now_ns - got[1] < RACY_S * 1e9:
            if cached.pop(run_dir, None) is not None:
                changed = True
            continue
        cached[run_dir] = {"id": got[0], "ckpt_dir": ckpt_dir, "files": _to_json(files)}
        changed = True
    asked = set(run_dirs)
    for gone in [d for d in cached if d not in asked and not os.path.isdir(d)]:
        del cached[gone]
        changed = True
    if changed:
        _save(path, cached)
    return out
