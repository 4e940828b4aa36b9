"""The ranks' logs: one file per node per attempt (``logs/attempt-<N>/node-<K>.log``), every line of it
its rank's, marked ``[rank R] `` at its start.

A rank's output (Python's stdout and stderr, and logging) is teed into its node's file by
:class:`NodeLogWriter`: whole lines only, each batch of them one ``O_APPEND`` write, so the node's
ranks never interleave inside a line (the timing lines' way, lmtrain.observe.timing_lines). At
16,384 ranks on 2,048 nodes that is 2,048 files an attempt, not 16,384 (docs/scale.md).

The readers take a rank's lines back without their mark (:func:`rank_lines`, :func:`split_by_rank`),
so what they show is what a rank's own file held. Runs written before keep a file per rank
(``rank-<R>.log``), read as they are.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

MARK = "[rank {rank}] "
_MARK = re.compile(r"\[rank (\d+)\] ")
NODE_LOG = "node-{node}.log"  # in logs/attempt-<N>/
RANK_LOG = "rank-{rank}.log"  # in logs/attempt-<N>/: a run of before (and a data preparation's array task)
PARTIAL_MAX = 8192  # a line held for its end longer than this is written as it stands


class NodeLogWriter:
    """A rank's share of its node's log: text in, whole lines out, each marked with the rank; the
    lines of one call (or of a line completed by it) go out in one write. Safe across threads."""

    def __init__(self, path: str | Path, rank: int) -> None:
        self.path, self.mark = Path(path), MARK.format(rank=rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            if len(self._partial) > PARTIAL_MAX:  # a progress bar redrawn with "\r" and no newline
                lines.append(self._partial)
                self._partial = ""
            if lines:
                self._out(lines)
        return len(text)

    def _out(self, lines: Sequence[str]) -> None:
        if self._fd is None:
            return
        data = "".join(f"{self.mark}{line}\n" for line in lines).encode("utf-8", errors="replace")
        try:
            os.write(self._fd, data)
        except OSError:
            pass  # a full disk: the task's own stderr still has it (lmtrain.observe.disk_space says why)

    def flush(self) -> None:
        """Lines are written as they complete; a partial line waits for its end (or for close)."""

    def close(self) -> None:
        with self._lock:
            if self._partial:
                self._out([self._partial])
                self._partial = ""
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def node_logs(attempt_dir: Path) -> list[Path]:
    """An attempt's node logs, by node index."""
    found = []
    for p in attempt_dir.glob(NODE_LOG.format(node="*")):
        index = p.name[len("node-"):-len(".log")]
        if index.isdigit():
            found.append((int(index), p))
    return [p for _, p in sorted(found)]


def marked_rank(line: str) -> tuple[int | None, str]:
    """(rank, the line without its mark); (None, line) for a line without one."""
    m = _MARK.match(line)
    return (int(m.group(1)), line[m.end():]) if m else (None, line)


def split_by_rank(lines: Iterable[str]) -> dict[int, list[str]]:
    """A node log's lines by rank, unmarked, in order."""
    out: dict[int, list[str]] = {}
    for line in lines:
        rank, text = marked_rank(line)
        if rank is not None:
            out.setdefault(rank, []).append(text)
    return out


def rank_lines(attempt_dir: Path, rank: int) -> list[str] | None:
    """Rank ``rank``'s lines in one attempt, unmarked: from the node logs, else its own file of a run
    of before; None when the attempt has neither."""
    logs = node_logs(attempt_dir)
    if logs:
        p = node_log_of(attempt_dir, rank)  # a rank lives on one node an attempt
        try:
            return take_rank(p.read_text(errors="replace").splitlines(), rank) if p else []
        except OSError:
            return []
    try:
        return (attempt_dir / RANK_LOG.format(rank=rank)).read_text(errors="replace").splitlines()
    except OSError:
        return None


def rank_text(attempt_dir: Path, rank: int) -> str:
    """Rank ``rank``'s log of one attempt as its own file held it ("" when there is none)."""
    lines = rank_lines(attempt_dir, rank)
    return "".join(line + "\n" for line in lines or [])


def ranks_texts(attempt_dir: Path) -> dict[int, list[str]]:
    """Every rank's lines of one attempt, unmarked (node logs, else the files of a run of before)."""
    out: dict[int, list[str]] = {}
    for p in node_logs(attempt_dir):
        try:
            for rank, lines in split_by_rank(p.read_text(errors="replace").splitlines()).items():
                out.setdefault(rank, []).extend(lines)
        except OSError:
            continue
    if out:
        return dict(sorted(out.items()))
    for p in attempt_dir.glob(RANK_LOG.format(rank="*")):
        index = p.name[len("rank-"):-len(".log")]
        if index.isdigit():
            try:
                out[int(index)] = p.read_text(errors="replace").splitlines()
            except OSError:
                continue
    return dict(sorted(out.items()))


# a rank's node log of an attempt once found, with the file's inode: a rank stays on its node for an
# attempt, and a run directory made again under the same name (`--new`) has files of other inodes
_FOUND: dict[tuple[Path, int], tuple[Path, int]] = {}


def node_log_of(attempt_dir: Path, rank: int, chunk: int = 1 << 20) -> Path | None:
    """The node log of ``attempt_dir`` that holds rank ``rank``'s lines (the nodes in order, each read
    only until the rank's mark is found); None when none does yet."""
    key = (attempt_dir, rank)
    if key in _FOUND:
        path, inode = _FOUND[key]
        try:
            if os.stat(path).st_ino == inode:
                return path
        except OSError:
            pass
        del _FOUND[key]
    found = _first_holding(node_logs(attempt_dir), re.escape(MARK.format(rank=rank).encode()), chunk)
    if found is None:
        return None
    _FOUND[key] = found
    return found[0]


def _first_holding(paths: Iterable[Path], line_start: bytes, chunk: int) -> tuple[Path, int] | None:
    """The first of ``paths`` with a line that starts with the pattern ``line_start`` (each file read
    only until one is found), and its inode; None when none has one."""
    pattern = re.compile(rb"(?:^|\n)" + line_start)
    for p in paths:
        try:
            with open(p, "rb") as f:
                tail = b""
                while block := f.read(chunk):
                    if pattern.search(tail + block):
                        return p, os.fstat(f.fileno()).st_ino
                    i = block.rfind(b"\n")  # the last line start, carried for a match split across blocks
                    tail = block[i:] if i >= 0 else b"\0"  # or none: the block is inside a line
        except OSError:
            continue
    return None


def take_rank(lines: Iterable[str], rank: int) -> list[str]:
    """The lines of ``lines`` that are rank ``rank``'s, unmarked."""
    mark = MARK.format(rank=rank)
    return [line[len(mark):] for line in lines if line.startswith(mark)]


# --------------------------------------------------------------------------- srun's own node files
_SRUN_LABEL = re.compile(r" *(\d+): ?")  # srun --label: "R: text", R space-padded to the step's widest


def srun_label(line: str) -> tuple[int | None, str]:
    """(task, the line without its label) of a line of srun ``--label`` output; (None, line) without one."""
    m = _SRUN_LABEL.match(line)
    return (int(m.group(1)), line[m.end():]) if m else (None, line)


def take_srun_task(lines: Iterable[str], task: int) -> list[str]:
    """The lines of an srun ``--label`` output that are task ``task``'s, without the label."""
    return [text for n, text in map(srun_label, lines) if n == task]


def srun_node_file_of(paths: Sequence[Path], task: int, chunk: int = 1 << 20) -> Path | None:
    """The first of ``paths`` (srun's ``--label`` files of one job, one per node) holding a line of
    task ``task``; None when none does."""
    found = _first_holding(paths, rb" *" + str(task).encode() + rb": ?", chunk)
    return found[0] if found else None
