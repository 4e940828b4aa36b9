"""Spare nodes (resources.spare_nodes): the policy's table of which nodes a restart in place leaves
out, the batch script that asks SLURM for the spares and runs the ranks beside them, the task's
step-relative view of its nodes, the spec's errors, and what status says. The cluster test:
tests/integration/test_spare_nodes_on_cluster.py."""

from __future__ import annotations

import io
import json
import subprocess

import pytest
import waiting

from launcher.cli import main
from launcher.context import Context
from launcher.monitor.status_cache import compact_ledger
from launcher.monitor.status_rows import spares_of
from lmcore.job.plan import PreemptionPlan
from lmcore.job.spec import PreemptionSpec
from lmcore.run.rundir import AttemptStart
from lmtrain.distributed.task_env import read_env
from lmtrain.preemption.policy import EndFacts, decide

POLICY = PreemptionPlan.of(PreemptionSpec(signal="USR2", warning_seconds=120, max_requeues=5, max_crash_retries=3))
CRASH = "RuntimeError: Connection closed by peer"


def _facts(**kw) -> EndFacts:
    base = dict(end_step=40, start_step=20, max_steps=100, checkpoint_step=40, stopped=False, crashed=True,
                error=CRASH, launcher="slurm", job_id="12", slurm_state="RUNNING", job_nodes=2,
                spare_nodes=1, allocation_nodes=["n1", "n2", "n3"])
    return EndFacts(**{**base, **kw})


@pytest.mark.parametrize("kw, action, leave_out, words", [
    # a crash that points at no node: in place on the same nodes
    ({}, "restart", [], "restarted in place (the same job and nodes, no queue wait)"),
    # SLURM set n2 DOWN (it left the allocation): the spare takes its place, no spare left then
    ({"nodes_down": ["n2"], "allocation_nodes": ["n1", "n3"]}, "restart", ["n2"],
     "node n2 DOWN: n2 left out, a spare takes its place (0 spare(s) left); restarted in place (the same job"),
    # still listed in the allocation at the moment rank 0 asks: left out all the same
    ({"nodes_down": ["n2"]}, "restart", ["n2"], "n2 left out"),
    # the rank that died first died on n2 twice: n2 is left out while it still runs
    ({"first_death_node": "n2", "previous_first_death_node": "n2"}, "restart", ["n2"],
     "died on n2 in the attempt before too: n2 left out, a spare takes its place (0 spare(s) left)"),
    # a later crash keeps the nodes left out before
    ({"left_out": ["n2"], "allocation_nodes": ["n1", "n3"]}, "restart", ["n2"], "(the same job and nodes"),
    # the spare is used up: the next failed node sends the job back to the queue
    ({"nodes_down": ["n3"], "left_out": ["n2"], "allocation_nodes": ["n1", "n3"]}, "requeue", [],
     "not restarted in place: node n3 DOWN: no spare left (the job holds 1 usable node(s) n1 for ranks on 2"),
    # no spares at all: as before spares, a suspect node means a requeue
    ({"spare_nodes": 0, "first_death_node": "n2", "previous_first_death_node": "n2"}, "requeue", [],
     "the node is suspect, and the job has no spare (resources.spare_nodes)"),
    # SLURM did not answer: nothing to place the ranks by
    ({"nodes_down": ["n2"], "allocation_nodes": None}, "requeue", [], "SLURM did not say which nodes"),
    # too little time left beats a spare
    ({"nodes_down": ["n2"], "seconds_left": 100.0}, "requeue", [], "100 s left in the allocation"),
])
def test_which_nodes_a_restart_in_place_leaves_out(kw, action, leave_out, words):
    d = decide(_facts(**kw), POLICY)
    assert (d.action, d.leave_out) == (action, leave_out), d
    assert words in d.detail, d.detail
    if kw.get("nodes_down"):
        assert d.reason == "node_failure"


def test_a_straggler_stop_restarts_in_place_without_the_slow_node():
    """health.stragglers.action exclude: rank 0 stopped the attempt at a step boundary for n2."""
    why = "rank 1 (n2) 1.8x the median compute; n2 left out for a spare (health.stragglers.action exclude)"
    d = decide(_facts(stopped=True, crashed=False, error=None, requested_reason="straggler", requested_detail=why,
                      slow_node="n2"), POLICY)
    assert (d.reason, d.action, d.leave_out, d.exit_code) == ("straggler", "restart", ["n2"], 0), d
    assert d.detail.startswith(why) and "n2 slow (health.stragglers): n2 left out, a spare takes its place" in d.detail


def test_a_node_failure_without_spares_is_left_to_slurm_and_the_requeue():
    """Without spare nodes SLURM requeues a job whose node failed (no --no-kill): not in place."""
    d = decide(_facts(spare_nodes=0, nodes_down=["n2"], slurm_state="PENDING", slurm_restarts=1), POLICY)
    assert (d.reason, d.action, d.requeued) == ("node_failure", None, True), d
    assert "in place" not in d.detail


def _dry_run(repo, runs_root, *overrides: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["submit", str(repo / "jobs" / "tiny-cpu.yaml"), "resources.nodes=2", *overrides, "--dry-run",
                 "--json"], Context(stdout=out, stderr=err, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)}))
    return code, out.getvalue(), err.getvalue()


def test_the_script_asks_for_the_spares_and_runs_the_ranks_beside_them(repo, runs_root, tmp_path):
    # one node and its spare: the dry run asks the local cluster (2 nodes) whether it holds them, as submit does
    code, out, err = _dry_run(repo, runs_root, "resources.nodes=1", "resources.spare_nodes=1")
    assert code == 0, err
    doc = json.loads(out)
    script = doc["script"]
    assert "#SBATCH --nodes=2" in script and "#SBATCH --no-kill" in script
    srun = next(x for x in script.splitlines() if x.startswith("srun "))
    assert "--nodes=1 --ntasks=1 --no-kill ${lmlaunch_overlap:+--overlap} ${lmlaunch_exclude:+--exclude=$lmlaunch_exclude} " \
        in srun
    assert doc["plan"]["topology"]["nodes"] == 1 and doc["plan"]["slurm"]["spare_nodes"] == 1
    assert any("resources.spare_nodes(1): SLURM allocates 2 nodes" in n for n in doc["plan"]["notes"])
    # the loop: rank 0's request names the nodes to leave out; the next srun leaves them out
    run_dir, calls = tmp_path / "run", tmp_path / "calls"
    run_dir.mkdir()
    keepers = tmp_path / "keepers"
    fake = "\n".join([
        'scontrol() { echo "   PreemptTime=None"; }',
        'squeue() { printf "batch\\nextern\\npython\\n"; }  # the ranks\' step runs: the keeper may start',
        'srun() { case "$*" in *lmtrain.task.keeper*) echo "$*" >> ' + str(keepers) + "; return 0;; esac",
        '  echo "$*" >> ' + str(calls) + "; n=$(wc -l < " + str(calls) + ")",
        '  if [ "$n" -eq 1 ]; then printf "77\\nn2\\n" > "$LMLAUNCH_RUN_DIR/RESTART_IN_PLACE"; return 1; fi',
        "  return 0; }",
    ])
    body = "\n".join(x for x in script[script.index("# setup"):].splitlines()
                     if not x.startswith("export LMLAUNCH_RUN_DIR="))
    # wait: the keeper's srun runs in the background
    proc = subprocess.run(["bash", "-c", fake + "\n" + body + "\nwait"], capture_output=True, text=True, timeout=waiting.HANG_S,
                          env={"SLURM_JOB_ID": "77", "LMLAUNCH_RUN_DIR": str(run_dir), "PATH": "/usr/bin:/bin",
                               "SLURMD_NODENAME": "n1"})
    assert proc.returncode == 0, proc.stderr
    first, second = calls.read_text().splitlines()
    # the restart also overlaps the step before (a dead node's step stays RUNNING in the controller)
    assert "--exclude" not in first and "--overlap" not in first
    assert "--nodes=1 --ntasks=1 --no-kill --overlap --exclude=n2 " in second
    assert "restarting the ranks in place (1; srun exited 1; not on n2)" in proc.stderr
    # the job's keeper (lmtrain.task.keeper): started again at each turn it is not running (this fake's
    # ends at once), never on the batch script's node nor on one the ranks left out
    kept = keepers.read_text().splitlines()
    assert len(kept) == 2 and all(k.startswith("--overlap --job-name=lmlaunch-keeper --nodes=1 --ntasks=1 ") for k in kept), kept
    assert "--exclude=n1 " in kept[0] and "--exclude=n1,n2 " in kept[1], kept
    assert f"-m lmtrain.task.keeper {run_dir} " in kept[0] and kept[0].endswith("/77_keeper.log"), kept


def test_the_dry_run_refuses_spares_the_partition_cannot_hold_as_submit_does(repo, runs_root):
    code, out, err = _dry_run(repo, runs_root, "resources.spare_nodes=1")  # 2 + 1 on the local cluster's 2 nodes
    assert code == 4 and "partition 'low' holds 2" in err and json.loads(out)["ok"] is False, err


def test_without_spares_the_script_is_as_before(repo, runs_root):
    code, out, err = _dry_run(repo, runs_root)
    script = json.loads(out)["script"]
    srun = next(x for x in script.splitlines() if x.startswith("srun "))
    assert code == 0 and "#SBATCH --no-kill" not in script and "#SBATCH --nodes=2" in script, err
    assert "--no-kill" not in srun and "--exclude" not in srun and "--nodes=" not in srun
    assert "lmtrain.task.keeper" not in script  # SLURM requeues a job without --no-kill whose batch node fails


@pytest.mark.parametrize("overrides, words", [
    (["resources.spare_nodes=-1"], "resources.spare_nodes"),
    (["resources.spare_nodes=1", "preemption.restart_in_place=false"],
     "resources.spare_nodes(1) needs preemption.restart_in_place: true"),
    (["resources.spare_nodes=4095"], "resources.nodes(2) + resources.spare_nodes(4095) = 4097 nodes"),
    (["health.stragglers.action=exclude"], "health.stragglers.action: exclude needs resources.spare_nodes >= 1"),
    (["health.stragglers.action=drop"], "health.stragglers.action"),
])
def test_bad_spare_nodes_are_refused_naming_the_key(repo, runs_root, overrides, words):
    code, out, err = _dry_run(repo, runs_root, *overrides)
    assert code == 4 and words in err and json.loads(out)["ok"] is False, (code, err)  # --json: the error as JSON too


def test_a_task_sees_its_steps_nodes_not_the_allocations():
    """In a job with spares SLURM_NODEID counts within the step; the job's list also keeps a node
    that left the allocation (seen on SLURM 22.05: SLURM_JOB_NODELIST n[1-3] after n2 failed)."""
    env = read_env({"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
                    "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NODELIST": "n[1-3]",
                    "SLURM_STEP_NODELIST": "n[1,3]", "SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_NUM_NODES": "2"})
    assert env.nodes == ("n1", "n3") and env.num_nodes == 2 and env.node_name == "n3"


def test_status_says_which_spares_are_idle_and_the_cache_keeps_them():
    start = AttemptStart(attempt=2, job_id="9", restart_count=0, time=1.0, start_step=10, nodes=["n1", "n3"],
                         world_size=2, spares=[]).to_json()
    end = {"event": "end", "attempt": 1, "job_id": "9", "reason": "node_failure", "requeued": True,
           "restart": "in_place", "left_out": ["n2"], "end_step": 13}
    ledger = compact_ledger([end, start])
    assert spares_of(ledger) == [] and ledger[0]["left_out"] == ["n2"]
    plain = AttemptStart(attempt=1, job_id="9", restart_count=0, time=1.0, start_step=0, nodes=["n1"], world_size=1)
    assert "spares" not in plain.to_json() and spares_of([plain.to_json()]) is None
    # the exporter: one gauge per run with spares, none without
    from launcher.serve.exporter import ledger_values

    with_spare = [{**start, "spares": ["n3"]}]
    assert ledger_values(with_spare, submitted={}, running=True, now=2.0)["spares"] == 1.0
    assert ledger_values([plain.to_json()], submitted={}, running=True, now=2.0)["spares"] is None


def test_the_straggler_watch_hands_a_new_slow_rank_to_the_exclusion(tmp_path):
    """The watch calls on_slow once when a rank becomes slow (the controller then stops to leave its
    node out), not again while it stays slow."""
    import numpy as np

    from lmtrain.health.straggler_watch import StragglerWatch
    from lmtrain.health.stragglers import StragglerPolicy

    class Ledger:
        def write(self, note):
            pass

    seen = []
    watch = StragglerWatch([tmp_path / "a", tmp_path / "b"], StragglerPolicy(threshold=1.5, window=1), attempt=1,
                           ledger=Ledger(), on_slow=lambda fields, text: seen.append((fields["rank"], text)))
    rows = iter([np.array([[1.0, 3.0]]), np.array([[1.0, 3.0], [1.0, 3.0]])])
    watch.table.read = lambda: None
    watch.table.table = lambda: next(rows)
    watch.table.nodes = {0: "n1", 1: "n2"}
    watch.look()
    watch.look()
    assert [rank for rank, _ in seen] == [1] and "rank 1 (n2)" in seen[0][1], seen


BLOCKS_OF_2 = {"n1": "b1", "n2": "b1", "n3": "b2", "n4": "b2"}
BLOCKS_OF_3 = {"n1": "b1", "n2": "b1", "n3": "b1", "n4": "b2", "n5": "b2", "n6": "b2"}


@pytest.mark.parametrize("kw, hold_back, words", [
    # a pipeline over 2 nodes in b1 loses n2; b1 has no whole pipeline left: the ranks move to b2
    # (SLURM's own pick, n1 + n3, would straddle the blocks)
    ({"attempt_nodes": ["n1", "n2"], "node_groups": BLOCKS_OF_2, "unit_nodes": 2, "nodes_down": ["n2"],
      "allocation_nodes": ["n1", "n3", "n4"], "spare_nodes": 2}, ["n1"], "a spare takes its place (n3 of b2, n4 of b2)"),
    # whole replicas per node (unit 1): the spare of the failed node's block first, though a lower one is free
    ({"attempt_nodes": ["n1", "n2", "n4", "n5"], "node_groups": BLOCKS_OF_3, "unit_nodes": 1, "nodes_down": ["n4"],
      "allocation_nodes": ["n1", "n2", "n3", "n5", "n6"], "job_nodes": 4, "spare_nodes": 2}, ["n3"],
     "(n6 of the same b2)"),
    # pipelines of 2 on blocks of 3: n4 fails; n5 + n6 keep a whole pipeline in b2, n3 stays idle
    ({"attempt_nodes": ["n1", "n2", "n4", "n5"], "node_groups": BLOCKS_OF_3, "unit_nodes": 2, "nodes_down": ["n4"],
      "allocation_nodes": ["n1", "n2", "n3", "n5", "n6"], "job_nodes": 4, "spare_nodes": 2}, ["n3"], "(n6 of the same b2)"),
    # no block holds a whole pipeline any more: said, and the ranks run across
    ({"attempt_nodes": ["n1", "n2", "n3", "n4"], "node_groups": {**BLOCKS_OF_2, "n5": "b3"}, "unit_nodes": 2,
      "nodes_down": ["n2"], "allocation_nodes": ["n1", "n3", "n4", "n5"], "job_nodes": 4, "spare_nodes": 1}, [],
     "no switch or block holds the whole of n1+n3, n4+n5 any more"),
])
def test_a_restart_in_place_takes_spares_by_switch_or_block(kw, hold_back, words):
    d = decide(_facts(**kw), POLICY)
    assert d.action == "restart", d
    assert d.hold_back == hold_back and d.leave_out == sorted(kw["nodes_down"]), d
    assert words in d.detail, d.detail


def test_a_restart_with_no_suspect_keeps_the_spares_held_back_before_idle():
    # the ranks moved to n3, n4 at the last restart (n1 held back, n2 left out); a plain crash now:
    # n1 stays held back, or srun's first usable nodes (n1, n3) would straddle s1 and s2
    d = decide(_facts(attempt_nodes=["n3", "n4"], node_groups=BLOCKS_OF_2, unit_nodes=2, left_out=["n2"],
                      allocation_nodes=["n1", "n3", "n4"], spare_nodes=2), POLICY)
    assert (d.action, d.leave_out, d.hold_back) == ("restart", ["n2"], ["n1"]), d


def test_a_node_of_no_group_holds_no_whole_pipeline():
    from lmtrain.preemption.spares import choose_nodes

    # the profile knows s1 only (n3, n4 joined after `profile init`): never a pipeline moved onto them as if whole
    assert choose_nodes(["n1", "n3", "n4"], 2, ["n1", "n2"], {"n1": "s1", "n2": "s1"}, 2, ["n2"]) == ["n1", "n3"]


def test_without_a_topology_the_spares_are_slurms_choice():
    d = decide(_facts(nodes_down=["n1"], allocation_nodes=["n2", "n3"], attempt_nodes=["n1", "n2"]), POLICY)
    assert (d.action, d.leave_out, d.hold_back) == ("restart", ["n1"], []), d
