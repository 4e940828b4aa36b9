"""The local SLURM cluster itself: idempotent `up`, status, partitions set up for real
preemption, accounting, and a preempted job requeued with its restart count."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import waiting
from slurm_helpers import (
    cancel_orphaned_test_jobs,
    claim_session,
    release_worker,
    wait_accounted,
    wait_for,
    wait_terminal,
)
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.localcluster import cluster, workers
from launcher.localcluster.config import NODES, Layout, render_slurm_conf
from launcher.localcluster.daemons import running_from_pidfile
from lmcore.errors import UserError
from lmcore.slurm import admin as rehearsal, client as slurm

LMLAUNCH = str(Path(sys.executable).parent / "lmlaunch")


def _cli(*args: str, timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LMLAUNCH, *args], capture_output=True, text=True, timeout=timeout)


def test_cluster_up_on_a_running_cluster_reports_it_and_restarts_nothing(slurm_cluster):
    daemons = [slurm_cluster.pidfile(d) for d in ("slurmctld", *(f"slurmd-{n}" for n in NODES))]
    before = [running_from_pidfile(p) for p in daemons]
    proc = _cli("cluster", "up")
    assert proc.returncode == 0, proc.stderr
    assert "already running" in proc.stdout
    assert all(before) and [running_from_pidfile(p) for p in daemons] == before  # the same processes


def test_cluster_status_shows_daemons_nodes_and_partitions(slurm_cluster):
    proc = _cli("cluster", "status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for daemon in ("slurmctld", "slurmd n1", "slurmd n2", "slurmdbd", "mariadb"):
        line = next(x for x in out.splitlines() if x.strip().startswith(daemon))
        assert "pid " in line, line
    nodes = {n.name: n for n in slurm.nodes()}
    assert set(nodes) >= {"n1", "n2"}
    assert all(set(nodes[n].partitions) == {"low", "high"} for n in ("n1", "n2"))
    assert "low*" in out and "high" in out and "n[1-2]" in out


def test_partitions_are_set_up_for_requeue_preemption(slurm_cluster):
    cfg = slurm.config()
    assert cfg["PreemptType"] == "preempt/partition_prio"
    assert cfg["PreemptMode"] == "REQUEUE"
    assert cfg["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert cfg["ProctrackType"] == "proctrack/linuxproc"
    low, high = slurm.partition_config("low"), slurm.partition_config("high")
    assert low["Default"] == "YES" and high["Default"] == "NO"
    assert int(high["PriorityTier"]) > int(low["PriorityTier"])
    assert low["PreemptMode"] == "REQUEUE" and low["GraceTime"] == "30"
    # the live setting matches what `up` recorded (default: off, as the local profile says)
    sends = "preempt_send_user_signal" in cfg.get("SlurmctldParameters", "")
    assert sends is False or "preempt_send_user_signal" in Path(slurm_cluster.slurm_conf).read_text()


def test_preempt_user_signal_option_renders_slurmctld_parameter():
    layout = Layout(Path("/tmp/x"))
    on = render_slurm_conf(layout, user="root", preempt_send_user_signal=True)
    off = render_slurm_conf(layout, user="root", preempt_send_user_signal=False)
    assert "SlurmctldParameters=preempt_send_user_signal" in on.splitlines()
    assert "preempt_send_user_signal" not in off


def _sbatch(*args: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=HANG_S,
                          env=slurm.slurm_env())
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _preempt_n2(run_name: str, low: str, own_jobs: list[str]) -> None:
    """An exclusive job on `high` takes n2: wait until it requeued ``low`` and completed itself."""
    high = _sbatch("-J", run_name + "-high", "-p", "high", "-w", "n2", "-N", "1", "-n", "1", "--exclusive",
                   "-o", "/dev/null", "--wrap", "sleep 2")
    own_jobs.append(high)
    waiting.until(lambda: slurm.restart_count(low) >= 1, progress=waiting.watching(waiting.job(low), waiting.job(high)),
                  what=f"low job {low} requeued", explain=lambda: f"{slurm.show_job(low)}")
    assert wait_terminal(high) == "COMPLETED"


def test_exclusive_high_job_preempts_low_job_which_restarts_with_restart_count(slurm_cluster, tmp_path, own_jobs, run_name):
    marks = tmp_path / "attempts.txt"
    script = tmp_path / "low.sh"
    script.write_text(
        "#!/bin/bash\n"
        f'echo "attempt restart_count=${{SLURM_RESTART_COUNT:-0}} node=$SLURMD_NODENAME" >> {marks}\n'
        'if [ -n "$SLURM_RESTART_COUNT" ]; then exit 0; fi\n'
        "sleep 300\n"
    )
    # the low job holds n2 alone, so the high job preempts nobody else's work
    low = _sbatch("-J", run_name, "-p", "low", "-w", "n2", "-N", "1", "-n", "1", "--exclusive", "--requeue",
                  "-o", str(tmp_path / "low-%j.out"), str(script))
    own_jobs.append(low)
    wait_for(low, {"running"}, poll=0.5)
    _preempt_n2(run_name, low, own_jobs)
    # requeued jobs keep their id and wait ~2 min (BeginTime); start_now skips that
    assert wait_terminal(low) == "COMPLETED"
    lines = marks.read_text().splitlines()
    assert lines == ["attempt restart_count=0 node=n2", "attempt restart_count=1 node=n2"]

    wait_accounted(low)
    attempts = slurm.sacct([low], duplicates=True)
    states = [a.state.split()[0] for a in attempts]
    assert len(attempts) == 2 and states[-1] == "COMPLETED", attempts
    assert states[0] in {"PREEMPTED", "REQUEUED"}, attempts


def test_a_requeued_job_is_not_ready_to_start_while_its_failed_node_still_runs_its_last_run(
        slurm_cluster, tmp_path, own_jobs, run_name):
    """A node set DOWN: SLURM requeues the job at once and the node is back in service within a
    second, while its slurmd still kills the job's run (here the task outlives SIGTERM until the
    SIGKILL KillWait=10 s later: a task that took 6 s over it was gone, under load, before the
    test looked). Started meanwhile, the job would be killed with it (same job id):
    rehearsal.ready_to_start says no until the node's slurmd has no process of the job left."""
    script = tmp_path / "slow.sh"
    script.write_text("#!/bin/bash\n"
                      "srun bash -c 'trap \"sleep 300\" TERM; sleep 300 & wait; sleep 300'\n")
    job = _sbatch("-J", run_name, "-p", "low", "-w", "n2", "-N", "1", "--requeue",
                  "-o", str(tmp_path / "slow-%j.out"), str(script))
    own_jobs.append(job)
    wait_for(job, {"running"}, poll=0.5)
    # The srun step starts a moment after the batch script, whose shell (no trap) dies at once when
    # the node goes DOWN: set DOWN before the step ran, n2 had nothing of the job left to show (seen
    # in a parallel run). Wait for the step's own processes.
    waiting.until(lambda: _step_processes(job, "n2", "0"), progress=waiting.job(job), poll=0.2,
                  what="the job's step on n2 (`scontrol listpids`)")
    assert rehearsal.steps_left(job, ["n2"]) == ["n2"]
    assert rehearsal.steps_left(job, ["n1"]) == []
    # each running step daemon's socket, on its own node only (what counts once the tasks are gone)
    spool = slurm.config()["SlurmdSpoolDir"]
    assert [p.name for p in rehearsal.step_sockets(spool, "n2", job)] == [f"n2_{job}.0", f"n2_{job}.4294967291"]
    assert rehearsal.step_sockets(spool, "n1", job) == []
    # n2's step daemons stopped (SIGSTOP) until the state is read: their KillWait (10 s) cannot end the
    # run first, however slowly the test gets to look
    stopped = _step_daemons(spool, "n2", job)
    assert stopped, f"no step daemon of job {job} found by its sockets"
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        rehearsal.set_node_state("n2", "DOWN", reason=f"test {run_name}")
        assert wait_for(job, {"queued"}, poll=0.2) == "PENDING"
        assert rehearsal.steps_left(job, ["n2"]) == ["n2"]
        assert not rehearsal.ready_to_start(job)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    try:
        # KillWait=10 s after the SIGTERM; the kill itself, on a loaded machine, when slurmd gets to it
        waiting.until(lambda: not rehearsal.steps_left(job, ["n2"]), progress=waiting.job(job),
                      what="n2's slurmd done with the job after the node went DOWN")
    finally:
        with contextlib.suppress(UserError):  # ReturnToService=2 may have brought it back already
            rehearsal.set_node_state("n2", "RESUME")
    waiting.until(lambda: rehearsal.ready_to_start(job), progress=waiting.watching(waiting.job(job), _nodes),
                  what=f"job {job} ready to start", explain=lambda: f"{slurm.nodes()}")


def _nodes() -> tuple:
    return tuple((n.name, n.state) for n in slurm.nodes())


def _step_daemons(spool: str, node: str, job: str) -> list[int]:
    """The pids of the step daemons of ``job`` on ``node`` of this cluster: the processes holding the
    sockets in its spool directory (/proc/net/unix names each socket's inode; worker clusters reuse
    job ids, so a process title would not say which cluster's daemon it is)."""
    paths = {str(p) for p in rehearsal.step_sockets(spool, node, job)}
    inodes = {f[6] for f in (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
              if len(f) >= 8 and f[7] in paths}
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            if any(link == f"socket:[{inode}]" for inode in inodes for link in links):
                pids.append(int(pid))
    return pids


def _step_processes(job: str, node: str, step: str) -> list[str]:
    """The pids of step ``step`` of ``job`` on ``node``, as its slurmd tells (`scontrol listpids`)."""
    out = subprocess.run(["scontrol", "listpids", job, node], capture_output=True, text=True, timeout=HANG_S).stdout
    return [f[0] for f in (line.split() for line in out.splitlines()[1:]) if len(f) >= 3 and f[2] == step]


def test_jobs_of_a_test_session_that_is_gone_are_cancelled_and_live_ones_kept(slurm_cluster, tmp_path, own_jobs, run_name):
    """A killed session (or a machine snapshot restoring the controller's saved queue) leaves
    test jobs behind; the next session cancels them, never a live session's or a user's."""
    leases = tmp_path / "leases"
    dead_lease = leases / "dead00.json"
    leases.mkdir()
    dead_lease.write_text('{"pid": 1, "start": "-1"}')  # pid 1 lives, but started at another time
    hold = ["-p", "low", "-N", "1", "-n", "1", "--hold", "-o", "/dev/null", "--wrap", "sleep 60"]
    orphan = _sbatch("-J", "it-left-behind-dead00beef", *hold)
    untokened = _sbatch("-J", "it-from-before-tokens-b2feef", *hold)
    mine = _sbatch("-J", run_name, *hold)
    users = _sbatch("-J", f"a-users-job-{run_name}", *hold)
    own_jobs += [orphan, untokened, mine, users]
    claim_session(leases)  # this session, alive
    # only among these jobs: other sessions sharing the cluster hold no lease in tmp_path
    cancelled = {j.job_id for j in cancel_orphaned_test_jobs(leases, among=own_jobs)}
    assert cancelled == {orphan, untokened}
    assert not dead_lease.exists()
    assert slurm.job_state(mine) == "PENDING" and slurm.job_state(users) == "PENDING"
    assert slurm.state_group(slurm.job_state(orphan)) == "cancelled"


def _running_then_preempted_script(tmp_path: Path, tag: str) -> Path:
    script = tmp_path / f"{tag}.sh"
    marks = tmp_path / f"{tag}.txt"
    # ends at once on SIGTERM (the preemption), so the requeue shows within a second or two
    script.write_text(f'#!/bin/bash\necho "restart=${{SLURM_RESTART_COUNT:-0}}" >> {marks}\n'
                      "trap 'exit 0' TERM\nsleep 300 &\nwait\n")
    return script


def test_another_worker_cluster_is_untouched_by_a_preemption_on_this_one(slurm_cluster, tmp_path, own_jobs, run_name):
    """Parallel test workers each run a cluster of their own (launcher/localcluster/workers.py):
    an exclusive high-priority job here preempts this cluster's low job on n2, while a low job on
    n2 of another worker's cluster (its own controller, nodes, queue and accounting) runs on."""
    other = workers.claim()
    try:
        lines: list[str] = []
        cluster.up(lines.append, layout=other.layout, ports=other.ports, system_conf=False, accounting=True,
                   min_job_age=300)
        low = ["-p", "low", "-w", "n2", "-N", "1", "-n", "1", "--exclusive", "--requeue"]
        with cluster.own_conf(other.layout):
            theirs = _sbatch("-J", run_name + "-other", *low, "-o", "/dev/null",
                             str(_running_then_preempted_script(tmp_path, "theirs")))
            wait_for(theirs, {"running"}, poll=0.5)
        mine = _sbatch("-J", run_name, *low, "-o", "/dev/null", str(_running_then_preempted_script(tmp_path, "mine")))
        own_jobs.append(mine)
        wait_for(mine, {"running"}, poll=0.5)
        assert slurm.squeue([mine])[0].name == run_name  # this cluster's queue has its own job ...
        _preempt_n2(run_name, mine, own_jobs)
        with cluster.own_conf(other.layout):
            info = slurm.show_job(theirs) or {}
            assert info.get("JobName") == run_name + "-other", info  # ... and the other one its own
            assert info.get("JobState") == "RUNNING" and slurm.restart_count(theirs) == 0, info
            slurm.cancel([theirs])
        assert (tmp_path / "theirs.txt").read_text().splitlines() == ["restart=0"]
    finally:
        release_worker(other, run_name)


def test_cluster_up_with_more_nodes_runs_a_job_on_all_of_them_and_fewer_stops_the_extra_slurmd(tmp_path, run_name):
    """`cluster up --nodes 3` (on a worker's cluster of its own): a third slurmd, both partitions over
    n1..n3, a 3-node job runs on all three; `up` with 2 again stops n3's slurmd, and a later `up`
    keeps the count."""
    other = workers.claim()
    try:
        lines: list[str] = []
        cluster.up(lines.append, layout=other.layout, ports=other.ports, nodes=3, system_conf=False,
                   accounting=True, min_job_age=300)
        with cluster.own_conf(other.layout):
            assert cluster.nodes_ready(("n1", "n2", "n3"))
            out = tmp_path / "hosts.txt"
            job = _sbatch("-J", run_name, "-p", "low", "-N", "3", "-n", "3", "-o", str(out),
                          "--wrap", "srun bash -c 'echo $SLURMD_NODENAME'")
            assert wait_terminal(job) == "COMPLETED", slurm.show_job(job)
            assert sorted(out.read_text().split()) == ["n1", "n2", "n3"]
            assert cluster.up(lines.append, layout=other.layout, system_conf=False)  # no ports, no --nodes: 3 kept
            cluster.up(lines.append, layout=other.layout, ports=other.ports, nodes=2, system_conf=False)
            assert {n.name for n in slurm.nodes(timeout=HANG_S)} == {"n1", "n2"}
        assert not running_from_pidfile(other.layout.run / "slurmd-n3.pid")
        assert any("restarting slurmctld and the slurmds" in line for line in lines), lines
    finally:
        release_worker(other, run_name)
