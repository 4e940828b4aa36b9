"""The way SLURM is reached: what lmlaunch asks of SLURM (:class:`Way`), answered by each way.

Three ways: SLURM's commands here (the default cluster, or a profile's ``slurm_conf`` and
``slurm_bin``: lmcore.slurm.commands.Commands), the same commands in a login shell over SSH
(lmcore.slurm.commands.OverSsh) and slurmrestd (lmcore.slurm.rest_way.Rest). The way in force is
chosen once, for a command or a run, by launcher.planning.transport (from the profile and
``--rest``) and held in lmcore.slurm.client's context; lmcore.slurm.client's functions ask it, and
everything outside lmcore.slurm asks :func:`way` a question (can the controller judge a script
before it is queued, can it carry a heterogeneous job, how is a script submitted) instead of
branching on which way it is. A fourth way (a site's submission gateway) is a fourth class
with these methods, and the chooser's one line (lmcore.slurm.client.way_in_force).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from lmcore.slurm import client
from lmcore.slurm.batch_job import BatchJob
from lmcore.slurm.records import AccountedJob, QueuedJob


class Way(Protocol):
    """What lmlaunch asks SLURM, and what it needs to know of the way it asks. ``timeout``: how
    long a command may take (a way with its own limits may ignore it)."""

    # ------------------------------------------------------------------- questions and controls
    def ping(self, timeout: float) -> bool:
        """Whether the controller answers."""

    def config(self, timeout: float) -> dict[str, str]:
        """The controller's settings (``scontrol show config``'s keys)."""

    def sacct(self, ids: list[str], *, duplicates: bool, steps: bool, timeout: float) -> list[AccountedJob]:
        """Accounting rows of ``ids`` (with ``duplicates`` one per attempt; with ``steps`` their steps)."""

    def show_job(self, job_id: str, timeout: float) -> dict[str, str] | None:
        """The controller's record of a job (``scontrol show job``'s keys); None: forgotten."""

    def cancel(self, ids: list[str], signal: str | None, timeout: float) -> None:
        """Cancel the jobs, or send them ``signal``."""

    def hold(self, job_id: str, release: bool, timeout: float) -> None:
        """Hold a pending job, or ``release`` it."""

    def requeue(self, job_id: str, timeout: float) -> None:
        """Requeue a job (it restarts later with the same id)."""

    def squeue(self, ids: list[str] | None, name: str | None, user: str | None, timeout: float) -> list[QueuedJob]:
        """The jobs the controller knows now: ``ids`` in any state it remembers, else the active
        ones (called ``name``, of ``user``)."""

    def submitted_since(self, name: str, since: float, timeout: float) -> list[str]:
        """This user's jobs called ``name`` received since ``since``, oldest first."""

    def submit_job(self, job: BatchJob, path: str, extra: Sequence[str], timeout: float) -> str:
        """The rendered ``job`` submitted (its script already written at ``path``; ``extra``:
        sbatch's options); its job id."""

    # ------------------------------------------------------------------- what the way is
    @property
    def described(self) -> str:
        """For a status line: ``commands`` or ``slurmrestd URL``."""

    @property
    def where(self) -> str:
        """For a message: which SLURM answers."""

    @property
    def submitted_note(self) -> str | None:
        """What submit says of the way it took, where it is not SLURM's commands."""

    @property
    def tests_scripts(self) -> bool:
        """The controller judges a script before anything is queued (``sbatch --test-only``)."""

    @property
    def reads_this_machines_config(self) -> bool:
        """Its SLURM_CONF and client commands are this machine's (what ``profile init`` records)."""

    def needs_no_srun_here(self) -> bool:
        """Submitting needs no ``srun`` on this machine's PATH (submitit looks for one)."""

    def submission_command(self, job: BatchJob, script_path: str, *, client_timeout_s: float) -> list[str]:
        """The command that submits the rendered ``job`` (its script written at ``script_path``) and
        prints sbatch's line (``Submitted batch job N``)."""

    def check_carries(self, job: Callable[[], BatchJob], what: str) -> None:
        """Refuse, before anything changes, a rendered job this way cannot submit (``what`` names it)."""


def way() -> Way:
    """The way SLURM is reached in this context."""
    return client.way_in_force()
