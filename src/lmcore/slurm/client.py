"""The one place that runs SLURM commands (squeue, sacct, scontrol, scancel, sinfo, sacctmgr).

Every call has a timeout and returns parsed records. When SLURM is not installed, the
controller does not answer or no configuration can be found, the caller gets
:class:`lmcore.errors.SlurmUnavailable` (exit code 3) with one message saying what to do,
never a traceback. (submitit runs ``sbatch`` itself when submitting; ``launcher.submit.submission``
turns its failures into the same error.)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.errors import ExitCode, SlurmUnavailable, UserError
from lmcore.slurm import relay as slurm_relay, rest_calls, versions
from lmcore.slurm.commands_target import CommandsTarget
from lmcore.slurm.records import (
    ACTIVE_GROUPS as ACTIVE_GROUPS,  # the client's records, as its callers know them
    STATE_GROUPS as STATE_GROUPS,
    AccountedJob as AccountedJob,
    QueuedJob as QueuedJob,
    het_component,
    het_leader,
    is_active as is_active,
    state_group as state_group,
    state_word as state_word,
)
from lmcore.slurm.rest import RestClient, RestTarget

DEFAULT_TIMEOUT_S = 30.0
SSH_FAILED = 255  # ssh's own exit status: it could not connect, or the connection dropped
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
_NO_ACCOUNTING_MARKERS = (
    "Slurm accounting storage is disabled",  # the cluster keeps none (AccountingStorageType=none)
    "Problem talking to the database",
    "slurmdbd: Connection refused",
)
NO_ACCOUNTING_NOTE = ("this cluster keeps no job accounting (sacct: accounting storage is disabled): the state of a "
                      "job the controller has forgotten (after MinJobAge) comes from its run directory, and queue "
                      "waits and SLURM's own end states are not known")


class NoAccounting(SlurmUnavailable):
    """The cluster runs without accounting: sacct can never answer (not a slurmdbd that is down)."""

# What sacctmgr says when what it was asked to add exists already (each release's: lmcore.slurm.versions)
_ALREADY_THERE = versions.sacctmgr_exists()

# --------------------------------------------------------------------------- SLURM's time notations


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


# --------------------------------------------------------------------------- running commands

LOCAL_CLUSTER_CONF_CANDIDATES = (
    Path("/var/lib/lmlaunch-cluster/etc/slurm.conf"),
    Path.home() / ".lmlaunch" / "cluster" / "etc" / "slurm.conf",
)


# --------------------------------------------------------------------------- the transport

# A command that runs through a cluster's slurmrestd (a profile's submit.via: rest, or `lmlaunch
# --rest PROFILE`) sets it for its duration (`through_rest`): ping, squeue, sacct, show_job, cancel,
# requeue and the submissions then ask the REST API (lmcore.slurm.rest_calls) instead of the commands.
# A stack per context (contextvars): a thread started with the caller's context
# (``contextvars.copy_context().run``) asks the same cluster, one started without asks the default,
# and two threads asking two clusters at once (status over several) never see each other's.
_REST: contextvars.ContextVar[tuple[RestClient | None, ...]] = contextvars.ContextVar("lmlaunch_rest", default=())


@contextlib.contextmanager
def through_rest(target: RestTarget) -> Iterator[RestClient]:
    """Within: SLURM is asked through ``target``'s slurmrestd."""
    scontrol = (lambda: run(["scontrol", "token"]).stdout) if shutil.which("scontrol") else None
    client = RestClient(target, scontrol_token=scontrol)
    token = _REST.set((*_REST.get(), client))
    try:
        yield client
    finally:
        _REST.reset(token)


@contextlib.contextmanager
def without_rest() -> Iterator[None]:
    """Within: SLURM's commands, even inside a command that asks a slurmrestd (a run's job on
    another cluster than the one the command asks)."""
    token = _REST.set((*_REST.get(), None))
    try:
        yield
    finally:
        _REST.reset(token)


def rest_client() -> RestClient | None:
    """The slurmrestd this command talks to, or None: SLURM's commands."""
    stack = _REST.get()
    return stack[-1] if stack else None


# A command about a run on a cluster whose profile names its own SLURM_CONF or client commands
# (submit.slurm_conf / submit.slurm_bin) sets it for its duration: every command below then runs
# with them, and a job submitted within gets them in its environment.
_COMMANDS: contextvars.ContextVar[tuple[CommandsTarget, ...]] = contextvars.ContextVar("lmlaunch_commands", default=())


@contextlib.contextmanager
def through_commands(target: CommandsTarget) -> Iterator[CommandsTarget]:
    """Within: SLURM's commands talk to ``target``'s cluster."""
    token = _COMMANDS.set((*_COMMANDS.get(), target))
    try:
        yield target
    finally:
        _COMMANDS.reset(token)


def commands_target() -> CommandsTarget | None:
    """The cluster SLURM's commands talk to when not the default one."""
    stack = _COMMANDS.get()
    return stack[-1] if stack else None


def slurm_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for SLURM clients.

    SLURM_CONF is kept if set; otherwise, when there is no /etc/slurm/slurm.conf but the local
    cluster wrote one, point at it (a non-root `lmlaunch cluster up` cannot install it in /etc).
    """
    env = dict(os.environ if environ is None else environ)
    if (target := commands_target()) is not None and (target.conf or target.bin):
        return target.environ(env)  # that cluster's, whatever this shell points at
    if "SLURM_CONF" not in env and not Path("/etc/slurm/slurm.conf").exists():
        for cand in LOCAL_CLUSTER_CONF_CANDIDATES:
            if cand.exists():
                env["SLURM_CONF"] = str(cand)
                break
    return env


def _which(command: str) -> str | None:
    """Where ``command`` is for the cluster asked (its profile's slurm_bin first)."""
    return shutil.which(command, path=slurm_env().get("PATH"))


def has_command(command: str) -> bool:
    """Whether the cluster asked has ``command`` (e.g. srun) on this machine."""
    return _which(command) is not None


def _missing(cmd: str) -> SlurmUnavailable:
    return SlurmUnavailable(
        f"SLURM command '{cmd}' not found on PATH: this machine has no SLURM client. "
        "Install it (Debian: apt-get install slurm-client) or start the local cluster with "
        "`lmlaunch cluster up` (as root it installs slurm-wlm itself)."
    )


def run(
    args: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run one SLURM client command; SlurmUnavailable when SLURM is missing or down.

    With ``check``, any other non-zero exit raises UserError (exit code 1) with SLURM's message.
    """
    cmd = list(args)
    relay = os.environ.get(slurm_relay.RELAY_ENV)
    try:
        if relay:  # a rank in a container: the batch step runs the command on the host
            proc = slurm_relay.call(relay, cmd, timeout=timeout, input=input)
        elif (target := commands_target()) is not None and target.login:  # on its login node, over ssh
            proc = subprocess.run(target.remote_argv(cmd), capture_output=True, text=True, timeout=timeout,
                                  input=input, stdin=None if input is not None else subprocess.DEVNULL)
            if proc.returncode == SSH_FAILED:
                raise SlurmUnavailable(f"`{cmd[0]}` on {target.login[-1]}: ssh failed "
                                       f"({_first_line(proc.stderr.strip()) or 'exit 255'}); is its master connection open?")
        else:
            exe = _which(cmd[0])
            if exe is None:
                raise _missing(cmd[0])
            proc = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout,
                                  env=slurm_env(), input=input)
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
                f"the SLURM controller does not answer (`{cmd[0]}`: {_first_line(msg)}). "
                "Local cluster: start it with `lmlaunch cluster up`."
            )
        if check:
            raise UserError(f"`{' '.join(cmd)}` failed: {msg or f'exit code {proc.returncode}'}", exit_code=ExitCode.FAILURE)
    return proc


def test_only(command: str, args: Sequence[str], *, script: str | None = None,
              timeout: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """``sbatch --test-only ARGS`` with ``script`` on stdin, or ``srun --test-only ARGS``: the
    controller judges every option (an unknown one, a reservation that does not exist, a plugin
    this cluster lacks) and says when the job would start; nothing is queued or run. Returns
    (accepted, SLURM's message)."""
    if command not in ("sbatch", "srun"):
        raise ValueError(f"test_only: {command!r} is not sbatch or srun")
    proc = run([command, "--test-only", *args], input=script, check=False, timeout=timeout)
    message = " ".join(line.strip() for line in (proc.stderr + proc.stdout).strip().splitlines() if line.strip())
    return proc.returncode == 0, message


def says_controller_down(message: str) -> bool:
    """Whether a SLURM client's message says the controller (or its configuration) is not there."""
    return any(m in message for m in DOWN_MARKERS)


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def _rows(stdout: str, n_fields: int) -> list[list[str]]:
    rows = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        parts = line.split(FIELD_SEP)
        if len(parts) != n_fields:
            continue  # a line wrapped by a name we do not expect; skip rather than mis-assign
        rows.append([p.strip() for p in parts])
    return rows


# --------------------------------------------------------------------------- controller, nodes


def ping(timeout: float = 10.0) -> bool:
    """True when slurmctld answers (`scontrol ping`; over REST, slurmrestd's ping, whose failure to
    answer is its own error)."""
    if (r := rest_client()) is not None:
        return rest_calls.ping(r)
    try:
        proc = run(["scontrol", "ping"], timeout=timeout, check=False)
    except SlurmUnavailable:
        return False
    return proc.returncode == 0 and "UP" in proc.stdout


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # lower case as sinfo prints it: idle, allocated, mixed, down*, drained ...
    partitions: tuple[str, ...]
    cpus: int
    reason: str
    gres: str = ""  # sinfo's %G: gpu:h100:4(S:0); "(null)" without


def nodes(timeout: float = DEFAULT_TIMEOUT_S) -> list[NodeInfo]:
    """One record per node (merged over partitions)."""
    fmt = FIELD_SEP.join(["%N", "%t", "%R", "%c", "%E", "%G"])
    proc = run(["sinfo", "-h", "-N", "-o", fmt], timeout=timeout)
    merged: dict[str, NodeInfo] = {}
    for name, state, part, cpus, reason, gres in _rows(proc.stdout, 6):
        prev = merged.get(name)
        parts = (prev.partitions if prev else ()) + (part,)
        merged[name] = NodeInfo(name, state, parts, int(cpus) if cpus.isdigit() else 0, reason, gres)
    return list(merged.values())


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    default: bool
    available: str
    time_limit: str
    nodes: str
    state_summary: str  # allocated/idle/other/total


def partitions(timeout: float = DEFAULT_TIMEOUT_S) -> list[PartitionInfo]:
    fmt = FIELD_SEP.join(["%P", "%a", "%l", "%N", "%F"])
    proc = run(["sinfo", "-h", "-o", fmt], timeout=timeout)
    out = []
    for name, avail, limit, nodelist, summary in _rows(proc.stdout, 5):
        out.append(PartitionInfo(name.rstrip("*"), name.endswith("*"), avail, limit, nodelist, summary))
    return out


def partition_config(name: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str]:
    """`scontrol show partition NAME` as key -> value."""
    proc = run(["scontrol", "-o", "show", "partition", name], timeout=timeout)
    return _key_values(proc.stdout)


def partition_configs(timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, str]]:
    """`scontrol -o show partition`: every partition as key -> value."""
    proc = run(["scontrol", "-o", "show", "partition"], timeout=timeout)
    return [_key_values(line) for line in proc.stdout.splitlines() if line.strip()]


def node_configs(timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, str]]:
    """`scontrol -o show node`: every node as key -> value."""
    proc = run(["scontrol", "-o", "show", "node"], timeout=timeout)
    return [_key_values(line) for line in proc.stdout.splitlines() if line.strip()]


def topology_records(timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, str]]:
    """`scontrol show topology`: each switch (topology/tree) or block (topology/block) as key -> value;
    none where the cluster has no topology plugin (scontrol then says so, or fails)."""
    try:
        proc = run(["scontrol", "show", "topology"], timeout=timeout)
    except SlurmUnavailable:
        raise
    except UserError:
        return []  # SLURM 22.05 with topology/none: "scontrol: error: ... No topology information available"
    return [kv for line in proc.stdout.splitlines() if "=" in line and (kv := _key_values(line))]


def config(timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str]:
    """`scontrol show config` as key -> value (over REST: slurm.conf's keys, from API v0.0.45 on)."""
    if (r := rest_client()) is not None:
        return rest_calls.config(r)
    proc = run(["scontrol", "show", "config"], timeout=timeout)
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if " = " in line:
            k, v = line.split(" = ", 1)
            out[k.strip()] = v.strip()
    return out


def _key_values(text: str) -> dict[str, str]:
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


# --------------------------------------------------------------------------- jobs


def sacct(
    job_ids: Iterable[str],
    *,
    duplicates: bool = False,
    steps: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[AccountedJob]:
    """Accounting records of jobs; with ``duplicates`` (`sacct -D`) one row per attempt of a
    requeued job. Raises SlurmUnavailable when the cluster has no accounting."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return []
    if (r := rest_client()) is not None:
        return only_asked(rest_calls.sacct(r, ids, duplicates), ids)
    fields = ["JobID", "JobName", "State", "ExitCode", "Start", "End", "Elapsed", "NodeList", "Partition", "Submit",
              "AllocTRES"]
    cmd = ["sacct", "-n", "-P", f"--delimiter={FIELD_SEP}", f"--format={','.join(fields)}", "-j", ",".join(ids)]
    if not steps:
        cmd.append("-X")
    if duplicates:
        cmd.append("-D")
    proc = run(cmd, timeout=timeout, check=False)
    if proc.returncode != 0:
        msg = proc.stderr.strip()
        if _NO_ACCOUNTING_MARKERS[0] in msg:
            raise NoAccounting(NO_ACCOUNTING_NOTE)
        if any(m in msg for m in _NO_ACCOUNTING_MARKERS):
            raise SlurmUnavailable(
                f"SLURM accounting does not answer (`sacct`: {_first_line(msg)}); job states after "
                "completion need slurmdbd. Local cluster: `lmlaunch cluster up` starts it."
            )
        raise UserError(f"`{' '.join(cmd)}` failed: {msg}", exit_code=ExitCode.FAILURE)
    return only_asked([AccountedJob(het_leader(row[0]), *row[1:]) for row in _rows(proc.stdout, len(fields))], ids)


def only_asked(rows: list[Any], ids: Iterable[str] | None) -> list[Any]:
    """A heterogeneous job asked for by its id is its first component: the others (``J+N``, the
    evaluator alongside the training) only where asked for by their own names."""
    if ids is None:
        return rows
    asked = {str(i) for i in ids}
    return [r for r in rows if "+" not in r.job_id.split(".")[0] or r.job_id.split(".")[0] in asked]


def show_job(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str] | None:
    """`scontrol show job` as key -> value, or None when the controller forgot the job."""
    if (r := rest_client()) is not None:
        return rest_calls.show_job(r, str(job_id))
    proc = run(["scontrol", "-o", "show", "job", str(job_id)], timeout=timeout, check=False)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise UserError(f"`scontrol show job {job_id}` failed: {proc.stderr.strip()}", exit_code=ExitCode.FAILURE)
    return _key_values(proc.stdout.splitlines()[0]) if proc.stdout.strip() else None


def job_state(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """The current SLURM state of a job: from the controller while it knows the job, then from
    accounting. 'UNKNOWN' when neither knows it."""
    q = squeue([job_id], timeout=timeout)
    if q:
        return q[0].state
    rows = sacct([job_id], timeout=timeout)
    return rows[-1].state if rows else "UNKNOWN"


def restart_count(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    info = show_job(job_id, timeout=timeout)
    if not info:
        return 0
    value = info.get("Restarts", "0")
    return int(value) if value.isdigit() else 0


def cancel(job_ids: Iterable[str], *, signal: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """scancel the jobs (or send them a signal with ``signal``, e.g. 'USR2')."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return
    if (r := rest_client()) is not None:
        return rest_calls.cancel(r, ids, signal)
    cmd = ["scancel"]
    if signal:
        cmd += [f"--signal={signal}"]
    run([*cmd, *ids], timeout=timeout)


def hold(job_id: str, *, release: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``scontrol hold`` a pending job (it will not start until released), or ``release`` it."""
    if rest_client() is not None:
        raise UserError("holding a job through slurmrestd is not built yet: hold and release it with SLURM's "
                        "commands (scontrol hold/release) on the cluster", exit_code=ExitCode.USAGE)
    run(["scontrol", "release" if release else "hold", str(job_id)], timeout=timeout)


def requeue(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """`scontrol requeue` (kills the running job; it restarts later with the same id)."""
    if (r := rest_client()) is not None:
        return r.requeue(str(job_id))
    run(["scontrol", "requeue", str(job_id)], timeout=timeout)


def exclude_nodes(job_id: str, nodes: Iterable[str], timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """`scontrol update JobId=J ExcNodeList=...`: keep a pending (requeued) job off ``nodes``."""
    run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"], timeout=timeout)


# --------------------------------------------------------------------------- accounting admin


def sacctmgr(args: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """`sacctmgr -i ARGS` (immediate, no prompt); adding what exists is not an error (22.05 says
    'Nothing new added' and exits 0; 24.11 says 'Already existing account ...' and exits 1)."""
    proc = run(["sacctmgr", "-i", *args], timeout=timeout, check=False)
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 and not any(m in text for m in _ALREADY_THERE):
        raise UserError(f"`sacctmgr {' '.join(args)}` failed: {text}", exit_code=ExitCode.FAILURE)
    return text


# --------------------------------------------------------------------------- batched status (lmlaunch status)


_SQUEUE_FIELDS = ["JobID", "Name", "State", "Reason", "RestartCnt", "TimeLimit", "NumNodes", "TimeUsed",
                  "NodeList", "Partition", "UserName", "StartTime", "SubmitTime", "ArrayJobID", "ArrayTaskID",
                  "HetJobID", "HetJobOffset"]


def squeue(
    job_ids: Iterable[str] | None = None,
    *,
    name: str | None = None,
    user: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[QueuedJob]:
    """ONE `squeue -O` call: the jobs the controller knows now, all of ``job_ids`` (in any state
    it still remembers) or those called ``name`` / of ``user``."""
    if (r := rest_client()) is not None:
        return only_asked(rest_calls.squeue(r, job_ids, name, user), None if job_ids is None else list(job_ids))
    fmt = ",".join(f"{f}:{FIELD_SEP}" for f in _SQUEUE_FIELDS)  # `Field:suffix`: unpadded, separated
    cmd = ["squeue", "-h", "-r", "-O", fmt]  # -r: an array's pending tasks one per line, as A_i
    ids = sorted({str(j) for j in job_ids}) if job_ids is not None else None
    if ids is not None:
        if not ids:
            return []
        cmd += ["--states=all", "-j", ",".join(ids)]
    if name is not None:
        cmd += ["-n", name]
    if user is not None:
        cmd += ["-u", user]
    proc = run(cmd, timeout=timeout, check=False)
    if proc.returncode != 0:
        # squeue -j with only unknown (long gone) ids exits 1 with "Invalid job id specified"
        if "Invalid job id" in proc.stderr:
            return []
        what = f"squeue -O ... -j <{len(ids)} ids>" if ids else " ".join(cmd)
        raise UserError(f"`{what}` failed: {proc.stderr.strip()}", exit_code=ExitCode.FAILURE)
    out = []
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(FIELD_SEP)]
        if len(parts) < len(_SQUEUE_FIELDS):
            continue
        jid, jname, state, reason, restarts, limit, nnodes, used, nodelist, part, usr, start, submit, aid, tid, \
            hid, hoff = parts[: len(_SQUEUE_FIELDS)]
        if tid.isdigit() and aid.isdigit():  # an array task: named A_i, as sbatch, sacct and scontrol name it
            jid = f"{aid}_{tid}"
        jid = het_component(jid, hid, hoff)
        out.append(QueuedJob(jid, jname, state, reason, int(restarts) if restarts.isdigit() else 0, limit,
                             int(nnodes) if nnodes.isdigit() else 0, used, nodelist, part, usr, start, submit))
    return only_asked(out, ids)


# --------------------------------------------------------------------------- submission reconciliation (launcher.submit.submission)




def active_jobs(job_ids: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> list[QueuedJob]:
    """Of ``job_ids``, the jobs SLURM still has queued or running: "does this run still have an
    active job?", asked by ``submit`` (never two live attempts) and ``cancel`` alike."""
    if not job_ids:
        return []
    return [j for j in squeue(list(job_ids), timeout=timeout) if is_active(j.state)]


def user_name() -> str:
    """The user SLURM knows this process as: its real uid's name (SLURM maps the uid it is given;
    $USER may be unset, as under some shells and services, or name someone else)."""
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (a container): SLURM accepts the number
        return str(os.getuid())


def jobs_submitted_since(name: str, since: float, *, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Ids of this user's jobs called ``name`` that the controller received at or after ``since``
    (epoch seconds; SubmitTime has whole seconds, so compare with a second of slack), oldest first.
    Used to find a job whose ``sbatch`` timed out on the client side but reached the controller."""
    if (r := rest_client()) is not None:
        return rest_calls.submitted_since(r, name, since)
    fmt = ",".join(f"{f}:{FIELD_SEP}" for f in ("JobID", "SubmitTime", "Name", "HetJobOffset"))
    cmd = ["squeue", "-h", "--states=all", "-u", user_name(), "-n", name, "-O", fmt]
    proc = run(cmd, timeout=timeout)
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


# --------------------------------------------------------------------------- a step inside a running job (lmlaunch stacks)


def overlap_step_args(job_id: str, nodes: Sequence[str], command: Sequence[str]) -> list[str]:
    """Pure: srun of one step beside a running job's tasks, one task on each of ``nodes``.
    ``--overlap`` shares the CPUs (and memory) the job's own step holds, without which the step
    would wait for them until the job ends; ``--label`` prefixes each line with the task, so the
    nodes' interleaved lines can be told apart."""
    n = len(nodes)
    return ["srun", "--overlap", f"--jobid={job_id}", f"--nodelist={','.join(nodes)}", f"--nodes={n}",
            f"--ntasks={n}", "--ntasks-per-node=1", "--label", "--kill-on-bad-exit=0", "--quiet", *command]


@dataclass(frozen=True)
class StepResult:
    returncode: int | None  # None: cut off at the timeout
    stdout: str
    stderr: str


def run_overlap_step(job_id: str, nodes: Sequence[str], command: Sequence[str], *, timeout: float = 60.0) -> StepResult:
    """Run :func:`overlap_step_args` and return what it printed, also when it fails or is cut off
    at ``timeout`` (whatever the nodes printed until then). An array task ``A_T`` is named by its
    own numeric job id, the only form ``srun --jobid`` takes (scontrol tells it)."""
    if not job_id.isdigit():
        raw = (show_job(job_id, timeout=DEFAULT_TIMEOUT_S) or {}).get("JobId", "")
        job_id = raw if raw.isdigit() else job_id
    cmd = overlap_step_args(job_id, nodes, command)
    exe = _which(cmd[0])
    if exe is None:
        raise _missing(cmd[0])
    try:
        proc = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout, env=slurm_env(),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        return StepResult(None, text(exc.stdout), text(exc.stderr) + f"\nsrun did not finish within {timeout:.0f} s")
    msg = proc.stderr.strip()
    if proc.returncode != 0 and says_controller_down(msg):
        raise SlurmUnavailable(f"the SLURM controller does not answer (`srun`: {_first_line(msg)})")
    return StepResult(proc.returncode, proc.stdout, proc.stderr)


# --------------------------------------------------------------------------- probes and command lines for others
def accounting_answers(timeout: float = 15.0) -> str | None:
    """None when accounting answers (an empty ``sacct`` query for now), else SLURM's words. The
    one probe doctor and ``profile init`` both make."""
    try:
        run(["sacct", "-n", "-X", "-S", "now", "-E", "now", "-o", "JobID"], timeout=timeout)
    except UserError as exc:
        return exc.message
    return None


def srun_has_option(option: str, timeout: float = 30.0) -> bool:
    """Whether this machine's ``srun --help`` lists ``option`` (a SPANK plugin's, e.g. pyxis'
    ``--container-image``); False where srun is missing or does not answer."""
    exe = _which("srun")
    try:
        proc = subprocess.run([exe or "srun", "--help"], capture_output=True, text=True, timeout=timeout, env=slurm_env())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in proc.stdout


def sbatch_file(path: str, *extra: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """``sbatch --parsable [EXTRA] PATH``: the job id (a job array's id for an array)."""
    if (r := rest_client()) is not None:
        return rest_calls.submit_file(r, path, [_option(e) for e in extra])
    proc = run(["sbatch", "--parsable", *extra, path], timeout=timeout)
    return proc.stdout.strip().split(";")[0]


def sbatch_command(path: str, *, client_timeout_s: float) -> list[str]:
    """The command line submitit runs to submit a script: sbatch under a client-side limit, so a
    controller that accepted the job but answers late cannot block ``submit`` for ever. On a
    cluster of a profile's own SLURM_CONF and commands, through ``env`` with them: submitit runs
    the line in this process's environment, and sbatch hands its own to the job."""
    line = ["timeout", "--kill-after=5", str(client_timeout_s), "sbatch", path]
    target = commands_target()
    return ["env", *target.assignments(dict(os.environ)), *line] if target is not None else line


def _option(word: str) -> tuple[str, str]:
    name, _, value = word.removeprefix("--").partition("=")
    return name, value


def srun_command(options: Sequence[str], command: Sequence[str]) -> list[str]:
    """``srun OPTIONS COMMAND``: a step's command line (e.g. doctor's probe on the nodes)."""
    return ["srun", *options, *command]
