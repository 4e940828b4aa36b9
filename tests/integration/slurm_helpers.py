"""Helpers shared by the integration tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import waiting

from launcher.localcluster import cluster
from launcher.localcluster.config import NODES, Layout
from lmcore.errors import UserError
from lmcore.slurm import admin as rehearsal, client as slurm

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"completed", "cancelled", "failed", "timeout", "preempted"}


def wait_terminal(job_id: str, *, watch: Iterable[Path] = ()) -> str:
    """Wait for one of our jobs to end (requeued attempts are started at once), while it advances
    (:func:`wait_for`)."""
    return wait_for(job_id, TERMINAL, poll=1.0, start_requeued=True, watch=watch)


# A run submitted with this override is queued held: it starts when the test releases it
# (``slurm.hold(job, release=True)``), so a state that its end would change (its dependents
# waiting, a run that "still has a job") is read before it can end.
HELD = "slurm.sbatch.hold=true"


def wait_reason(job: str, reason: str) -> None:
    """Wait until ``job`` pends with ``reason``, while it or the jobs ahead of it change."""
    waiting.until(lambda: any(j.reason == reason for j in slurm.squeue([job])), poll=1.0,
                  progress=waiting.watching(waiting.job(job), waiting.queue()), what=f"job {job} with reason {reason}",
                  explain=lambda: f"{slurm.squeue([job])}")


def requeues_once_more_after_preemption() -> bool:
    """SLURM 24.11 requeues a job that a preemption requeued once more when its next run ends
    (docs/architecture.md, "SLURM 22.05 and 24.11: what differed"); 22.05 does not, and neither
    does 26.05 (seen on 26.05.5 here; 25.05 and 25.11 never ran here and are taken as 24.11)."""
    version = slurm.config().get("SLURM_VERSION", "0.0")
    return (24, 11) <= tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (26, 5)


def release_worker(claim, run_name: str) -> None:
    """A test's extra worker cluster (workers.claim()) given back, its jobs named ``run_name...``
    cancelled first."""
    from launcher.localcluster import cluster

    with cluster.own_conf(claim.layout):
        mine = [j.job_id for j in slurm.squeue() if j.name.startswith(run_name)]
        if mine:
            slurm.cancel(mine)
    claim.release()


@contextlib.contextmanager
def own_worker_cluster(run_prefix: str, *, nodes: int = 2, topology: str = "none", gpus: str = "none"):
    """A worker cluster of a test module's own (workers.claim()), started with ``nodes``, ``topology``
    and ``gpus``, on the SLURM version the phase runs; afterwards its nodes resumed (a node failure
    leaves one DOWN), back to 2 CPU nodes without a topology, its jobs named ``run_prefix...``
    cancelled and the claim given back."""
    from launcher.localcluster import workers

    version = os.environ.get("LMLAUNCH_TEST_SLURM") or None
    claim = workers.claim(version)
    names = tuple(f"n{i}" for i in range(1, nodes + 1))
    lines: list[str] = []
    try:
        cluster.up(lines.append, layout=claim.layout, ports=claim.ports, system_conf=False, accounting=True,
                   min_job_age=300, version=version, nodes=nodes, topology=topology, gpus=gpus)
        with cluster.own_conf(claim.layout):
            assert cluster.nodes_ready(names), lines
        yield claim
    finally:
        with cluster.own_conf(claim.layout):
            for node in names:
                with contextlib.suppress(UserError):
                    rehearsal.set_node_state(node, "RESUME")
        cluster.up(lines.append, layout=claim.layout, ports=claim.ports, system_conf=False, version=version,
                   nodes=2, topology="none", gpus="none")
        release_worker(claim, run_prefix)


def profile_off(claim, environ: dict[str, str], profiles: Path, name: str) -> dict[str, str]:
    """A profile read off ``claim``'s cluster by `lmlaunch profile init NAME` into ``profiles``; the
    environment that uses it (that cluster's commands, LMLAUNCH_PROFILES_DIR)."""
    from preempt_helpers import lm

    env = {**environ, **claim.environ(), "LMLAUNCH_PROFILES_DIR": str(profiles)}
    with cluster.own_conf(claim.layout):  # SLURM's commands here read this cluster, as a user's shell would
        code, out, err = lm(env, "profile", "init", name, "-o", str(profiles / f"{name}.yaml"))
    assert code == 0, out + err
    return env


def wait_accounted(job_id: str) -> slurm.AccountedJob:
    """sacct lags the controller by a moment (more under load): wait until accounting has the
    final state, while what it reports of the job changes."""
    rows: list[slurm.AccountedJob] = []

    def final() -> slurm.AccountedJob | None:
        rows[:] = slurm.sacct([job_id])
        return rows[-1] if rows and rows[-1].group in TERMINAL else None

    return waiting.until(final, progress=lambda: tuple(rows), poll=1.0,
                         what=f"sacct's final state of job {job_id}", explain=lambda: f"sacct: {rows}")


# --------------------------------------------------------------------------- test sessions
#
# Every job a test submits is named `<it|pr>-<stem>-<SESSION><random>`, so a session can tell its
# jobs from those of a test session that is gone: a run that was killed, or a machine snapshot
# whose saved controller state comes back with the queue it had (seen in CI: a two-node job from
# an earlier session held n2 and the first test's job stayed PENDING for 120 s). Sessions running
# now (helpers sharing the cluster) hold a lease file with their pid and its start time.

SESSION = secrets.token_hex(3)
TEST_JOB = re.compile(r"^(?:preempt-)?(?:it|pr)-")


def job_name(prefix: str, stem: str) -> str:
    """A unique test job name carrying this session's token."""
    return f"{prefix}-{stem}-{SESSION}{uuid.uuid4().hex[:4]}"


def _proc_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks since boot


def _lease_alive(path: Path) -> bool:
    try:
        lease = json.loads(path.read_text())
        return _proc_start(int(lease["pid"])) == str(lease["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def claim_session(lease_dir: Path) -> Path:
    """Write this session's lease; return its path (remove it when the session ends)."""
    lease_dir.mkdir(parents=True, exist_ok=True)
    path = lease_dir / f"{SESSION}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "start": _proc_start(os.getpid())}))
    return path


def cancel_orphaned_test_jobs(lease_dir: Path, *, among: list[str] | None = None) -> list[slurm.QueuedJob]:
    """Cancel test jobs (of ``among``, default all) no live session owns, and drop dead leases;
    wait until they are gone. Jobs with other names (a user's, the demo's) are never touched."""
    live = set()
    for lease in lease_dir.glob("*.json"):
        if _lease_alive(lease):
            live.add(lease.stem)
        else:
            lease.unlink(missing_ok=True)
    orphans = [
        j for j in (slurm.squeue(among) if among is not None else slurm.squeue())
        if TEST_JOB.match(j.name) and slurm.is_active(j.state) and not any(f"-{t}" in j.name for t in live)
    ]
    if orphans:
        slurm.cancel([j.job_id for j in orphans])
        ids = [j.job_id for j in orphans]
        waiting.until(lambda: not any(slurm.is_active(j.state) for j in slurm.squeue(ids)),
                      progress=waiting.queue(ids), what=f"orphaned test jobs {ids} gone after scancel")
    return orphans


# A smaller GPT-2 than tiny-cpu.yaml's (n_embd 128, seq 128) for the tests whose claim does not
# depend on the model's size (resumes bit for bit, states, signals, hangs): a tiny-cpu step costs
# ~0.4 CPU-s per rank on this machine, this one a small fraction of that, so that the suite's
# parallel workers share the 2 cores for what each test is about. (test_submit_tiny_cpu_trains
# trains the spec as shipped.)
SMALL_MODEL = ("model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=64", "data.seq_len=64")
# A test that acts on a running job (preempts it, fails a node, stops the controller) needs the
# steps to take about as long as tiny-cpu's do: a sleep after each batch paces them without
# burning CPU (a sleep changes no number).
PACE_S = 0.2


def pace(seconds: float = PACE_S) -> dict:
    """The fault-seam rule that sleeps ``seconds`` after every training batch on every rank."""
    return {"point": "train.batch_end", "action": "sleep", "seconds": seconds}


def gate(point: str, until: Path | None = None, **fields) -> dict:
    """The fault-seam rule that holds every matching task at ``point`` until it is told to stop
    (a preemption's signal, SLURM's SIGTERM) or, given ``until``, until that file exists (the test
    creates it once it has read the state the run would otherwise leave)."""
    return {"point": point, "action": "gate", **({"until": str(until)} if until else {}), **fields}


@contextlib.contextmanager
def faults(*rules: dict):
    """Turn lmtrain's fault-injection seam (lmtrain.faults) on for the jobs submitted inside the
    block: SLURM hands a job the environment it was submitted from (sbatch --export=ALL, its
    default), and requeued attempts keep it. A job spec cannot turn it on. Nested blocks add
    their rules to the outer ones'."""
    if not rules:  # nothing to add: the environment as it is (its LMLAUNCH_FAULTS may name a file)
        yield
        return
    old = os.environ.get("LMLAUNCH_FAULTS")
    os.environ["LMLAUNCH_FAULTS"] = json.dumps([*(json.loads(old) if old else []), *rules])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LMLAUNCH_FAULTS", None)
        else:
            os.environ["LMLAUNCH_FAULTS"] = old


@contextlib.contextmanager
def webhook_server():
    """A local HTTP endpoint the tasks can reach (the nodes are this machine): yields its URL and
    the JSON bodies it received, in order."""
    import http.server
    import threading

    received: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()


def wait_for(
    job_id: str,
    groups: Iterable[str],
    *,
    poll: float = 2.0,
    start_requeued: bool = False,
    watch: Iterable[Path] = (),
) -> str:
    """Poll until the job's state falls in one of ``groups`` (e.g. {'running'}); return the
    SLURM state. Waits while the job advances (tests/waiting.py): its state, reason and output,
    its run directory, the cluster's queue, the files under ``watch``; fails (waiting.Stalled)
    when none of them changed for waiting.STALL_S, with the last state seen, the pending reason and
    what the nodes run. With ``start_requeued``, a job pending on its requeue BeginTime is started
    once it has waited 2 s and no node is still completing a job or running its previous run
    (:func:`lmcore.slurm.admin.ready_to_start`; started within the second of its requeue, SLURM kills it: 'Job
    credential revoked')."""
    wanted = set(groups)
    seen = ["UNKNOWN"]
    pending_since: dict[str | None, float] = {}

    def arrived() -> str | None:
        seen[0] = slurm.job_state(job_id)
        return seen[0] if slurm.state_group(seen[0]) in wanted else None

    def start_requeued_job() -> None:
        if start_requeued and seen[0] == "PENDING":
            info = slurm.show_job(job_id) or {}
            if info.get("Reason") == "BeginTime":
                first = pending_since.setdefault(info.get("Restarts"), time.monotonic())
                if time.monotonic() - first >= 2.0 and rehearsal.ready_to_start(job_id):
                    rehearsal.start_now(job_id)

    return waiting.until(
        arrived, poll=poll, on_poll=start_requeued_job,
        progress=waiting.watching(waiting.job(job_id), waiting.queue(), waiting.tree(*watch)),
        what=f"job {job_id} in {sorted(wanted)}",
        explain=lambda: f"job {job_id} {seen[0]}" + _why_waiting(job_id))


def _why_waiting(job_id: str) -> str:
    """For a timeout message: the job's reason and the other active jobs (best effort)."""
    try:
        info = slurm.show_job(job_id) or {}
        others = [f"{j.job_id} {j.name} {j.state} on {j.nodelist or '-'} ({j.partition})"
                  for j in slurm.squeue() if j.job_id != job_id and slurm.is_active(j.state)]
    except UserError:
        return ""
    return (f"; reason {info.get('Reason', '?')}, nodes {info.get('ReqNodeList', '?')}; other active jobs: "
            + ("; ".join(others) or "none"))


def wait_nodes_usable(*, layout: Layout | None = None) -> None:
    """Block until both nodes of the local cluster are usable (after a test ran a job that drained
    one, or cancelled another session's jobs), while the nodes' states or the queue change."""
    with cluster.own_conf(layout or Layout.default()):
        waiting.until(cluster.nodes_ready, progress=waiting.watching(_node_states, waiting.queue()),
                      what=f"nodes {', '.join(NODES)} usable", explain=lambda: "see `lmlaunch cluster status`")


def _node_states() -> tuple:
    return tuple(sorted((n.name, n.state) for n in slurm.nodes()))


class DutyCycle:
    """Stops and continues a process: ``stopped_s`` of every ``stopped_s + running_s``."""

    def __init__(self, pid: int, *, stopped_s: float = 0.06, running_s: float = 0.04) -> None:
        self.pid, self.stopped_s, self.running_s = pid, stopped_s, running_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the process ended (its attempt did): nothing to slow
            while not self.done.is_set():
                try:
                    os.kill(self.pid, signal.SIGSTOP)
                    self.done.wait(self.stopped_s)
                finally:
                    os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.running_s)

    def __enter__(self) -> DutyCycle:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
