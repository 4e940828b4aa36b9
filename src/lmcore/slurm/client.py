"""The SLURM client's one face: every query and control lmlaunch makes of SLURM, asked of the way
in force (lmcore.slurm.way: SLURM's commands here or over SSH, lmcore.slurm.commands; slurmrestd,
lmcore.slurm.rest_way), chosen here once from the context a command or a run set
(:func:`through_rest`, :func:`through_commands`).

Every call has a timeout and returns parsed records. When SLURM is not installed, the
controller does not answer or no configuration can be found, the caller gets
:class:`lmcore.errors.SlurmUnavailable` (exit code 3) with one message saying what to do,
never a traceback. (submitit runs ``sbatch`` itself when submitting; ``launcher.submit.submission``
turns its failures into the same error.) What only the commands can tell (nodes, partitions,
topology, a step inside a job, sacctmgr) is asked of SLURM's commands whichever way jobs go.
"""

from __future__ import annotations

import contextlib
import contextvars
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lmcore.errors import ExitCode, SlurmUnavailable, UserError
from lmcore.slurm import versions
from lmcore.slurm.batch_job import BatchJob
from lmcore.slurm.commands import (
    DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S,
    DOWN_MARKERS as DOWN_MARKERS,
    FIELD_SEP as FIELD_SEP,
    NO_ACCOUNTING_NOTE as NO_ACCOUNTING_NOTE,
    Commands,
    NoAccounting as NoAccounting,
    OverSsh,
    first_line,
    key_values,
    missing,
    parse_duration as parse_duration,
    parse_time as parse_time,
    rows,
    says_controller_down as says_controller_down,
    user_name as user_name,
)
from lmcore.slurm.commands_target import CommandsTarget
from lmcore.slurm.records import (
    ACTIVE_GROUPS as ACTIVE_GROUPS,  # the client's records, as its callers know them
    STATE_GROUPS as STATE_GROUPS,
    AccountedJob as AccountedJob,
    QueuedJob as QueuedJob,
    is_active as is_active,
    state_group as state_group,
    state_word as state_word,
)
from lmcore.slurm.rest import RestClient, RestTarget
from lmcore.slurm.rest_way import Rest
from lmcore.slurm.ssh import SSH_FAILED as SSH_FAILED

# What sacctmgr says when what it was asked to add exists already (each release's: lmcore.slurm.versions)
_ALREADY_THERE = versions.sacctmgr_exists()


# --------------------------------------------------------------------------- the way in force

# A command that runs through a cluster's slurmrestd (a profile's submit.via: rest, or `lmlaunch
# --rest PROFILE`) sets it for its duration (`through_rest`): ping, squeue, sacct, show_job, cancel,
# requeue and the submissions then ask the REST API (lmcore.slurm.rest_way) instead of the commands.
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
# (submit.slurm_conf / submit.slurm_bin), or its login node, sets it for its duration: every command
# below then runs with them, and a job submitted within gets them in its environment.
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


def commands() -> Commands:
    """SLURM's commands in force: here (this machine's, or a profile's SLURM_CONF and clients), or
    on a login node over SSH."""
    target = commands_target()
    return OverSsh(target) if target is not None and target.login else Commands(target)


def way_in_force() -> Rest | Commands:
    """The way SLURM is asked in this context (the one place that tells them apart; each is a
    lmcore.slurm.way.Way)."""
    rest = rest_client()
    return Rest(rest) if rest is not None else commands()


def slurm_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for SLURM clients (lmcore.slurm.commands.Commands.env)."""
    return commands().env(environ)


def has_command(command: str) -> bool:
    """Whether the cluster asked has ``command`` (e.g. srun) on this machine."""
    return commands().which(command) is not None


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
    return commands().run(args, timeout=timeout, check=check, input=input)


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


# --------------------------------------------------------------------------- controller, nodes


def ping(timeout: float = 10.0) -> bool:
    """True when slurmctld answers (`scontrol ping`; over REST, slurmrestd's ping, whose failure to
    answer is its own error)."""
    return way_in_force().ping(timeout)


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
    for name, state, part, cpus, reason, gres in rows(proc.stdout, 6):
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
    for name, avail, limit, nodelist, summary in rows(proc.stdout, 5):
        out.append(PartitionInfo(name.rstrip("*"), name.endswith("*"), avail, limit, nodelist, summary))
    return out


def partition_config(name: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str]:
    """`scontrol show partition NAME` as key -> value."""
    proc = run(["scontrol", "-o", "show", "partition", name], timeout=timeout)
    return key_values(proc.stdout)


def partition_configs(timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, str]]:
    """`scontrol -o show partition`: every partition as key -> value."""
    proc = run(["scontrol", "-o", "show", "partition"], timeout=timeout)
    return [key_values(line) for line in proc.stdout.splitlines() if line.strip()]


def node_configs(timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, str]]:
    """`scontrol -o show node`: every node as key -> value."""
    proc = run(["scontrol", "-o", "show", "node"], timeout=timeout)
    return [key_values(line) for line in proc.stdout.splitlines() if line.strip()]


def topology_records(timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, str]]:
    """`scontrol show topology`: each switch (topology/tree) or block (topology/block) as key -> value;
    none where the cluster has no topology plugin (scontrol then says so, or fails)."""
    try:
        proc = run(["scontrol", "show", "topology"], timeout=timeout)
    except SlurmUnavailable:
        raise
    except UserError:
        return []  # SLURM 22.05 with topology/none: "scontrol: error: ... No topology information available"
    return [kv for line in proc.stdout.splitlines() if "=" in line and (kv := key_values(line))]


def config(timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str]:
    """`scontrol show config` as key -> value (over REST: slurm.conf's keys, from API v0.0.45 on)."""
    return way_in_force().config(timeout)


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
    return only_asked(way_in_force().sacct(ids, duplicates=duplicates, steps=steps, timeout=timeout), ids)


def only_asked(rows: list[Any], ids: Iterable[str] | None) -> list[Any]:
    """A heterogeneous job asked for by its id is its first component: the others (``J+N``, the
    evaluator alongside the training) only where asked for by their own names."""
    if ids is None:
        return rows
    asked = {str(i) for i in ids}
    return [r for r in rows if "+" not in r.job_id.split(".")[0] or r.job_id.split(".")[0] in asked]


def show_job(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str] | None:
    """`scontrol show job` as key -> value, or None when the controller forgot the job."""
    return way_in_force().show_job(str(job_id), timeout)


def job_state(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """The current SLURM state of a job: from the controller while it knows the job, then from
    accounting. 'UNKNOWN' when neither knows it."""
    q = squeue([job_id], timeout=timeout)
    if q:
        return q[0].state
    accounted = sacct([job_id], timeout=timeout)
    return accounted[-1].state if accounted else "UNKNOWN"


def restart_count(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    info = show_job(job_id, timeout=timeout)
    if not info:
        return 0
    value = info.get("Restarts", "0")
    return int(value) if value.isdigit() else 0


def cancel(job_ids: Iterable[str], *, signal: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """scancel the jobs (or send them a signal with ``signal``, e.g. 'USR2')."""
    ids = [str(j) for j in job_ids]
    if ids:
        way_in_force().cancel(ids, signal, timeout)


def hold(job_id: str, *, release: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``scontrol hold`` a pending job (it will not start until released), or ``release`` it."""
    way_in_force().hold(str(job_id), release, timeout)


def requeue(job_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """`scontrol requeue` (kills the running job; it restarts later with the same id)."""
    way_in_force().requeue(str(job_id), timeout)


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


def squeue(
    job_ids: Iterable[str] | None = None,
    *,
    name: str | None = None,
    user: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[QueuedJob]:
    """ONE `squeue -O` call: the jobs the controller knows now, all of ``job_ids`` (in any state
    it still remembers) or those called ``name`` / of ``user``."""
    ids = sorted({str(j) for j in job_ids}) if job_ids is not None else None
    if ids is not None and not ids:
        return []
    return only_asked(way_in_force().squeue(ids, name, user, timeout), ids)


# --------------------------------------------------------------------------- submission reconciliation (launcher.submit.submission)




def active_jobs(job_ids: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> list[QueuedJob]:
    """Of ``job_ids``, the jobs SLURM still has queued or running: "does this run still have an
    active job?", asked by ``submit`` (never two live attempts) and ``cancel`` alike."""
    if not job_ids:
        return []
    return [j for j in squeue(list(job_ids), timeout=timeout) if is_active(j.state)]


def jobs_submitted_since(name: str, since: float, *, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Ids of this user's jobs called ``name`` that the controller received at or after ``since``
    (epoch seconds; SubmitTime has whole seconds, so compare with a second of slack), oldest first.
    Used to find a job whose ``sbatch`` timed out on the client side but reached the controller."""
    return way_in_force().submitted_since(name, since, timeout)


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
    here = commands()
    exe = here.which(cmd[0])
    if exe is None:
        raise missing(cmd[0])
    try:
        proc = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout, env=here.env(),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        return StepResult(None, text(exc.stdout), text(exc.stderr) + f"\nsrun did not finish within {timeout:.0f} s")
    msg = proc.stderr.strip()
    if proc.returncode != 0 and says_controller_down(msg):
        raise SlurmUnavailable(f"the SLURM controller does not answer (`srun`: {first_line(msg)})")
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
    here = commands()
    exe = here.which("srun")
    try:
        proc = subprocess.run([exe or "srun", "--help"], capture_output=True, text=True, timeout=timeout, env=here.env())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in proc.stdout


def sbatch_job(job: BatchJob, path: str, *extra: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """The rendered ``job``, its script written at ``path``, submitted (``sbatch --parsable [EXTRA]
    PATH``, or its fields through slurmrestd): the job id (a job array's id for an array)."""
    return way_in_force().submit_job(job, path, extra, timeout)


def srun_command(options: Sequence[str], command: Sequence[str]) -> list[str]:
    """``srun OPTIONS COMMAND``: a step's command line (e.g. doctor's probe on the nodes)."""
    return ["srun", *options, *command]
