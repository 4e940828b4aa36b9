"""Each SLURM task's agent (lmtrain.task.agent): the settings and the decision as tables, and the
protocol between the agents of one step with real processes: forks, verdict files, signals
forwarded and kept, last words, and the exit srun sees. The frameworks' imports are left out
(``_preload``), and SLURM's preemption answer is given; the training process is a small body."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import waiting

from lmcore.run.rundir import LastWords, RunLayout
from lmtrain.task.agent import VERDICT_MARGIN_S, owner_alive, settings_of, takes_restart

ROOT = Path(__file__).resolve().parents[2]
PLAN = {"preemption": {"restart_in_place": True, "warm_restart": True, "signal": "USR2"},
        "spec": {"watchdog": {"collective_timeout_s": 1800, "hang_timeout_s": 1200, "exit_grace_s": 15}},
        "topology": {"accelerator": "cpu", "parallelism": {"zero_stage": None}},
        "paths": {"run_dir": "/runs/r"}}
SLURM = {"SLURM_PROCID": "1", "SLURM_JOB_ID": "77"}


@pytest.mark.parametrize("change, env, expected", [
    ({}, SLURM, True),
    ({"preemption": {"restart_in_place": False, "warm_restart": True}}, SLURM, False),
    ({"preemption": {"restart_in_place": True, "warm_restart": False}}, SLURM, False),
    ({"preemption": {"restart_in_place": True}}, SLURM, False),  # a plan from before warm restarts
    ({}, {"SLURM_JOB_ID": "77"}, False),  # not a SLURM task
    ({}, {"SLURM_PROCID": "0"}, False),
])
def test_settings_only_for_a_slurm_task_of_a_run_that_restarts_in_place_warm(change, env, expected):
    s = settings_of({**PLAN, **change}, env)
    assert (s is not None) == expected
    if s is not None:
        assert (s.rank, s.job_id, str(s.run_dir)) == (1, "77", "/runs/r")
        assert s.verdict_wait_s == 1800 + 15 + VERDICT_MARGIN_S  # rank 0 may take its longest timeout to decide
        assert s.stopped_s == 1200 + 15  # a stopped process: the hang watchdog's limit, which it cannot see itself
        assert not s.preload_deepspeed


def test_a_stopped_process_is_told_and_the_hang_watchdog_off_lets_it_be():
    """SIGSTOP stops a training process's own watchdog thread with it (a chaos campaign's rank 0,
    stopped, held its job until the time limit): its agent stands in, by /proc's state."""
    from lmcore.processes import is_stopped

    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        waiting.until(lambda: is_stopped(proc.pid), progress=lambda: 0, what="the process stopped")
        os.kill(proc.pid, signal.SIGCONT)
        waiting.until(lambda: not is_stopped(proc.pid), progress=lambda: 0, what="the process continued")
    finally:
        proc.kill()
        proc.wait()
    assert not is_stopped(proc.pid)  # gone
    off = {**PLAN, "spec": {"watchdog": {"collective_timeout_s": 1800, "hang_timeout_s": 0, "exit_grace_s": 15}}}
    assert settings_of(off, SLURM).stopped_s == 0


def test_deepspeed_is_preloaded_on_cpu_only():
    zero = {"parallelism": {"zero_stage": 2}}
    assert settings_of({**PLAN, "topology": {"accelerator": "cpu", **zero}}, SLURM).preload_deepspeed
    assert not settings_of({**PLAN, "topology": {"accelerator": "gpu", **zero}}, SLURM).preload_deepspeed


@pytest.mark.parametrize("said, taken", [
    (["77", "", "restart"], True),
    (["77", ""], True),  # older rank 0 code: the file held only restarts
    (["77", "n2", "restart"], False),  # a node left out: a new srun with --exclude
    (["76", "", "restart"], False),  # another job's
    (["77", "", "requeue"], False),
    (["77", "", "none"], False),
    ([], False),  # rank 0 never decided
])
def test_only_this_jobs_restart_that_leaves_no_node_out_is_the_agents(said, taken):
    assert takes_restart(said, "77") is taken


def test_owner_alive_outside_podman_and_while_the_client_lives():
    assert owner_alive({})
    assert owner_alive({"LMLAUNCH_TASK_PID": str(os.getpid())})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not owner_alive({"LMLAUNCH_TASK_PID": str(gone.pid)})


# One agent; its training process is BODY: by generation, what it does (GENERATION_VAR is set).
AGENT = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from lmtrain.preemption.signals import own_signals
    from lmtrain.task.agent import TaskAgent, settings_here

    import lmtrain.task.verdicts
    lmtrain.task.verdicts.READY_WAIT_S = float(os.environ.get("READY_WAIT_S", "60"))
    lmtrain.task.verdicts.SILENT_S = float(os.environ.get("SILENT_S", "90"))
    lmtrain.task.verdicts.BEAT_LOOK_S = 0.2
    owner = own_signals({"signal": "USR2"})
    class Agent(TaskAgent):
        def _preload(self):
            return True
        def preempting(self):
            return os.environ.get("PREEMPTING") == "1"
    Agent(settings_here(), owner).serve()
    # the training process
    gen = int(os.environ["LMLAUNCH_STEP_GENERATION"])
    rank = int(os.environ["SLURM_PROCID"])
    run = Path(os.environ["LMLAUNCH_RUN_DIR"])
    key = f"77-0-g{gen}" if gen else "77-0"
    (run / f"seen-{rank}-{gen}").write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(),
        "undecided": os.environ.get("LMLAUNCH_UNDECIDED_END")}))
    if rank == 0:
        (run / "rendezvous").mkdir(exist_ok=True)
        (run / "rendezvous" / f"{key}.json").write_text(json.dumps({"attempt": gen + 1}))
    exec(os.environ["BODY"])
""")


def _agents(run_dir: Path, body: str, world: int = 2, per_node: int | None = None, **extra: str) -> list[subprocess.Popen]:
    """``world`` agents; with ``per_node``, on nodes of that many tasks as srun places them (the
    node's agents then share a directory, lmtrain.distributed.node_share, under run_dir/shm)."""
    (run_dir / "plan.json").write_text(json.dumps({**PLAN, "paths": {"run_dir": str(run_dir)}}))
    script = run_dir / "agent.py"
    script.write_text(AGENT)
    procs = []
    for rank in range(world):
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "SLURM_NTASKS": str(world), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "localhost",
               "LMLAUNCH_RUN_DIR": str(run_dir), "BODY": textwrap.dedent(body), "PYTHONPATH": str(ROOT),
               "LMLAUNCH_UNDECIDED_END": "137", **extra}
        if per_node:
            env.update({"SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
                        "SLURMD_NODENAME": f"n{rank // per_node + 1}", "LMLAUNCH_NODE_LOCAL": str(run_dir / "shm"),
                        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{world // per_node})"})
        env.pop("LMLAUNCH_STEP_GENERATION", None)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=run_dir,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _ended(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    waiting.until(lambda: all(p.poll() is not None for p in procs), progress=_cpu(procs),
                  what="the agents ended", explain=lambda: str([p.poll() for p in procs]), poll=0.1)
    return [(p.returncode, p.stdout.read()) for p in procs]


def _cpu(procs: list[subprocess.Popen]):
    return waiting.watching(*(waiting.process_cpu(p.pid) for p in procs))


# rank 1 dies of SIGKILL in generation 0 (once rank 0 published the attempt); rank 0 writes its decision as the controller does, then exits 1
CRASH_THEN_COMPLETE = """
    if gen == 0 and rank == 1:
        while not (run / "rendezvous" / "77-0.json").exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    if gen == 0:
        while rank == 0 and not any('"rank": 1' in p.read_text() for p in (run / "logs").rglob("exit-*.jsonl")):
            time.sleep(0.02)
        (run / "RESTART_IN_PLACE").write_text("77\\n\\nrestart\\n")
        sys.exit(1)
    if rank == 0:
        (run / "RESTART_IN_PLACE").write_text("77\\n\\nnone\\n")
    sys.exit(0)
"""


def test_a_restart_rank_0_decided_is_forked_again_in_the_same_step_by_every_agent(tmp_path):
    results = _ended(_agents(tmp_path, CRASH_THEN_COMPLETE))
    assert [code for code, _ in results] == [0, 0], results
    layout = RunLayout.of(tmp_path)
    assert layout.verdict_file("77-0").read_text().strip() == "fork"
    assert os.listdir(layout.ready_dir("77-0")) == ["1"]  # rank 1's agent said it was ready
    assert layout.verdict_file("77-0-g1").read_text().strip() == "exit"
    # generation 1 of both ranks ran, forked by the same agent as generation 0; the undecided end
    # the batch script exported applies to generation 0 only (rank 0 decided the restart)
    for rank in (0, 1):
        g0, g1 = (json.loads((tmp_path / f"seen-{rank}-{g}").read_text()) for g in (0, 1))
        assert g0["ppid"] == g1["ppid"] and g0["pid"] != g1["pid"]
        assert (g0["undecided"], g1["undecided"]) == ("137", "")
    # rank 0's restart request was taken by the agents; the one left is generation 1's "none",
    # which the batch script reads after the step
    assert layout.restart_request.read_text().splitlines()[2] == "none"
    words = LastWords.read_all(tmp_path, 1)
    assert [(w.rank, w.how, w.detail, w.source) for w in words] == [(1, "signal", "SIGKILL", "task's agent")]
    assert "restarting the ranks in place in this srun step (generation 1)" in results[0][1]


def test_on_nodes_of_several_tasks_one_agent_per_node_reads_the_word_and_says_its_node_is_ready(tmp_path):
    """4 ranks on 2 nodes of 2: rank 1 (node 0's second task) is killed; rank 0's agent writes
    the word for the run and for its node; node 1's leader (rank 2) reads it for its node and, once
    rank 3 said it was ready in their node's directory, says so for the node: one file, ``node-1``."""
    results = _ended(_agents(tmp_path, CRASH_THEN_COMPLETE, world=4, per_node=2))
    assert [code for code, _ in results] == [0, 0, 0, 0], results
    layout = RunLayout.of(tmp_path)
    assert layout.verdict_file("77-0").read_text().strip() == "fork"
    ready = layout.ready_dir("77-0")
    assert os.listdir(ready) == ["node-1"] and (ready / "node-1").read_text().strip() == "2"
    for rank in range(4):  # generation 1 of every rank, forked by its agent
        g0, g1 = (json.loads((tmp_path / f"seen-{rank}-{g}").read_text()) for g in (0, 1))
        assert g0["ppid"] == g1["ppid"] and g0["pid"] != g1["pid"]
    assert not any((tmp_path / "shm").iterdir()), "the nodes' leaders remove their directories at the end"
    assert "restarting the ranks in place in this srun step (generation 1)" in results[0][1]


def test_a_restart_that_leaves_a_node_out_or_a_preempted_job_ends_the_step_for_the_batch_script(tmp_path):
    body = """
    if rank == 0:
        (run / "RESTART_IN_PLACE").write_text("77\\nn2\\nrestart\\n")
    sys.exit(3)
    """
    results = _ended(_agents(tmp_path, body))
    assert [code for code, _ in results] == [3, 3], results
    assert RunLayout.of(tmp_path).verdict_file("77-0").read_text().strip() == "exit"
    assert RunLayout.of(tmp_path).restart_request.exists()  # left for the batch script's loop
    assert not (tmp_path / "seen-0-1").exists()
    (tmp_path / "RESTART_IN_PLACE").unlink()
    body = """
    if rank == 0:
        (run / "RESTART_IN_PLACE").write_text("77\\n\\nrestart\\n")
    sys.exit(1)
    """
    results = _ended(_agents(tmp_path, body, PREEMPTING="1"))
    assert [code for code, _ in results] == [1, 1], results
    assert "the job is being preempted" in results[0][1]
    assert RunLayout.of(tmp_path).restart_request.exists()


def test_rank_0_killed_before_it_decided_ends_the_agents_as_it_ended(tmp_path):
    """No decision: the agents end the step, rank 0's agent by the same SIGKILL (srun's "task 0:
    Killed", the batch script's undecided restart), the others with their process's code."""
    body = """
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(1)
    """
    results = _ended(_agents(tmp_path, body))
    assert [code for code, _ in results] == [-signal.SIGKILL, 1], results


def test_signals_are_forwarded_to_the_training_process_and_kept_for_the_next(tmp_path):
    """SIGUSR2 to the agent alone reaches its training process; one that arrives while rank 0's
    process has asked for a restart is acted on by the next (its stop request carried over)."""
    body = """
    from lmtrain.preemption import signals
    stop = signals._EARLY.stop
    if gen == 0:
        (run / "ready").write_text("")
        while not stop.requested:
            time.sleep(0.01)
        (run / "RESTART_IN_PLACE").write_text("77\\n\\nrestart\\n")
        sys.exit(1)
    (run / "carried").write_text(f"{stop.requested} {stop.reason} {stop.detail}")
    (run / "RESTART_IN_PLACE").write_text("77\\n\\nnone\\n")
    sys.exit(0)
    """
    procs = _agents(tmp_path, body, world=1)
    waiting.until(lambda: (tmp_path / "ready").exists(), progress=_cpu(procs), what="generation 0 started",
                  explain=lambda: str(procs[0].poll()))
    procs[0].send_signal(signal.SIGUSR2)
    results = _ended(procs)
    assert results[0][0] == 0, results
    assert (tmp_path / "carried").read_text() == "True timeout SIGUSR2"


def test_the_training_process_dies_with_its_agent(tmp_path):
    body = """
    (run / "ready").write_text("")
    time.sleep(600)
    """
    procs = _agents(tmp_path, body, world=1)
    waiting.until(lambda: (tmp_path / "ready").exists(), progress=_cpu(procs), what="generation 0 started",
                  explain=lambda: str(procs[0].poll()))
    worker = json.loads((tmp_path / "seen-0-0").read_text())["pid"]
    procs[0].kill()
    procs[0].wait()

    def gone() -> bool:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{worker}/stat").read_text().split()[2] == "Z"

    waiting.until(gone, progress=lambda: None, what="the training process ended with its agent",
                  explain=lambda: f"pid {worker} alive", poll=0.1)


def _agent_dies(dead: int, then: str = "") -> str:
    """A body: rank ``dead`` kills its own agent (and dies with it); the others wait for that, do
    ``then`` and exit 1."""
    return f"""
    if rank == {dead}:
        (run / "agent-{dead}").write_text(str(os.getppid()))
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(600)  # dies with its agent
    while not (run / "agent-{dead}").exists():
        time.sleep(0.02)
    {then}
    sys.exit(1)
    """


def test_an_agent_gone_with_its_node_ends_the_step_for_the_batch_script(tmp_path):
    """Rank 1's agent dies (its node gone: slurmd and every process of the step killed), its
    training process with it; rank 0's agent proposes the restart, hears nothing from rank 1 within
    READY_WAIT_S and ends the step, leaving rank 0's decision for the batch script's new srun."""
    body = _agent_dies(1, then='(run / "RESTART_IN_PLACE").write_text("77\\n\\nrestart\\n")')
    results = _ended(_agents(tmp_path, body, READY_WAIT_S="1"))
    assert [code for code, _ in results] == [1, -signal.SIGKILL], results
    layout = RunLayout.of(tmp_path)
    assert layout.verdict_file("77-0").read_text().strip() == "exit"
    assert layout.restart_request.read_text().splitlines()[2] == "restart"  # the batch script's to act on
    assert "1 of the other ranks' agents did not answer within 1 s" in results[0][1], results[0][1]
    assert not (tmp_path / "seen-0-1").exists()


def test_rank_0s_whole_task_killed_ends_the_others_once_its_agent_is_silent(tmp_path):
    """Rank 0's agent dies with its training process (SLURM killed the step on rank 0's node only, or
    the OOM killer took the task's cgroup): nobody will ever give a word. Rank 1's agent, its
    training process ended, hears no beat from rank 0's agent for SILENT_S and ends its task with its
    process's code: srun ends and the batch script restarts the ranks (rank 0 never decided), rather
    than the step waiting out the collective timeout (30 minutes by default)."""
    results = _ended(_agents(tmp_path, _agent_dies(0), SILENT_S="1"))
    assert [code for code, _ in results] == [-signal.SIGKILL, 1], results
    assert "rank 0's agent has said nothing for" in results[1][1], results[1][1]
    assert not RunLayout.of(tmp_path).verdict_file("77-0").exists()


class _Settings:
    rank, share = 1, None


def test_rank_0s_beat_is_read_by_content_once_a_look_and_silent_only_past_the_limit(tmp_path):
    from lmtrain.task.verdicts import BEAT_LOOK_S, SILENT_S, Verdicts

    layout = RunLayout.of(tmp_path)
    heard = Verdicts(_Settings(), layout, lambda: "77-0")
    beat = layout.agent_beat_file("77-0")
    assert heard.rank0_silent(now=100.0) is None  # the wait's start: no beat yet counts as heard now
    assert heard.rank0_silent(now=100.0 + SILENT_S + 1) == SILENT_S + 1  # never written since: gone
    heard = Verdicts(_Settings(), layout, lambda: "77-0")
    beat.parent.mkdir(parents=True)
    t = 0.0
    while t < 3 * SILENT_S:  # a living agent rewrites it every second: never silent, however long the wait
        beat.write_text(f"{t}\n")
        t += BEAT_LOOK_S + 1
        assert heard.rank0_silent(now=t) is None
    assert heard.rank0_silent(now=t + BEAT_LOOK_S / 2) is None  # not read again within a look
    assert heard.rank0_silent(now=t + SILENT_S / 2) is None  # unchanged, within the limit
    assert heard.rank0_silent(now=t + SILENT_S + 1) == SILENT_S + 1  # unchanged past it

    class Rank0(_Settings):
        rank = 0

    beating = Verdicts(Rank0(), layout, lambda: "77-1")
    beating.beat(now=5.0)
    first = layout.agent_beat_file("77-1").read_text()
    beating.beat(now=5.5)  # within BEAT_S: not rewritten
    assert layout.agent_beat_file("77-1").read_text() == first
    Verdicts(_Settings(), layout, lambda: "77-2").beat(now=9.0)  # another rank's agent never beats
    assert not layout.agent_beat_file("77-2").exists()
