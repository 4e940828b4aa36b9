"""A batch job as lmlaunch rendered it (pure; no I/O): the script's text, which sbatch reads, and
the options of its ``#SBATCH`` header as (long option, value) pairs, which slurmrestd is sent as the
job's fields (lmcore.slurm.rest_job). launcher.submit.script renders both from one list of options,
so that no way of reaching SLURM reads a script back."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Option = tuple[str, str]  # (sbatch's long option, its value; "" for a flag)


def options_of(pairs: Iterable[tuple[str, Any]]) -> tuple[Option, ...]:
    """``(option, value)`` pairs as a header holds them: True a flag (""), None or False left out,
    anything else its text."""
    return tuple((k, "" if v is True else str(v)) for k, v in pairs if v is not None and v is not False)


@dataclass(frozen=True)
class BatchJob:
    """A rendered batch job: ``text`` (the whole script, its header written from ``options``) and
    ``options`` (the header's, in order; a heterogeneous job's first component's, with
    ``heterogeneous`` set)."""

    text: str
    options: tuple[Option, ...]
    heterogeneous: bool = False
