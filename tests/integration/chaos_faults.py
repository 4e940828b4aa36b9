"""The chaos campaign's faults, each done for real to a run on a local worker cluster
(tests/integration/chaos_schedule.py names them): signals to the ranks' processes, SLURM's own
commands, its daemons stopped and started, bytes changed on disk. Nothing here goes through
lmtrain's fault-injection seam: the run learns of a fault as it would on a cluster.

The daemons a fault stops are started again one by one (launcher.localcluster.cluster.start_daemon),
on the cluster's SLURM: the machine's own, or another release's inside its Debian root.

Each injector returns what it did (``landed``: False when the fault could not land, e.g. a
preemption of a job that is pending, with why) and, for a fault that lasts, an undo the campaign
calls after the fault's hold time (a node RESUMEd, a daemon started again).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import waiting
from chaos_schedule import Fault
from preempt_helpers import current_step, lm, starts

from launcher.localcluster import cluster, debian_root
from launcher.localcluster.config import Layout, is_native
from launcher.localcluster.daemons import running_from_pidfile, stop
from launcher.runs.run_lock import watcher_alive
from launcher.submit.rehearsal import resume_node
from lmcore.errors import UserError
from lmcore.run.checkpoint_index import complete_checkpoints, verify
from lmcore.run.task_records import read_task_records
from lmcore.slurm import admin as rehearsal, client as slurm

BATCH_STEP = "4294967291"  # SLURM_BATCH_SCRIPT: the batch step's id in slurmd's spool socket names


@dataclass
class Target:
    """The run a campaign acts on, and the worker cluster it runs on."""

    env: dict[str, str]  # lmlaunch's environment (registry, runs root, the cluster's commands)
    layout: Layout
    name: str
    job: str  # the run's job now (a run resumed by hand after a full disk has a new one)
    run_dir: Path
    warning_s: int  # the run's preemption.warning_seconds
    small_fs: Path | None = None  # the small filesystem of the campaign's own that holds the checkpoints
    bucket: str | None = None  # checkpoint.dir s3://... when the schedule stops the gateway

    @property
    def ckpt_dir(self) -> Path:
        return checkpoint_dir(self.run_dir, self.small_fs)


def checkpoint_dir(run_dir: Path, small_fs: Path | None) -> Path:
    """Where the run's checkpoints are: in its run directory, or on the campaign's small filesystem."""
    return small_fs / "checkpoints" if small_fs is not None else run_dir / "checkpoints"


FILLER = ".chaos-filler"  # the file that fills the small filesystem (beside the checkpoints, not among them)


@contextlib.contextmanager
def small_filesystem(where: Path, version: str | None = None, size_mib: int = 16) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` mounted at ``where`` for the campaign's checkpoints (room for a few of
    the tiny model's), unmounted afterwards: a full disk fills it, not the machine's. For a cluster of
    another SLURM release (``version``) it is bound at the same path in that release's Debian root,
    where the jobs run (a mount made here after the root's own does not reach into it)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(where)], check=True)
    inside = [] if is_native(version) else [debian_root.root_dir(str(version)) / where.relative_to("/")]
    try:
        for point in inside:
            point.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "--bind", str(where), str(point)], check=True)
        yield where
    finally:
        for point in [*inside, where]:
            subprocess.run(["umount", "--lazy", str(point)], check=False)


@dataclass
class Done:
    landed: bool
    what: str
    undo: Callable[[], str] | None = None
    facts: dict = field(default_factory=dict)


def _attempt_records(t: Target):
    info = slurm.show_job(t.job) or {}
    if info.get("JobState") != "RUNNING":
        return None, f"job {t.job} is {info.get('JobState', 'gone')}"
    records, _problems = read_task_records(t.run_dir, t.job, int(info.get("Restarts", "0") or 0))
    alive = [r for r in records if Path(f"/proc/{r.pid}").exists()]
    if not alive:
        return None, "no rank of the running attempt has a live process yet"
    return alive, ""


def _signal_rank(t: Target, f: Fault, sig: signal.Signals) -> Done:
    records, why = _attempt_records(t)
    if records is None:
        return Done(False, why)
    rec = next((r for r in records if r.rank == f.target), records[0])
    try:
        os.kill(rec.pid, sig)
    except ProcessLookupError:
        return Done(False, f"rank {rec.rank}'s process {rec.pid} was gone")
    return Done(True, f"{sig.name} to rank {rec.rank} (pid {rec.pid} on {rec.node})",
                facts={"rank": rec.rank, "pid": rec.pid, "node": rec.node})


def rank_kill(t: Target, f: Fault) -> Done:
    return _signal_rank(t, f, signal.SIGKILL)


def rank_stop(t: Target, f: Fault) -> Done:
    return _signal_rank(t, f, signal.SIGSTOP)


def task_kill(t: Target, f: Fault) -> Done:
    """A rank's whole task SIGKILLed at once: the process under its slurmstepd (its agent, with the warm
    restart) and everything below it, as slurmstepd does when SLURM kills the step on that node only
    (a kill of a failed node's step, delivered late, reaching the requeued job's step of the same id
    there: seen on 26.05) or as the OOM killer takes the task's cgroup."""
    records, why = _attempt_records(t)
    if records is None:
        return Done(False, why)
    rec = next((r for r in records if r.rank == f.target), records[0])
    root, chain = rec.pid, []
    while (parent := _parent(root)) and b"slurmstepd" not in _cmdline(str(parent)) and len(chain) < 8:
        chain.append(root)
        root = parent
    if not parent:
        return Done(False, f"rank {rec.rank}'s process {rec.pid} has no slurmstepd above it (gone?)")
    victims, todo = [], [root]
    while todo:
        pid = todo.pop()
        victims.append(pid)
        todo.extend(_children({pid}))
    _kill_all(victims)
    return Done(True, f"rank {rec.rank}'s whole task on {rec.node} SIGKILLed ({len(victims)} processes from pid {root})",
                facts={"rank": rec.rank, "node": rec.node, "pids": victims})


def node_down(t: Target, f: Fault) -> Done:
    """A node the ranks run on, other than the batch script's, fails."""
    return _fail_node(t, f, batch_host=False)


def batch_host_down(t: Target, f: Fault) -> Done:
    """The node of the batch script (and rank 0) fails."""
    return _fail_node(t, f, batch_host=True)


def _fail_node(t: Target, f: Fault, *, batch_host: bool) -> Done:
    info = slurm.show_job(t.job) or {}
    begun = starts(t.run_dir)
    if info.get("JobState") != "RUNNING" or not begun:
        return Done(False, f"job {t.job} is {info.get('JobState', 'gone')}")
    host = info.get("BatchHost", "")
    nodes = [host] if batch_host else [n for n in begun[-1]["nodes"] if n != host]
    if not nodes or not nodes[0]:
        return Done(False, f"no such node among the ranks' {begun[-1]['nodes']} (batch host {host!r})")
    node = nodes[f.target % len(nodes)]
    if any(n.name == node and "down" in n.state.lower() for n in slurm.nodes()):
        return Done(False, f"{node} is DOWN already")
    # drained first: DOWN alone is undone by ReturnToService=2 as soon as the node's slurmd registers
    # again (launcher.submit.rehearsal: a failed node takes no job until it is RESUMEd)
    rehearsal.set_node_state(node, "DRAIN", reason=f"chaos fault #{f.index}")
    rehearsal.set_node_state(node, "DOWN", reason=f"chaos fault #{f.index}")
    killed = kill_job_on_node(t.layout, node, t.job)  # the node dies: its slurmd and what the job ran there

    def undo() -> str:  # the node boots again: RESUMEd, then a fresh slurmd (no memory of the job) registers
        resume_node(node)
        cluster.start_daemon(t.layout, "slurmd", lambda line: None, node)
        return f"{node} back (slurmd started, RESUMEd)"

    return Done(True, f"{node} set DOWN, the job's {len(killed)} processes there SIGKILLed", undo,
                {"node": node, "killed": killed})


def kill_job_on_node(layout: Layout, node: str, job: str) -> list[int]:
    """SIGKILL the node's slurmd and every process of the job on it (each step's slurmstepd, found by
    its socket in the node's spool directory, and what runs under it), as a node that loses power:
    a slurmd left running would remember the job and refuse its next run there ("Job already
    running, do not launch second copy", and SLURM holds the job)."""
    prefix = f"{layout.spool}/slurmd-{node}/{node}_{job}."
    listing = subprocess.run(["ss", "-xlpn"], capture_output=True, text=True, check=True).stdout
    stepds = {int(p) for line in listing.splitlines() if prefix in line for p in re.findall(r"pid=(\d+)", line)}
    slurmd = running_from_pidfile(layout.run / f"slurmd-{node}.pid")
    victims, todo = [], [*([slurmd] if slurmd else []), *stepds]
    while todo:
        pid = todo.pop()
        victims.append(pid)
        todo.extend(_children({pid}))
    _kill_all(victims)
    return victims


def preempt(t: Target, f: Fault) -> Done:
    code, out, err = lm(t.env, "preempt", t.name, "--mode", "requeue", "--json")
    if code != 0:
        return Done(False, f"lmlaunch preempt: {(err or out).strip()[-300:]}")
    return Done(True, "preempted by a high-priority exclusive job", facts={"preempt": out.strip()[-500:]})


def requeue(t: Target, f: Fault) -> Done:
    try:
        slurm.requeue(t.job)
    except UserError as exc:
        return Done(False, f"scontrol requeue: {exc}"[:300])
    return Done(True, f"scontrol requeue {t.job}")


def ctld_restart(t: Target, f: Fault) -> Done:
    if stop(t.layout.pidfile("slurmctld"), "slurmctld") is None:
        return Done(False, "slurmctld was not running")

    def undo() -> str:
        cluster.start_daemon(t.layout, "slurmctld", lambda line: None)
        return "slurmctld started again"

    return Done(True, "slurmctld stopped", undo)


def dbd_stop(t: Target, f: Fault) -> Done:
    if stop(t.layout.pidfile("slurmdbd"), "slurmdbd") is None:
        return Done(False, "slurmdbd was not running")

    def undo() -> str:
        cluster.start_daemon(t.layout, "slurmdbd", lambda line: None)
        return "slurmdbd started again"

    return Done(True, "slurmdbd stopped", undo)


def gateway_stop(t: Target, f: Fault) -> Done:
    """The local cluster's S3 gateway SIGKILLed (the campaign holds it alone: tests/gateway.py);
    started again by the undo, as `cluster up --s3` starts it."""
    from launcher.localcluster import object_store

    if t.bucket is None:
        return Done(False, "the run's checkpoints are not in a bucket")
    pid = object_store.running(object_store.store_layout(), "client.rgw.a")
    if pid is None:
        return Done(False, "the S3 gateway was not running")
    os.kill(pid, signal.SIGKILL)

    def undo() -> str:
        object_store.up(lambda line: None)
        return "the S3 gateway started again"

    return Done(True, f"radosgw (pid {pid}) SIGKILLed", undo)


def corrupt_checkpoint(t: Target, f: Fault) -> Done:
    """A byte changed in the middle of the newest usable checkpoint's largest file (same size, same
    time: only a checksum can tell), when an older usable one is left to resume from."""
    usable = [ck for ck in complete_checkpoints(t.ckpt_dir) if not verify(ck.path)]
    if len(usable) < 2:  # the run could only end `crashed`, "no usable checkpoint" (docs/run-directory.md)
        return Done(False, f"{len(usable)} usable checkpoint(s): corrupting one would leave the run none to resume from")
    newest = usable[-1]
    files = [p for p in newest.path.rglob("*") if p.is_file() and p.stat().st_size > 0]
    victim = max(files, key=lambda p: p.stat().st_size)
    stat = victim.stat()
    with victim.open("r+b") as fh:
        fh.seek(stat.st_size // 2)
        byte = fh.read(1)
        fh.seek(stat.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return Done(True, f"byte {stat.st_size // 2} of {victim.relative_to(t.ckpt_dir)} flipped",
                facts={"checkpoint_step": newest.step, "file": str(victim.relative_to(t.ckpt_dir))})


def time_limit(t: Target, f: Fault) -> Done:
    """The job's time limit lowered so that it is reached in W - 60 .. W seconds (W: the run's
    warning_seconds): SLURM sends the warning signal at its next look, then ends the job at the limit
    unless it requeued itself. Undone (the limit set back) once the attempt it hit is over, before a
    next one starts with the lowered limit."""
    info = slurm.show_job(t.job) or {}
    start, limit = slurm.parse_time(info.get("StartTime")), slurm.parse_duration(info.get("TimeLimit"))
    if info.get("JobState") != "RUNNING" or start is None or limit is None:
        return Done(False, f"job {t.job} is {info.get('JobState', 'gone')} (TimeLimit {info.get('TimeLimit')})")
    elapsed = time.time() - start
    minutes = int((elapsed + t.warning_s) // 60)
    if minutes * 60 >= limit or minutes * 60 - elapsed < t.warning_s - 60:
        return Done(False, f"the time limit ({limit:.0f} s) is near already ({elapsed:.0f} s run)")
    rehearsal.set_time_limit(t.job, minutes)
    job, started = t.job, info.get("StartTime")

    def undo() -> str:
        def over() -> bool:
            now = slurm.show_job(job) or {}
            return now.get("JobState") != "RUNNING" or now.get("StartTime") != started

        waiting.until(over, poll=0.2, progress=lambda: current_step(t.run_dir),
                      what=f"job {job}'s attempt that met its lowered time limit to end")
        try:
            rehearsal.set_time_limit(job, int(limit // 60))
        except UserError:
            if slurm.is_active(slurm.job_state(job)):
                raise
            return f"job {job} ended (its lowered time limit goes with it)"
        return f"TimeLimit of job {job} back to {limit / 60:.0f} min"

    return Done(True, f"TimeLimit {limit / 60:.0f} -> {minutes} min ({minutes * 60 - elapsed:.0f} s left, the "
                      f"warning at {t.warning_s} s)", undo, {"minutes": minutes})


def disk_full(t: Target, f: Fault) -> Done:
    """The checkpoints' filesystem filled to the last byte by a file beside them (a save in flight
    meets ENOSPC, the next ones find no room), emptied again after the fault's hold."""
    if t.small_fs is None:
        return Done(False, "the run's checkpoints are not on a small filesystem of the campaign's own")
    filler = t.small_fs / FILLER
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        chunk = b"\0" * 65536
        while True:
            try:
                if os.write(fd, chunk if len(chunk) > 1 else b"\0") == 0:
                    break
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]  # the last pages, to the last byte
    finally:
        os.close(fd)
    size, st = filler.stat().st_size, os.statvfs(t.small_fs)

    def undo() -> str:
        filler.unlink(missing_ok=True)
        return f"{filler.name} removed from {t.small_fs}"

    return Done(True, f"{t.small_fs} filled ({size} bytes, {st.f_bavail * st.f_frsize} free)", undo,
                {"filled": size})


def batch_kill(t: Target, f: Fault) -> Done:
    """SIGKILL to the batch script's shell: the child of the batch step's slurmstepd (found by its
    socket in the batch node's spool directory)."""
    info = slurm.show_job(t.job) or {}
    host = info.get("BatchHost", "")
    if info.get("JobState") != "RUNNING" or not host:
        return Done(False, f"job {t.job} is {info.get('JobState', 'gone')}")
    socket_name = f"{t.layout.spool}/slurmd-{host}/{host}_{t.job}.{BATCH_STEP}"
    listing = subprocess.run(["ss", "-xlpn"], capture_output=True, text=True, check=True).stdout
    stepd = {int(p) for line in listing.splitlines() if socket_name in line for p in re.findall(r"pid=(\d+)", line)}
    shells = [pid for pid in _children(stepd)]
    if not shells:
        return Done(False, f"no batch script process under {socket_name}")
    _kill_all(shells)
    return Done(True, f"batch script of job {t.job} on {host} SIGKILLed (pid {shells})", facts={"pids": shells})


def keeper_kill(t: Target, f: Fault) -> Done:
    """SIGKILL to the job's keeper (its step on a node other than the batch script's: what SLURM 26.05
    sometimes does with it when the batch node fails): the batch script starts it again at its next
    restart in place; until then the run's watcher is the one left to see the batch node fail."""
    info = slurm.show_job(t.job) or {}
    if info.get("JobState") != "RUNNING":
        return Done(False, f"job {t.job} is {info.get('JobState', 'gone')}")
    needle = f"SLURM_JOB_ID={t.job}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):  # this run's (its directory is the keeper's argument): another
        try:                            # worker's cluster may run a job of the same id
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
            if b"lmtrain.task.keeper" in cmd and _keeps(cmd, t.run_dir) \
                    and needle in Path(f"/proc/{entry}/environ").read_bytes():
                pids.append(int(entry))
        except OSError:
            continue
    if not pids:
        return Done(False, f"no keeper of job {t.job} runs (not started yet, or between two attempts)")
    _kill_all(pids)
    return Done(True, f"the keeper of job {t.job} SIGKILLed (pid {pids})", facts={"pids": pids})


def _keeps(cmdline: bytes, run_dir: Path) -> bool:
    """Whether a keeper's command line (``... -m lmtrain.task.keeper RUN_DIR LOG``) names ``run_dir``."""
    args = cmdline.split(b"\0")
    at = args.index(b"lmtrain.task.keeper") if b"lmtrain.task.keeper" in args else -1
    return 0 <= at < len(args) - 1 and Path(os.fsdecode(args[at + 1])).resolve() == run_dir.resolve()


def watcher_kill(t: Target, f: Fault) -> Done:
    """SIGKILL to the run's watcher on the login side (`lmlaunch move RUN --watch`, which submit starts
    for a run with spare nodes), as a login node's restart ends it; undone as its user would, once
    `status` says it is not running: `lmlaunch move RUN --detach`."""
    if not watcher_alive(t.run_dir):
        return Done(False, f"no watcher of run {t.name} runs")
    needle = b"\0".join([b"move", t.name.encode(), b"--watch"])
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and needle in _cmdline(e)]
    if not pids:
        return Done(False, f"no watcher process of run {t.name} found")
    _kill_all(pids)

    def undo() -> str:
        code, out, err = lm(t.env, "status", t.name)
        said = "its watcher is not running" in " ".join(out.split())
        code, out, err = lm(t.env, "move", t.name, "--detach")
        assert code == 0, out + err
        return f"watcher started again (lmlaunch move {t.name} --detach; status had said it was gone: {said})"

    return Done(True, f"the run's watcher SIGKILLed (pid {pids})", undo, {"pids": pids})


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) or None
    except (OSError, IndexError, ValueError):
        return None


def _children(parents: set[int]) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _parent(int(e)) in parents]


INJECT: dict[str, Callable[[Target, Fault], Done]] = {
    "rank_kill": rank_kill, "task_kill": task_kill, "rank_stop": rank_stop, "node_down": node_down, "batch_host_down": batch_host_down,
    "preempt": preempt,
    "requeue": requeue, "time_limit": time_limit, "ctld_restart": ctld_restart, "dbd_stop": dbd_stop,
    "corrupt_checkpoint": corrupt_checkpoint, "disk_full": disk_full, "batch_kill": batch_kill,
    "keeper_kill": keeper_kill, "watcher_kill": watcher_kill, "gateway_stop": gateway_stop,
}


def inject(t: Target, f: Fault) -> Done:
    """Land ``f`` on ``t`` (SLURM's commands of t's cluster: the caller is inside its own_conf)."""
    try:
        return INJECT[f.kind](t, f)
    except (UserError, OSError, subprocess.SubprocessError) as exc:
        return Done(False, f"{type(exc).__name__}: {exc}"[:300])


def undo_when_possible(done: Done, *, attempts: int = 30, pause_s: float = 1.0) -> str:
    """Run ``done.undo`` until it works (a node is RESUMEd only once its tasks are gone); what it said."""
    assert done.undo is not None
    last = ""
    for _ in range(attempts):
        try:
            return done.undo()
        except (UserError, OSError, subprocess.SubprocessError) as exc:
            last = str(exc)
            time.sleep(pause_s)
    return f"undo failed: {last[:300]}"
