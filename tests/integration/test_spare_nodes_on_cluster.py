"""Spare nodes on the real cluster: a 2-node run with ``resources.spare_nodes: 1`` on a worker
cluster grown to three nodes (`cluster up --nodes 3`).

- (A node its ranks run on set DOWN mid-run, as `lmlaunch preempt --mode node-failure` does it,
  and replaced by the spare in place: the chaos campaign's node failure met alone,
  tests/integration/test_chaos.py, in every run; with GPUs, test_gpus_on_cluster.py.)
- The node dies outright (its slurmd and every process of the job on it SIGKILLed): nobody on it
  says anything, SLURM declares it DOWN only after SlurmdTimeout, and the ranks go on on the
  spare through the batch script's new srun.
- A rank slowed from outside (stopped and continued in a duty cycle) with
  ``health.stragglers.action: exclude``: rank 0's straggler watch names it, the attempt stops at
  a step boundary with a checkpoint, and the ranks restart in place without its node.

Either way: the same SLURM job, never requeued, and the run ends bit-identical to the
uninterrupted one (the shared reference of test_preempt_resume.py)."""

from __future__ import annotations

import contextlib

import pytest
import waiting
from chaos_faults import kill_job_on_node
from preempt_helpers import (
    EVERY,
    MAX_STEPS,
    assert_losses_match,
    assert_weights_identical,
    ddp_reference,
    ends,
    finish,
    held_at,
    ledger,
    run_progress,
    starts,
    submit,
    wait_held,
)
from shared_results import shared
from slurm_helpers import DutyCycle, job_name, release_worker

from launcher.localcluster import cluster, workers
from lmcore.errors import UserError
from lmcore.run.task_records import read_task_records
from lmcore.slurm import admin as rehearsal, client as slurm


@pytest.fixture(scope="module")
def reference(slurm_cluster, module_env, module_jobs):
    return shared("preempt-ddp-reference", lambda: ddp_reference(module_env, module_jobs))


@pytest.fixture
def three_nodes(slurm_cluster):
    """A worker cluster of this test's own with three nodes, back to two afterwards."""
    other = workers.claim()
    lines: list[str] = []
    try:
        cluster.up(lines.append, layout=other.layout, ports=other.ports, nodes=3, system_conf=False,
                   accounting=True, min_job_age=300)
        with cluster.own_conf(other.layout):
            assert cluster.nodes_ready(("n1", "n2", "n3")), lines
            yield other
    finally:
        with cluster.own_conf(other.layout), contextlib.suppress(UserError):
            rehearsal.set_node_state("n2", "RESUME")  # preempt resumes it; a failed test may not have
        cluster.up(lines.append, layout=other.layout, ports=other.ports, nodes=2, system_conf=False)
        release_worker(other, "sp-")


def test_a_node_whose_slurmd_and_processes_die_is_replaced_by_the_spare_in_the_same_job(
        reference, module_env, module_jobs, three_nodes, tmp_path):
    """n2 dies (slurmd and every process of the job on it SIGKILLed; nobody there says anything):
    rank 0 finds rank 1 gone without a word and decides a restart in place; rank 1's agent never
    answers, so rank 0's agent ends the step; SLURM declares n2 DOWN after SlurmdTimeout and takes
    it out of the allocation (--no-kill), and the batch script's new srun runs on n1 and the spare.
    The same job, never requeued, bit-identical to the uninterrupted run."""
    env = {**module_env, **three_nodes.environ()}
    name = job_name("sp", "node-dies")
    released = tmp_path / "released"  # the ranks held at a step until n2 died: it cannot end first
    job, run_dir = submit(env, name, "resources.spare_nodes=1", holds=(held_at(EVERY + 3, until=released),))
    module_jobs.append(job)
    wait_held(run_dir, EVERY + 3)
    assert starts(run_dir)[0]["nodes"] == ["n1", "n2"], starts(run_dir)
    killed = kill_job_on_node(three_nodes.layout, "n2", job)  # as a node that loses power: nobody there says a word
    assert len(killed) >= 2, killed  # its slurmd and the job's step daemon there, at least
    released.touch()  # rank 0 goes on, to find rank 1 gone
    finish(job, run_dir)

    end = ends(run_dir)[0]
    assert end["restart"] == "in_place" and end["first_death"]["rank"] == 1, end
    assert end["first_death"]["node"] == "n2", end
    second = starts(run_dir)[1]
    assert (second["nodes"], second["job_id"], second["restart_count"]) == (["n1", "n3"], job, 0), second
    assert slurm.restart_count(job) == 0  # one allocation: SLURM never requeued it
    last = ends(run_dir)[-1]
    assert (last["reason"], last["end_step"]) == ("completed", MAX_STEPS), last
    assert_losses_match(run_dir, reference["losses"])
    assert_weights_identical(run_dir, reference)


@pytest.mark.serial  # ranks are compared with each other: no other test may load the machine
def test_a_straggler_with_action_exclude_is_left_out_for_the_spare_and_the_run_ends_bit_identical(
        reference, module_env, module_jobs, three_nodes, tmp_path):
    env = {**module_env, **three_nodes.environ()}
    name = job_name("sp", "slow-exclude")
    released = tmp_path / "released"  # the ranks held at step 3 until rank 1 is slowed: it cannot end first
    job, run_dir = submit(env, name, "resources.spare_nodes=1", "health.stragglers.action=exclude",
                          "health.stragglers.window=3", "health.stragglers.min_interval_s=0.5", pace_s=None,
                          holds=(held_at(3, until=released),))
    module_jobs.append(job)
    wait_held(run_dir, 3)
    records, problems = read_task_records(run_dir, job, 0)
    assert not problems and [(t.rank, t.node) for t in records] == [(0, "n1"), (1, "n2")], records
    # slowed hard before it goes on: the unpaced run must not end before a window of slow intervals is
    # scored (fresh-clone R30, and CI of 01036fa: it completed first when slowed only once it ran)
    with DutyCycle(next(t.pid for t in records if t.rank == 1), stopped_s=0.08, running_s=0.02):
        released.touch()
        waiting.until(lambda: [e for e in ends(run_dir) if e["attempt"] == 1], progress=run_progress(run_dir, job),
                      what=f"{name}: attempt 1 ended", explain=lambda: str(ledger(run_dir)))
    finish(job, run_dir)

    end = ends(run_dir)[0]
    assert (end["reason"], end["restart"], end["left_out"]) == ("straggler", "in_place", ["n2"]), end
    assert end["detail"].startswith("rank 1 (n2)") and "n2 left out, a spare takes its place" in end["detail"], end
    slow = [e for e in ledger(run_dir) if e.get("event") == "straggler"]
    assert [(e["state"], e["rank"], e["node"]) for e in slow][:1] == [("start", 1, "n2")], slow
    second = starts(run_dir)[1]
    assert (second["nodes"], second["job_id"], second["start_step"]) == (["n1", "n3"], job, end["end_step"]), second
    assert slurm.restart_count(job) == 0
    assert ends(run_dir)[-1]["reason"] == "completed"
    assert_losses_match(run_dir, reference["losses"])
    assert_weights_identical(run_dir, reference)
