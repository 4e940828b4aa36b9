"""``lmlaunch stacks``, the pure part: the script one srun step runs on each node of a job, the
reading of that step's output back into one section per rank, and the sections as text.

On each node the script dumps every recorded task process of that node with py-spy (``py-spy
dump --pid``), found beside the task's own interpreter or else on PATH; each dump is framed by
marker lines carrying the rank and py-spy's exit status, and srun's ``--label`` keeps the nodes'
lines apart. Nothing here runs anything: :mod:`lmcore.slurm.client` runs the step.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from lmcore.run.rank_logs import srun_label
from lmcore.run.task_records import TaskRecord

MARK = "@@lmlaunch-stacks@@"
RC_NO_PYSPY = 127  # the node has no py-spy beside the task's python nor on PATH
RC_GONE = 3  # the process is no longer there
RC_TIMEOUT = 124  # coreutils timeout(1): the dump took longer than its limit
NATIVE_TRIES = 3  # py-spy's native unwinding fails now and then (libunwind's UNW_EINVAL): tries before Python only
_BEGIN = re.compile(rf"^{re.escape(MARK)} begin (\d+) (\S+)$")
_NOTE = re.compile(rf"^{re.escape(MARK)} note (.*)$")
_END = re.compile(rf"^{re.escape(MARK)} end (\d+) (-?\d+)$")

_DUMP = f"""\
export RUST_BACKTRACE=0
node="${{SLURMD_NODENAME:-$(hostname)}}"
spied() {{  # PID NATIVE: one py-spy dump, within what is left of this dump's time
  left=$((deadline - SECONDS)); [ "$left" -lt 1 ] && left=1
  to=""; command -v timeout >/dev/null && to="timeout -k 5 $left"
  $to "$spy" dump --pid "$1" $2 2>&1 </dev/null
}}
dump() {{  # RANK PID PYTHON
  echo "{MARK} begin $1 $node"
  if [ ! -d "/proc/$2" ]; then
    echo "process $2 is gone on $node (the task exited)"; rc={RC_GONE}
  else
    spy="$(dirname -- "$3")/py-spy"
    [ -x "$spy" ] || spy="$(command -v py-spy)"
    if [ -z "$spy" ]; then
      echo "py-spy is not installed on $node: not beside the task's python ($3) nor on PATH;" \\
           "install it into the run's environment (pip install py-spy)"; rc={RC_NO_PYSPY}
    else
      deadline=$((SECONDS + DUMP_TIMEOUT)); tries=0
      while :; do  # native unwinding can fail on what the thread is doing at that instant: again
        out="$(spied "$2" "$NATIVE")"; rc=$?; tries=$((tries + 1))
        {{ [ -z "$NATIVE" ] || [ "$rc" = 0 ] || [ "$rc" = {RC_TIMEOUT} ] || [ ! -d "/proc/$2" ] \\
          || [ "$tries" -ge {NATIVE_TRIES} ] || [ $((deadline - SECONDS)) -lt 2 ]; }} && break
      done
      if [ -n "$NATIVE" ] && [ "$rc" != 0 ] && [ "$rc" != {RC_TIMEOUT} ] && [ -d "/proc/$2" ] \\
         && [ $((deadline - SECONDS)) -ge 2 ]; then
        why="$(printf '%s\\n' "$out" | grep -v '^[[:space:]]*$' | tail -n 1)"
        if py="$(spied "$2" "")"; then  # the Python frames rather than nothing
          echo "{MARK} note native frames unavailable after $tries tries (py-spy: $why): Python frames only"
          out="$py"; rc=0
        else
          out="$out
without --native: $py"
        fi
      fi
      printf '%s\\n' "$out"
      [ "$rc" = {RC_TIMEOUT} ] && echo "py-spy did not finish within $DUMP_TIMEOUT s"
    fi
  fi
  echo "{MARK} end $1 $rc"
}}
"""


def node_script(records: Sequence[TaskRecord], *, native: bool = False, dump_timeout_s: int = 30) -> str:
    """The bash script every task of the step runs: the dumps of the records of its own node."""
    by_node: dict[str, list[TaskRecord]] = {}
    for r in sorted(records, key=lambda r: r.rank):
        by_node.setdefault(r.node, []).append(r)
    cases = "\n".join(
        f"  {shlex.quote(node)})\n"
        + "".join(f"    dump {r.rank} {r.pid} {shlex.quote(r.python)}\n" for r in recs)
        + "    ;;"
        for node, recs in by_node.items()
    )
    return (
        f"DUMP_TIMEOUT={int(dump_timeout_s)}\nNATIVE={'--native' if native else ''}\n{_DUMP}"
        f'case "$node" in\n{cases}\n  *) echo "{MARK} stray $node" ;;\nesac\nexit 0\n'
    )


@dataclass(frozen=True)
class Dump:
    """What one rank's dump printed, as read back from the step's output."""

    rank: int
    node: str
    returncode: int | None  # None: the end marker never came (the step was cut short)
    text: str
    note: str | None = None  # what the dump lacks, e.g. the native frames py-spy could not unwind


def parse_step_output(stdout: str) -> dict[int, Dump]:
    """Every rank's dump in the step's labelled output (lines of other tasks interleave)."""
    open_: dict[str, tuple[int, str, list[str], list[str]]] = {}  # srun task label -> (rank, node, lines, notes)
    out: dict[int, Dump] = {}

    def done(rank: int, node: str, rc: int | None, lines: list[str], notes: list[str]) -> None:
        out[rank] = Dump(rank, node, rc, "\n".join(lines).strip("\n"), "; ".join(notes) or None)

    for line in stdout.splitlines():
        task, text = srun_label(line)  # srun --label: " 0: text"
        label = "" if task is None else str(task)
        if b := _BEGIN.match(text):
            open_[label] = (int(b.group(1)), b.group(2), [], [])
        elif (e := _END.match(text)) and label in open_:
            rank, node, lines, notes = open_.pop(label)
            done(rank, node, int(e.group(2)), lines, notes)
        elif (n := _NOTE.match(text)) and label in open_:
            open_[label][3].append(n.group(1))
        elif label in open_:
            open_[label][2].append(text)
    for rank, node, lines, notes in open_.values():
        done(rank, node, None, lines, notes)
    return out


@dataclass(frozen=True)
class RankStack:
    """One rank's section: its stack, or why there is none."""

    rank: int
    node: str
    pid: int | None
    stack: str | None = None
    error: str | None = None
    note: str | None = None  # what the stack lacks (native frames py-spy could not unwind)

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "node": self.node, "pid": self.pid, "stack": self.stack, "error": self.error,
                "note": self.note}


def assemble(
    records: Sequence[TaskRecord],
    world_size: int,
    stdout: str,
    *,
    step_error: str | None = None,
) -> list[RankStack]:
    """One section per rank 0..world_size-1 (and any recorded beyond): the dump it got, or the
    reason it got none. ``step_error`` says why the srun step itself failed (its stderr)."""
    dumps = parse_step_output(stdout)
    by_rank = {r.rank: r for r in records}
    out = []
    for rank in sorted(set(range(world_size)) | set(by_rank)):
        rec = by_rank.get(rank)
        if rec is None:
            out.append(RankStack(rank, "?", None, error="this task left no record (it has not started its "
                                                          "entry yet, or it ran code from before `lmlaunch stacks`)"))
            continue
        d = dumps.get(rank)
        if d is None:
            why = f": {step_error}" if step_error else ""
            out.append(RankStack(rank, rec.node, rec.pid, error=f"no answer from node {rec.node}{why}"))
        elif d.returncode == 0 and d.text.strip():
            out.append(RankStack(rank, rec.node, rec.pid, stack=d.text, note=d.note))
        else:
            status = "cut short" if d.returncode is None else f"exit status {d.returncode}"
            detail = d.text.strip() or "no output"
            if d.returncode is None and step_error:
                detail += f"\n{step_error}"
            out.append(RankStack(rank, rec.node, rec.pid, error=f"{detail} ({status})"))
    return out


def header(s: RankStack) -> str:
    pid = f"pid {s.pid}" if s.pid is not None else "no pid"
    return f"== rank {s.rank} on {s.node} ({pid}) =="


def format_sections(stacks: Sequence[RankStack]) -> str:
    """The text ``lmlaunch stacks`` prints: a header line per rank, then its stack or its error."""
    parts = []
    for s in stacks:
        body = s.stack if s.stack is not None else "\n".join(f"error: {line}" if i == 0 else f"       {line}"
                                                             for i, line in enumerate((s.error or "").splitlines()))
        note = f"note: {s.note}\n" if s.note else ""
        parts.append(f"{header(s)}\n{note}{body.rstrip()}\n")
    return "\n".join(parts)


__all__ = ["MARK", "Dump", "RankStack", "assemble", "format_sections", "header", "node_script", "parse_step_output"]
