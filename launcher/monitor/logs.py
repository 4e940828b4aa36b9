"""What ``lmlaunch logs`` prints: every attempt's log of a rank in order (following requeues and
restarts with ``-f`` until the run is over), or only its tracebacks and error lines."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from launcher.monitor import run_files
from lmcore import jsonlines
from lmcore.errors import UserError
from lmcore.run import rundir
from lmcore.slurm import client as slurm


def print_logs(
    run_dir: Path,
    job_ids: list[str],
    out: TextIO,
    *,
    rank: int = 0,
    attempt: int | None = None,
    errors: bool = False,
    follow: bool = False,
    finished: Callable[[], bool] = lambda: True,
    interval: float = 1.0,
    evaluator: bool = False,
) -> int:
    """Print every attempt's log in order with a marker line before each; with ``follow``, keep
    polling for new output and new attempts until ``finished()`` and nothing new arrived. With
    ``errors`` the evaluator's logs follow the rank's (eval.alongside); ``evaluator``: only them.
    Returns the number of files shown."""
    printer = _LogPrinter(run_dir, job_ids, out, rank=rank, attempt=attempt, errors=errors, follow=follow)
    printer.evaluator = evaluator
    printer.poll(final=not follow)
    if not follow:
        return len(printer.shown)
    quiet = 0
    while True:
        time.sleep(interval)
        grew = printer.poll(final=False)
        quiet = 0 if grew else quiet + 1
        if quiet >= 2 and finished():
            printer.end_line()
            return len(printer.shown)


class _LogPrinter:
    """A run's log files in order, each printed from where the last poll left it, a marker line
    before each new file; a last line without its newline waits for the rest (follow)."""

    def __init__(self, run_dir: Path, job_ids: list[str], out: TextIO, *, rank: int, attempt: int | None,
                 errors: bool, follow: bool) -> None:
        self.run_dir, self.job_ids, self.out = run_dir, job_ids, out
        self.rank, self.attempt, self.errors, self.follow = rank, attempt, errors, follow
        self.offsets: dict[Path, int] = {}
        self.evaluator = False  # only the evaluator's logs
        self.shown: list[Path] = []
        self.pending = ""
        self.partial: dict[Path, str] = {}  # a node log's line not yet whole

    def emit(self, text: str, final: bool) -> None:
        text = self.pending + text
        lines = text.split("\n")
        self.pending = "" if final else lines.pop()
        if final and lines and lines[-1] == "":
            lines.pop()
        if self.errors:
            lines = run_files.error_lines(lines)
        for line in lines:
            self.out.write(line + "\n")
        self.out.flush()

    def end_line(self) -> None:
        if self.pending:
            self.emit("\n", True)

    def poll(self, final: bool) -> bool:
        """Print what is new; whether anything was."""
        ledger = jsonlines.read_jsonl(rundir.RunLayout.of(self.run_dir).ledger)
        grew = False
        sources = run_files.evaluator_sources(self.run_dir, self.job_ids) if self.evaluator else \
            run_files.log_sources(self.run_dir, self.job_ids, rank=self.rank, attempt=self.attempt, evaluator=self.errors)
        for src in sources:
            if src.path not in self.offsets:
                self.end_line()
                self.out.write(run_files.attempt_marker(src.attempt, ledger, src.label) + "\n")
                self.offsets[src.path] = 0
                self.shown.append(src.path)
                grew = True
            try:
                with open(src.path, "rb") as f:
                    f.seek(self.offsets[src.path])
                    data = f.read()
            except OSError:
                continue
            if data:
                self.offsets[src.path] += len(data)
                text = data.decode("utf-8", errors="replace")
                if src.rank is not None:  # a node's file: this rank's whole lines, unmarked
                    lines = (self.partial.get(src.path, "") + text).split("\n")
                    self.partial[src.path] = lines.pop()
                    text = "".join(line + "\n" for line in src.take(lines))
                if text:
                    self.emit(text, final=not self.follow)
                grew = True
        return grew


def finished_check(run_dir: Path, job_ids: list[str], every_s: float = 5.0) -> Callable[[], bool]:
    """The run is over: DONE/CANCELLED marker, or SLURM says its job is neither queued nor running."""
    last: dict[str, Any] = {"t": 0.0, "v": False}

    def finished() -> bool:
        if rundir.RunLayout.of(run_dir).done.exists() or rundir.is_cancelled(run_dir):
            return True
        if time.monotonic() - last["t"] >= every_s and job_ids:

            last["t"] = time.monotonic()
            try:
                last["v"] = not slurm.active_jobs([job_ids[-1]])
            except UserError:
                last["v"] = False  # SLURM unreachable: keep following
        return last["v"]

    return finished
