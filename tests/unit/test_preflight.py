"""Preflight in every attempt (lmtrain.health.preflight): every node checks its interfaces, the
checkpoint directory and the data before the ranks meet; all ranks agree on the verdicts; a
failed node ends the attempt as ``preflight_failed`` (lmtrain.preemption.policy: requeued off the failing
nodes where the partition has others, else stopped with what to fix)."""

from __future__ import annotations

import io
import json

from lmcore.job.plan import PreemptionPlan
from lmcore.job.spec import PreemptionSpec
from lmcore.run.rundir import LedgerAttempt as AttemptRow
from lmtrain.preemption.policy import EndFacts, decide

POLICY = PreemptionPlan.of(PreemptionSpec(max_requeues=5))


def _facts(**kw) -> EndFacts:
    base = dict(end_step=0, start_step=0, max_steps=100, checkpoint_step=None, stopped=False, crashed=True,
                launcher="slurm", job_id="12", slurm_state="RUNNING", job_nodes=1,
                preflight={"n2": ["GLOO_SOCKET_IFNAME=eth9: no such interface eth9 (the node has eth0, lo)"]})
    return EndFacts(**{**base, **kw})


def test_a_node_that_failed_gets_one_more_attempt_off_it_where_slurm_allows():
    d = decide(_facts(bad_nodes=["n2"], partition_nodes=["n1", "n2"], slurm_state="REQUEUED"), POLICY)
    assert (d.reason, d.requeued, d.action, d.exclude) == ("preflight_failed", True, None, ["n2"])
    assert d.detail.startswith("preflight failed on n2: GLOO_SOCKET_IFNAME=eth9: no such interface eth9")
    assert "n2 kept out of the requeued job (ExcNodeList=n2); requeued once" in d.detail
    # the job requeues itself: it is not pending while rank 0 lives, so SLURM cannot exclude the node
    d = decide(_facts(bad_nodes=["n2"], partition_nodes=["n1", "n2"]), POLICY)
    assert (d.requeued, d.action, d.exclude) == (True, "requeue", [])
    assert "n2 not excluded: SLURM changes ExcNodeList only while a job is pending" in d.detail
    # a second failure of the same job stops it
    earlier = AttemptRow(attempt=1, job_id="12", start_step=0, end_step=0, reason="preflight_failed", requeued=True)
    d = decide(_facts(bad_nodes=["n2"], partition_nodes=["n1", "n2"], history=[earlier]), POLICY)
    assert not d.requeued and "it failed in the attempt before too: fix it, then resume; not requeued" in d.detail


def test_every_node_failing_or_no_other_node_stops_the_job_with_what_to_fix():
    d = decide(_facts(bad_nodes=[], partition_nodes=["n1", "n2"]), POLICY)  # every node failed: the setup
    assert (d.reason, d.requeued, d.exclude) == ("preflight_failed", False, [])
    assert "every node failed: the setup, not a node: fix it, then resume; not requeued" in d.detail
    d = decide(_facts(bad_nodes=["n2"], partition_nodes=["n1", "n2"], restart_count=5), POLICY)
    assert not d.requeued and "max_requeues(5) reached" in d.detail


def _run(repo, runs_root, name: str, *overrides: str) -> tuple[int, str, list[dict]]:
    from launcher.cli import main
    from launcher.context import Context

    out = io.StringIO()
    code = main(["run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", "--devices", "2", "--name", name,
                 "--max-steps", "2", "model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2",
                 "model.config.n_positions=32", "data.seq_len=32", "trainer.val_check_interval=null", *overrides],
                Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)}))
    ledger = [json.loads(x) for x in (runs_root / name / "attempts.jsonl").read_text().splitlines()]
    return code, out.getvalue(), ledger


def test_a_missing_interface_ends_the_attempt_before_the_ranks_meet(repo, runs_root):
    code, text, ledger = _run(repo, runs_root, "pf-ifname", "env.vars.GLOO_SOCKET_IFNAME=nosuch0")
    assert code != 0
    checks = [e for e in ledger if e["event"] == "preflight"]
    assert len(checks) == 1 and checks[0]["ok"] is False, ledger
    (node, failed), = checks[0]["nodes"].items()
    assert failed == [f"GLOO_SOCKET_IFNAME=nosuch0: no such interface nosuch0 (the node has {', '.join(sorted(__import__('os').listdir('/sys/class/net')))})"]
    end = [e for e in ledger if e["event"] == "end"][-1]
    assert (end["reason"], end["end_step"], end["requeued"]) == ("preflight_failed", 0, False), end
    assert end["detail"].startswith(f"preflight failed on {node}: GLOO_SOCKET_IFNAME=nosuch0: no such interface")
    assert end["detail"].endswith("a local run: fix it, then resume; not requeued")
    assert "Traceback" not in text


def test_a_clean_attempt_records_its_preflight(repo, runs_root):
    code, text, ledger = _run(repo, runs_root, "pf-clean")
    assert code == 0, text[-3000:]
    checks = [e for e in ledger if e["event"] == "preflight"]
    assert len(checks) == 1 and checks[0]["ok"] is True and list(checks[0]["nodes"].values()) == ["ok"], checks
