"""The way SLURM is reached in this context, as what the rest of lmlaunch needs to know of it.

Three ways: SLURM's commands here (the default cluster, or a profile's ``slurm_conf`` and
``slurm_bin``: lmcore.slurm.commands_target), the same commands in a login shell over SSH
(``CommandsTarget.login``), and slurmrestd (lmcore.slurm.rest). The way in force is chosen once, for a
command or a run, by launcher.planning.transport (from the profile and ``--rest``) and held in
lmcore.slurm.client's context; everything outside lmcore.slurm asks :func:`way` a question (can the
controller judge a script before it is queued, can it carry a heterogeneous job, how is a script
submitted) instead of branching on which way it is. A fourth way answers the same questions here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lmcore.errors import ExitCode, UserError
from lmcore.slurm import client, rest_calls
from lmcore.slurm.commands_target import CommandsTarget
from lmcore.slurm.rest import RestClient


@dataclass(frozen=True)
class Way:
    """The way in force: a slurmrestd, else SLURM's commands (``commands``: a cluster's own, or
    None for this machine's default)."""

    rest: RestClient | None
    commands: CommandsTarget | None

    @property
    def described(self) -> str:
        """For a status line: ``commands`` or ``slurmrestd URL``."""
        return "commands" if self.rest is None else f"slurmrestd {self.rest.target.url}"

    @property
    def where(self) -> str:
        """For a message: which SLURM answers."""
        if self.rest is not None:
            return self.rest.target.where
        return self.commands.where if self.commands is not None else "this cluster's SLURM"

    @property
    def submitted_note(self) -> str | None:
        """What submit says of the way it took, where it is not SLURM's commands."""
        if self.rest is None:
            return None
        return f"submitted through {self.rest.target.where}: API {self.rest.api()}, SLURM {self.rest.release or 'of unknown version'}"

    @property
    def tests_scripts(self) -> bool:
        """The controller judges a script before anything is queued (``sbatch --test-only``);
        slurmrestd judges it only when it is submitted."""
        return self.rest is None

    @property
    def reads_this_machines_config(self) -> bool:
        """Its SLURM_CONF and client commands are this machine's (what ``profile init`` records)."""
        return self.rest is None

    def needs_no_srun_here(self) -> bool:
        """Submitting needs no ``srun`` on this machine's PATH (submitit looks for one): slurmrestd,
        or a profile's own client commands that hold one."""
        return self.rest is not None or (self.commands is not None and client.has_command("srun"))

    def submission_command(self, script_path: str, *, client_timeout_s: float) -> list[str]:
        """The command that submits the script at ``script_path`` and prints sbatch's line
        (``Submitted batch job N``). Through slurmrestd the script is submitted here, in-process (its
        ``#SBATCH`` options as the job's fields: lmcore.slurm.rest_job), a refusal raised before
        anything claims a job; with commands, sbatch with a client-side limit (a controller that
        accepted the job but answers late must not block the caller forever)."""
        if self.rest is not None:
            return ["echo", f"Submitted batch job {client.sbatch_file(script_path)}"]
        return client.sbatch_command(script_path, client_timeout_s=client_timeout_s)

    @property
    def submits_arrays_in_process(self) -> bool:
        """A job array is submitted in-process as a single job is (not by sbatch)."""
        return self.rest is not None

    def check_carries(self, script: Callable[[], str], what: str, *, heterogeneous: bool = False) -> None:
        """Refuse, before anything changes, what this way cannot submit: a heterogeneous job, or a
        script option slurmrestd has no job field for (``what`` names the job in the message)."""
        if self.rest is None:
            return
        if heterogeneous:
            raise UserError("eval.alongside: a heterogeneous job (trainer + evaluator) cannot be submitted through "
                            "slurmrestd yet (its job_desc list is not built); submit with sbatch (the profile's "
                            "submit.via: sbatch, without --rest), or score the checkpoints after with `lmlaunch eval`",
                            exit_code=ExitCode.USAGE)
        rest_calls.body_of(self.rest, script(), what)


def way() -> Way:
    """The way SLURM is reached in this context."""
    return Way(client.rest_client(), client.commands_target())
