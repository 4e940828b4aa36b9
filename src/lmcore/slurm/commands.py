"""SLURM's commands as a way to reach SLURM (lmcore.slurm.way): on this machine (:class:`Commands`,
with a profile's SLURM_CONF and client directory, or this machine's own), or in a login shell over
SSH (:class:`OverSsh`, a cluster of a run over several). Every command has a timeout; an answer is
parsed into the records lmcore.slurm.records holds; a SLURM that is missing or down is
:class:`lmcore.errors.SlurmUnavailable` (exit code 3) with one message saying what to do.

A rank in a container, which has no SLURM commands, runs them on the host through the batch
step's relay (lmcore.slurm.relay) whichever way its job was submitted.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lmcore.errors import ExitCode, SlurmUnavailable, UserError
from lmcore.slurm import relay as slurm_relay
from lmcore.slurm.batch_job import BatchJob
from lmcore.slurm.commands_target import CommandsTarget
from lmcore.slurm.records import AccountedJob, QueuedJob, het_component, het_leader
from lmcore.slurm.ssh import SSH_FAILED

DEFAULT_TIMEOUT_S = 30.0
FIELD_SEP = "\x1f"  # unit separator: never part of a job name, node list or reason

# What the messages of the SLURM clients say when the controller or the config is missing.
DOWN_MARKERS = (
    "Unable to contact slurm controller",
    "Connection refused",
    "Could not establish a configuration source",
    "Socket timed out",
    "Zero Bytes were transmitted",
    "Unable to establish connection",
)
NO_ACCOUNTING_MARKERS = (
    "Slurm accounting storage is disabled",  # the cluster keeps none (AccountingStorageType=none)
    "Problem talking to the database",
    "slurmdbd: Connection refused",
)
NO_ACCOUNTING_NOTE = ("this cluster keeps no job accounting (sacct: accounting storage is disabled): the state of a "
                      "job the controller has forgotten (after MinJobAge) comes from its run directory, and queue "
                      "waits and SLURM's own end states are not known")
LOCAL_CLUSTER_CONF_CANDIDATES = (
    Path("/var/lib/lmlaunch-cluster/etc/slurm.conf"),
    Path.home() / ".lmlaunch" / "cluster" / "etc" / "slurm.conf",
)


class NoAccounting(SlurmUnavailable):
    """The cluster runs without accounting: sacct can never answer (not a slurmdbd that is down)."""


# --------------------------------------------------------------------------- SLURM's notations


def parse_time(text: str | None) -> float | None:
    """SLURM's local time (``2026-11-23T09:33:13``, as squeue/sacct/scontrol print it) -> epoch
    seconds; ``Unknown``, ``None``, ``N/A`` and anything else -> None."""
    try:
        return time.mktime(time.strptime((text or "").strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


# sbatch --time's forms, bounded (a job spec's text goes through here too)
_DURATION = re.compile(
    r"(?:(?P<d>\d{1,4})-(?P<dh>\d{1,2})(?::(?P<dm>\d{1,2})(?::(?P<ds>\d{1,2}))?)?"
    r"|(?P<h>\d{1,5}):(?P<m>\d{1,2}):(?P<s>\d{1,2})"
    r"|(?P<mm>\d{1,7}):(?P<ss>\d{1,2})"
    r"|(?P<only_m>\d{1,7}))"
)


def parse_duration(text: str | None) -> float | None:
    """A SLURM duration in seconds: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS`` (sbatch --time's forms; squeue/sacct/scontrol print the last three; a bare
    number is minutes). ``UNLIMITED``, ``INVALID``, ``Partition_Limit`` and anything else -> None."""
    m = _DURATION.fullmatch(text or "")  # no strip: a job spec's "20:00\n" is not a time
    if m is None:
        return None
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "d" in g:
        return float(g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0))
    if "h" in g:
        return float(g["h"] * 3600 + g["m"] * 60 + g["s"])
    if "mm" in g:
        return float(g["mm"] * 60 + g["ss"])
    return float(g["only_m"] * 60)


def says_controller_down(message: str) -> bool:
    """Whether a SLURM client's message says the controller (or its configuration) is not there.
    Not a step daemon that refused (`scontrol listpids` on a node whose slurmstepd died: "Unable to
    connect to slurmstepd: Connection refused"): that step is gone, the controller may be fine."""
    if "slurmstepd" in message:
        return False
    return any(m in message for m in DOWN_MARKERS)


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def rows(stdout: str, n_fields: int) -> list[list[str]]:
    """Lines of ``FIELD_SEP``-separated fields; a line of another count is skipped (a line wrapped
    by a name we do not expect), never mis-assigned."""
    out = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        parts = line.split(FIELD_SEP)
        if len(parts) == n_fields:
            out.append([p.strip() for p in parts])
    return out


def key_values(text: str) -> dict[str, str]:
    """Parse scontrol's one-line `Key=Value Key=Value` output (values have no spaces, except a
    few trailing fields such as Command/WorkDir which scontrol prints last)."""
    out: dict[str, str] = {}
    key = None
    for token in text.strip().split(" "):
        if "=" in token and not token.startswith("="):
            key, value = token.split("=", 1)
            out[key] = value
        elif key is not None and token:
            out[key] += " " + token
    return out


def user_name() -> str:
    """The user SLURM knows this process as: its real uid's name (SLURM maps the uid it is given;
    $USER may be unset, as under some shells and services, or name someone else)."""
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (a container): SLURM accepts the number
        return str(os.getuid())


def missing(cmd: str) -> SlurmUnavailable:
    return SlurmUnavailable(
        f"SLURM command '{cmd}' not found on PATH: this machine has no SLURM client. "
        "Install it (Debian: apt-get install slurm-client) or start the local cluster with "
        "`lmlaunch cluster up` (as root it installs slurm-wlm itself)."
    )


SACCT_FIELDS = ["JobID", "JobName", "State", "ExitCode", "Start", "End", "Elapsed", "NodeList", "Partition", "Submit",
                "AllocTRES"]
SQUEUE_FIELDS = ["JobID", "Name", "State", "Reason", "RestartCnt", "TimeLimit", "NumNodes", "TimeUsed",
                 "NodeList", "Partition", "UserName", "StartTime", "SubmitTime", "ArrayJobID", "ArrayTaskID",
                 "HetJobID", "HetJobOffset"]


class Commands:
    """SLURM's commands on this machine: ``target``'s (a profile's SLURM_CONF and client
    directory), or this machine's own (None)."""

    def __init__(self, target: CommandsTarget | None = None) -> None:
        self.target = target

    # ----------------------------------------------------------------- running one command
    def env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for SLURM clients: the target's SLURM_CONF and commands first; else
        SLURM_CONF kept if set, or, when there is no /etc/slurm/slurm.conf but the local cluster
        wrote one, pointed at it (a non-root `lmlaunch cluster up` cannot install it in /etc)."""
        env = dict(os.environ if environ is None else environ)
        if self.target is not None and (self.target.conf or self.target.bin):
            return self.target.environ(env)  # that cluster's, whatever this shell points at
        if "SLURM_CONF" not in env and not Path("/etc/slurm/slurm.conf").exists():
            for cand in LOCAL_CLUSTER_CONF_CANDIDATES:
                if cand.exists():
                    env["SLURM_CONF"] = str(cand)
                    break
        return env

    def which(self, command: str) -> str | None:
        """Where ``command`` is for this cluster (its profile's slurm_bin first)."""
        return shutil.which(command, path=self.env().get("PATH"))

    def execute(self, cmd: list[str], *, timeout: float, input: str | None) -> subprocess.CompletedProcess[str]:
        """``cmd`` run here with this cluster's environment."""
        exe = self.which(cmd[0])
        if exe is None:
            raise missing(cmd[0])
        return subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout,
                              env=self.env(), input=input)

    def run(self, args: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run one SLURM client command; SlurmUnavailable when SLURM is missing or down. With
        ``check``, any other non-zero exit raises UserError (exit code 1) with SLURM's message."""
        cmd = list(args)
        relay = os.environ.get(slurm_relay.RELAY_ENV)
        try:
            if relay:  # a rank in a container: the batch step runs the command on the host
                proc = slurm_relay.call(relay, cmd, timeout=timeout, input=input)
            else:
                proc = self.execute(cmd, timeout=timeout, input=input)
        except slurm_relay.RelayError as exc:
            raise SlurmUnavailable(f"`{cmd[0]}` could not be relayed to the host: {exc}") from None
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(
                f"`{' '.join(cmd)}` did not answer within {timeout:.0f} s: the SLURM controller is "
                "overloaded or down (local cluster: `lmlaunch cluster status`)"
            ) from None
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip()
            if says_controller_down(msg):
                raise SlurmUnavailable(
                    f"the SLURM controller does not answer (`{cmd[0]}`: {first_line(msg)}). "
                    "Local cluster: start it with `lmlaunch cluster up`."
                )
            if check:
                raise UserError(f"`{' '.join(cmd)}` failed: {msg or f'exit code {proc.returncode}'}",
                                exit_code=ExitCode.FAILURE)
        return proc

    # ----------------------------------------------------------------- the questions (lmcore.slurm.way)
    def ping(self, timeout: float) -> bool:
        try:
            proc = self.run(["scontrol", "ping"], timeout=timeout, check=False)
        except SlurmUnavailable:
            return False
        return proc.returncode == 0 and "UP" in proc.stdout

    def config(self, timeout: float) -> dict[str, str]:
        proc = self.run(["scontrol", "show", "config"], timeout=timeout)
        out: dict[str, str] = {}
        for line in proc.stdout.splitlines():
            if " = " in line:
                k, v = line.split(" = ", 1)
                out[k.strip()] = v.strip()
        return out

    def sacct(self, ids: list[str], *, duplicates: bool, steps: bool, timeout: float) -> list[AccountedJob]:
        cmd = ["sacct", "-n", "-P", f"--delimiter={FIELD_SEP}", f"--format={','.join(SACCT_FIELDS)}", "-j", ",".join(ids)]
        cmd += [] if steps else ["-X"]
        cmd += ["-D"] if duplicates else []
        proc = self.run(cmd, timeout=timeout, check=False)
        if proc.returncode != 0:
            msg = proc.stderr.strip()
            if NO_ACCOUNTING_MARKERS[0] in msg:
                raise NoAccounting(NO_ACCOUNTING_NOTE)
            if any(m in msg for m in NO_ACCOUNTING_MARKERS):
                raise SlurmUnavailable(
                    f"SLURM accounting does not answer (`sacct`: {first_line(msg)}); job states after "
                    "completion need slurmdbd. Local cluster: `lmlaunch cluster up` starts it."
                )
            raise UserError(f"`{' '.join(cmd)}` failed: {msg}", exit_code=ExitCode.FAILURE)
        return [AccountedJob(het_leader(row[0]), *row[1:]) for row in rows(proc.stdout, len(SACCT_FIELDS))]

    def show_job(self, job_id: str, timeout: float) -> dict[str, str] | None:
        proc = self.run(["scontrol", "-o", "show", "job", job_id], timeout=timeout, check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise UserError(f"`scontrol show job {job_id}` failed: {proc.stderr.strip()}", exit_code=ExitCode.FAILURE)
        return key_values(proc.stdout.splitlines()[0]) if proc.stdout.strip() else None

    def cancel(self, ids: list[str], signal: str | None, timeout: float) -> None:
        self.run(["scancel", *([f"--signal={signal}"] if signal else []), *ids], timeout=timeout)

    def hold(self, job_id: str, release: bool, timeout: float) -> None:
        self.run(["scontrol", "release" if release else "hold", job_id], timeout=timeout)

    def requeue(self, job_id: str, timeout: float) -> None:
        self.run(["scontrol", "requeue", job_id], timeout=timeout)

    def squeue(self, ids: list[str] | None, name: str | None, user: str | None, timeout: float) -> list[QueuedJob]:
        fmt = ",".join(f"{f}:{FIELD_SEP}" for f in SQUEUE_FIELDS)  # `Field:suffix`: unpadded, separated
        cmd = ["squeue", "-h", "-r", "-O", fmt]  # -r: an array's pending tasks one per line, as A_i
        cmd += ["--states=all", "-j", ",".join(ids)] if ids is not None else []
        cmd += ["-n", name] if name is not None else []
        cmd += ["-u", user] if user is not None else []
        proc = self.run(cmd, timeout=timeout, check=False)
        if proc.returncode != 0:
            # squeue -j with only unknown (long gone) ids exits 1 with "Invalid job id specified"
            if "Invalid job id" in proc.stderr:
                return []
            what = f"squeue -O ... -j <{len(ids)} ids>" if ids else " ".join(cmd)
            raise UserError(f"`{what}` failed: {proc.stderr.strip()}", exit_code=ExitCode.FAILURE)
        return [_queued(parts) for parts in (
            [p.strip() for p in line.split(FIELD_SEP)] for line in proc.stdout.splitlines())
            if len(parts) >= len(SQUEUE_FIELDS)]

    def submitted_since(self, name: str, since: float, timeout: float) -> list[str]:
        fmt = ",".join(f"{f}:{FIELD_SEP}" for f in ("JobID", "SubmitTime", "Name", "HetJobOffset"))
        proc = self.run(["squeue", "-h", "--states=all", "-u", user_name(), "-n", name, "-O", fmt], timeout=timeout)
        found: list[tuple[float, str]] = []
        for line in proc.stdout.splitlines():
            parts = [p.strip() for p in line.split(FIELD_SEP)]
            # a heterogeneous job's other components (their own JobIDs) are not jobs sbatch returned
            if len(parts) < 4 or parts[2] != name or (parts[3].isdigit() and parts[3] != "0"):
                continue
            submitted = parse_time(parts[1])
            if submitted is not None and submitted >= int(since) - 1:
                found.append((submitted, parts[0]))
        return [jid for _, jid in sorted(found)]

    def submit_job(self, job: BatchJob, path: str, extra: Sequence[str], timeout: float) -> str:
        proc = self.run(["sbatch", "--parsable", *extra, path], timeout=timeout)
        return proc.stdout.strip().split(";")[0]

    # ----------------------------------------------------------------- what the way is
    described = "commands"
    submitted_note: str | None = None
    tests_scripts = True  # sbatch --test-only: the controller judges a script before it is queued
    reads_this_machines_config = True

    @property
    def where(self) -> str:
        return self.target.where if self.target is not None else "this cluster's SLURM"

    def needs_no_srun_here(self) -> bool:
        """A profile's own client commands that hold an srun (submitit looks for one on PATH)."""
        return self.target is not None and self.which("srun") is not None

    def submission_command(self, job: BatchJob, script_path: str, *, client_timeout_s: float) -> list[str]:
        """sbatch under a client-side limit (a controller that accepted the job but answers late
        cannot block ``submit`` for ever); on a cluster of a profile's own SLURM_CONF and commands,
        through ``env`` with them: submitit runs the line in this process's environment, and sbatch
        hands its own to the job."""
        line = ["timeout", "--kill-after=5", str(client_timeout_s), "sbatch", script_path]
        return ["env", *self.target.assignments(dict(os.environ)), *line] if self.target is not None else line

    def check_carries(self, job: Callable[[], BatchJob], what: str) -> None:
        """sbatch carries every job lmlaunch renders."""


class OverSsh(Commands):
    """SLURM's commands on a cluster's login node (``target.login``), in its login shell, with that
    cluster's SLURM_CONF and clients (paths on that machine)."""

    target: CommandsTarget

    def __init__(self, target: CommandsTarget) -> None:
        super().__init__(target)

    def env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        return dict(os.environ if environ is None else environ)  # that machine's are set in its shell

    def execute(self, cmd: list[str], *, timeout: float, input: str | None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.target.remote_argv(cmd), capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
        if proc.returncode == SSH_FAILED:
            raise SlurmUnavailable(f"`{cmd[0]}` on {self.target.login[-1]}: ssh failed "
                                   f"({first_line(proc.stderr.strip()) or 'exit 255'}); is its master connection open?")
        return proc


def _queued(parts: list[str]) -> QueuedJob:
    """One squeue line's :data:`SQUEUE_FIELDS`."""
    jid, jname, state, reason, restarts, limit, nnodes, used, nodelist, part, usr, start, submit, aid, tid, \
        hid, hoff = parts[: len(SQUEUE_FIELDS)]
    if tid.isdigit() and aid.isdigit():  # an array task: named A_i, as sbatch, sacct and scontrol name it
        jid = f"{aid}_{tid}"
    return QueuedJob(het_component(jid, hid, hoff), jname, state, reason, int(restarts) if restarts.isdigit() else 0,
                     limit, int(nnodes) if nnodes.isdigit() else 0, used, nodelist, part, usr, start, submit)
