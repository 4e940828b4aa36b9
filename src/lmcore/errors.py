"""Exit codes and the user-facing error type.

Every error a user can cause is a :class:`UserError`: one message that names the file, the
key path, the line, what is allowed and the closest match. The CLI prints it without a
traceback (unless ``LMLAUNCH_DEBUG=1``) and exits with its code.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1  # a command ran and failed (the job failed, a copy did not happen, ...)
    USAGE = 2  # the command line: arguments, options, a run, rank or job that does not exist
    UNAVAILABLE = 3  # SLURM is absent or its controller does not answer
    INVALID = 4  # the job spec, cluster profile or an override is invalid. Nothing was submitted.
    REFUSED = 5  # the cluster cannot run the job as asked (its controller says so). Nothing was queued.
    INTERRUPTED = 130
    BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (`... | head -1`)


EXIT_CODES: dict[ExitCode, str] = {  # what each exit status means (the CLI's --help and its reference say it)
    ExitCode.OK: "done",
    ExitCode.FAILURE: "a command ran and failed (the job failed, a copy or a cancel did not happen, a bug)",
    ExitCode.USAGE: "the command line: an unknown command or option, a bad argument, a run, rank or job that "
                    "does not exist; nothing was submitted",
    ExitCode.UNAVAILABLE: "SLURM is absent or its controller does not answer",
    ExitCode.INVALID: "the job spec, a cluster profile or an override is invalid (each problem with its key); "
                      "nothing was submitted",
    ExitCode.REFUSED: "the cluster cannot run the job as asked: more nodes, CPUs or GPUs than its partition has, "
                      "or sbatch refused it; nothing was queued",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
    ExitCode.BROKEN_PIPE: "the reader of the output went away (a pipe into head that ended)",
}

# The ``kind`` of a --json error for each exit code (any other: "failed"; a traceback: "bug")
ERROR_KINDS: dict[ExitCode, str] = {ExitCode.USAGE: "usage", ExitCode.INVALID: "invalid",
                                    ExitCode.UNAVAILABLE: "unavailable", ExitCode.REFUSED: "refused"}


class UserError(Exception):
    """An error caused by what the user wrote or asked for; printed without a traceback."""

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, message: str, *, exit_code: ExitCode | int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)

    @property
    def message(self) -> str:
        return str(self)


class SpecError(UserError):
    """One or more problems in a job spec, cluster profile or override (exit code 4, INVALID; a file
    that is not there or cannot be read: 2, USAGE, as any other argument naming nothing)."""

    def __init__(self, problems: list[str], *, source: str | None = None, exit_code: ExitCode = ExitCode.INVALID) -> None:
        self.problems = [_one_line(p) for p in problems]
        self.source = source
        head = f"{_one_line(source, 200)}: " if source else ""
        if len(self.problems) == 1:
            text = head + self.problems[0]
        else:
            text = head + f"{len(self.problems)} problems:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(text, exit_code=exit_code)


def _one_line(text: str, limit: int = 1000) -> str:
    """A problem as one printable line: control characters escaped, at most ``limit`` characters.

    Messages quote what the user wrote; a value holding "\n#SBATCH ..." or 5000 characters
    must not spread over the terminal."""
    from lmcore.text_rules import escape_controls  # here: text_rules loads pydantic, which `status` needs not

    text = escape_controls(text)
    if len(text) > limit:
        text = text[: limit - 30] + f"… ({len(text) - limit + 30} more characters)"
    return text


class SlurmUnavailable(UserError):
    """SLURM commands are missing or the controller does not answer (exit code 3)."""

    exit_code = ExitCode.UNAVAILABLE


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The closest valid spelling of ``word`` among ``choices``, or None."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    match = closest(word, choices)
    return f" (did you mean '{match}'?)" if match else ""
