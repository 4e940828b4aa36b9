"""slurmrestd as a way to reach SLURM (lmcore.slurm.way): a cluster's REST API answers what its
commands would (lmcore.slurm.rest_calls, with the records the commands' path gives), and a batch
job is submitted here, in-process, the options it was rendered with sent as the job's fields
(lmcore.slurm.rest_job)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmcore.errors import ExitCode, UserError
from lmcore.slurm import rest_calls
from lmcore.slurm.batch_job import BatchJob
from lmcore.slurm.records import AccountedJob, QueuedJob
from lmcore.slurm.rest import RestClient


def _option(word: str) -> tuple[str, str]:
    name, _, value = word.removeprefix("--").partition("=")
    return name, value


class Rest:
    """A cluster's slurmrestd, through ``client``. The server's own limits answer for time: the
    ``timeout`` arguments are the commands'."""

    def __init__(self, client: RestClient) -> None:
        self.client = client

    # ----------------------------------------------------------------- the questions (lmcore.slurm.way)
    def ping(self, timeout: float) -> bool:
        return rest_calls.ping(self.client)  # its failure to answer is its own error

    def config(self, timeout: float) -> dict[str, str]:
        return rest_calls.config(self.client)

    def sacct(self, ids: list[str], *, duplicates: bool, steps: bool, timeout: float) -> list[AccountedJob]:
        return rest_calls.sacct(self.client, ids, duplicates)

    def show_job(self, job_id: str, timeout: float) -> dict[str, str] | None:
        return rest_calls.show_job(self.client, job_id)

    def cancel(self, ids: list[str], signal: str | None, timeout: float) -> None:
        rest_calls.cancel(self.client, ids, signal)

    def hold(self, job_id: str, release: bool, timeout: float) -> None:
        raise UserError("holding a job through slurmrestd is not built yet: hold and release it with SLURM's "
                        "commands (scontrol hold/release) on the cluster", exit_code=ExitCode.USAGE)

    def requeue(self, job_id: str, timeout: float) -> None:
        self.client.requeue(job_id)

    def squeue(self, ids: list[str] | None, name: str | None, user: str | None, timeout: float) -> list[QueuedJob]:
        return rest_calls.squeue(self.client, ids, name, user)

    def submitted_since(self, name: str, since: float, timeout: float) -> list[str]:
        return rest_calls.submitted_since(self.client, name, since)

    def submit_job(self, job: BatchJob, path: str, extra: Sequence[str], timeout: float) -> str:
        return rest_calls.submit_job(self.client, job, f"the job script {path}", [_option(e) for e in extra])

    # ----------------------------------------------------------------- what the way is
    tests_scripts = False  # the controller judges a job only when it is submitted
    reads_this_machines_config = False  # the cluster's SLURM_CONF and commands are not this machine's

    @property
    def described(self) -> str:
        return f"slurmrestd {self.client.target.url}"

    @property
    def where(self) -> str:
        return self.client.target.where

    @property
    def submitted_note(self) -> str | None:
        return (f"submitted through {self.client.target.where}: API {self.client.api()}, "
                f"SLURM {self.client.release or 'of unknown version'}")

    def needs_no_srun_here(self) -> bool:
        return True

    def submission_command(self, job: BatchJob, script_path: str, *, client_timeout_s: float) -> list[str]:
        """The job submitted here, in-process, before submitit's command runs (a refusal raised
        before anything claims a job); the command prints sbatch's line for submitit to read."""
        return ["echo", f"Submitted batch job {self.submit_job(job, script_path, (), client_timeout_s)}"]

    def check_carries(self, job: Callable[[], BatchJob], what: str) -> None:
        """Refuse, before anything changes, a heterogeneous job (its job_desc list is not built) or an
        option slurmrestd has no job field for (``what`` names the job in the message)."""
        rendered = job()
        if rendered.heterogeneous:
            raise UserError("eval.alongside: a heterogeneous job (trainer + evaluator) cannot be submitted through "
                            "slurmrestd yet (its job_desc list is not built); submit with sbatch (the profile's "
                            "submit.via: sbatch, without --rest), or score the checkpoints after with `lmlaunch eval`",
                            exit_code=ExitCode.USAGE)
        rest_calls.body_of(self.client, rendered, what)
