"""The first death, not the survivors' symptom.

When one rank dies (the OOM killer's SIGKILL, a segfault, an exception), the others fail in
their next collective with an error that only says a peer went away ("Connection closed by
peer ... GLHF!"). Rank 0 writes the attempt's ledger ``end`` line, so before it does it looks
for who died first and how, from the best evidence there is:

1. the ranks' own last words (``lmcore.run.rundir.LastWords``: every rank that dies of a Python
   exception writes its last line; the local launcher writes the signal or exit code of a rank
   that died without a word);
2. SLURM's: srun writes ``srun: error: n2: task 1: Killed`` to the job's stderr the moment a
   task ends badly (and ``slurmstepd`` reports ``oom_kill`` events of the step's cgroup);
3. a rank with no words at all and no srun line: it vanished (SIGKILL, an OOM kill, a crash in
   native code), and is named as such.

:func:`attribute` is pure; :func:`find_first_death` gathers the evidence (waiting a few seconds
for it: the dead rank's launcher writes after the survivors noticed).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.run.rundir import LastWords

# What a surviving rank's error says when it only lost a peer (gloo, NCCL, c10d store).
SRUN_TASK = re.compile(r"srun: error: (?P<node>[\w.-]+): tasks? (?P<ranks>[\d,\-]+): (?P<what>.+?)\s*$")
OOM_EVENT = re.compile(r"Detected (?P<n>\d+) oom[-_]kill events?")
SIGNAL_WORDS = {"Killed": "SIGKILL", "Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
                "Terminated": "SIGTERM"}
WAIT_S = 5.0  # how long rank 0 waits for the dead rank's words or srun's line


@dataclass(frozen=True)
class SrunExit:
    node: str
    ranks: tuple[int, ...]
    what: str  # "Killed", "Segmentation fault", "Exited with exit code 1", ...


def _ranks(spec: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            out.extend(range(int(lo), int(hi) + 1) if hi.isdigit() else [int(lo)])
    return tuple(out)


def parse_srun(text: str) -> tuple[list[SrunExit], int]:
    """srun's task lines, in the order it wrote them, and how many OOM kill events SLURM saw."""
    exits = [SrunExit(m["node"], _ranks(m["ranks"]), m["what"]) for m in map(SRUN_TASK.search, text.splitlines()) if m]
    ooms = sum(int(m["n"]) for m in OOM_EVENT.finditer(text))
    return exits, ooms


def _how_srun(what: str, ooms: int) -> str:
    sig = SIGNAL_WORDS.get(what)
    if sig is None:
        return what[0].lower() + what[1:] if what else "ended"
    oom = f"; SLURM saw {ooms} OOM kill event(s) in the step: the OOM killer" if ooms and sig == "SIGKILL" else ""
    return f"killed by {sig}{oom}"


def attribute(words: list[LastWords], srun: list[SrunExit], ooms: int, *, world_size: int, me: int,
              node_of: dict[int, str]) -> dict[str, Any] | None:
    """Pure: who died first and how, or None when every rank only lost a peer or nothing is known."""
    by_rank = {w.rank: w for w in words}
    causes = sorted((w for w in words if not w.peer_lost), key=lambda w: w.time)
    if causes:
        w = causes[0]
        how = {"exception": f"Python exception: {w.detail}", "signal": f"killed by {w.detail}",
               "exit": w.detail}.get(w.how, w.detail)
        return {"rank": w.rank, "node": w.node or node_of.get(w.rank, "?"), "how": how,
                "source": "its own last words" if w.source == "rank" else f"the {w.source}"}
    for e in srun:
        for r in e.ranks:
            if r != me and (r not in by_rank or not e.what.startswith("Exited with exit code")):
                return {"rank": r, "node": e.node, "how": _how_srun(e.what, ooms), "source": f"srun: task {r}: {e.what}"}
    silent = [r for r in range(world_size) if r != me and r not in by_rank]
    if silent and words:  # the others only lost a peer: the silent rank is the one that vanished
        r = silent[0]
        more = f" (and {len(silent) - 1} more)" if len(silent) > 1 else ""
        return {"rank": r, "node": node_of.get(r, "?"), "source": "no last words",
                "how": f"ended without a word{more} (SIGKILL, an OOM kill or a crash in native code)"}
    return None


def describe(death: dict[str, Any]) -> str:
    return f"rank {death['rank']} on {death['node']} died first: {death['how']} ({death['source']})"


def log_size(path: str | Path | None) -> int:
    """Where this attempt's lines of the job's stderr start (a requeued job appends to it)."""
    try:
        return Path(path).stat().st_size if path is not None else 0
    except OSError:
        return 0


def _read_from(path: str | Path, offset: int, limit: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, f.seek(0, 2) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def find_first_death(run_dir: str | Path, attempt: int, *, world_size: int, me: int, node_of: dict[int, str],
                     srun_log: str | Path | None, srun_offset: int = 0,
                     wait_s: float = WAIT_S) -> dict[str, Any] | None:
    """Gather the evidence (up to ``wait_s`` for a rank's words or srun's line about this
    attempt: the job's stderr from ``srun_offset`` on) and attribute."""
    deadline = time.monotonic() + wait_s
    while True:
        words = LastWords.read_all(run_dir, attempt)
        text = _read_from(srun_log, srun_offset) if srun_log is not None else ""
        srun, ooms = parse_srun(text)
        heard = {w.rank for w in words} | {r for e in srun for r in e.ranks}
        settled = any(not w.peer_lost for w in words) or any(r != me for e in srun for r in e.ranks) or \
            all(r in heard for r in range(world_size))
        if settled or time.monotonic() >= deadline:
            return attribute(words, srun, ooms, world_size=world_size, me=me, node_of=node_of)
        time.sleep(0.2)
