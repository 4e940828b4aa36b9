"""The first death, not the survivors' symptom (lmtrain.preemption.first_death): the attempt's ledger
``end`` names the rank that died first, its node and how, from its own last words, its
launcher's, srun's task lines or its silence; never the surviving rank's "Connection closed by
peer". Real 2-rank local training (gloo) with a rank SIGKILLed or failing at a step."""

from __future__ import annotations

import io
import json

import pytest

from lmcore.run.rundir import LastWords, is_peer_lost
from lmtrain.preemption.first_death import attribute, parse_srun

# srun's stderr of a 2-node job whose task 1 was SIGKILLed (seen on the local cluster)
SRUN_KILLED = """srun: error: n2: task 1: Killed
srun: error: n1: task 0: Exited with exit code 1
srun: Force Terminated StepId=4.0
"""
GLOO = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:5524. This is typically caused by a remote worker crashing. GLHF!")
NODES = {0: "n1", 1: "n2"}


def _words(rank: int, detail: str, t: float, how: str = "exception", source: str = "rank") -> LastWords:
    return LastWords(rank=rank, node=NODES[rank], pid=100 + rank, time=t, how=how, detail=detail,
                     peer_lost=is_peer_lost(detail), source=source)


def test_srun_lines_are_read_in_order_with_oom_events():
    exits, ooms = parse_srun(SRUN_KILLED + "slurmstepd: error: Detected 1 oom_kill event in StepId=4.0.\n")
    assert [(e.node, e.ranks, e.what) for e in exits] == [("n2", (1,), "Killed"), ("n1", (0,), "Exited with exit code 1")]
    assert ooms == 1
    assert parse_srun("srun: error: gpu7: tasks 4-6,9: Segmentation fault\n")[0][0].ranks == (4, 5, 6, 9)


def test_a_sigkilled_rank_is_named_from_srun_and_an_oom_kill_is_said():
    me = [_words(0, GLOO, 10.0)]
    death = attribute(me, *parse_srun(SRUN_KILLED), world_size=2, me=0, node_of=NODES)
    assert death == {"rank": 1, "node": "n2", "how": "killed by SIGKILL", "source": "srun: task 1: Killed"}
    death = attribute(me, *parse_srun(SRUN_KILLED + "Detected 2 oom_kill events\n"), world_size=2, me=0, node_of=NODES)
    assert "OOM kill event(s) in the step: the OOM killer" in death["how"]


def test_an_exception_beats_the_symptoms_and_the_earliest_cause_wins():
    words = [_words(0, GLOO, 10.5), _words(1, "ValueError: bad batch", 10.2), _words(2 % 2, GLOO, 11.0)]
    assert attribute(words, [], 0, world_size=2, me=0, node_of=NODES) == {
        "rank": 1, "node": "n2", "how": "Python exception: ValueError: bad batch", "source": "its own last words"}


def test_a_silent_rank_is_the_one_that_vanished_and_only_symptoms_name_nobody():
    assert attribute([_words(0, GLOO, 10.0)], [], 0, world_size=2, me=0, node_of=NODES)["how"].startswith(
        "ended without a word")
    assert attribute([], [], 0, world_size=2, me=0, node_of=NODES) is None
    both = [_words(0, GLOO, 10.0), _words(1, GLOO, 10.1)]
    assert attribute(both, [], 0, world_size=2, me=0, node_of=NODES) is None


def _run_local(repo, runs_root, monkeypatch, name: str, fault: dict) -> tuple[int, str, dict]:
    from launcher.cli import main
    from launcher.context import Context

    monkeypatch.setenv("LMLAUNCH_FAULTS", json.dumps([fault]))
    out = io.StringIO()
    code = main(["run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", "--devices", "2", "--name", name,
                 "--max-steps", "12", "model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2",
                 "model.config.n_positions=32", "data.seq_len=32", "trainer.val_check_interval=null"],
                Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)}))
    ledger = [json.loads(x) for x in (runs_root / name / "attempts.jsonl").read_text().splitlines()]
    ends = [e for e in ledger if e["event"] == "end"]
    assert len(ends) == 1, (ledger, out.getvalue()[-3000:])
    return code, out.getvalue(), ends[0]


@pytest.mark.parametrize("fault,how,source", [
    ({"point": "train.batch_end", "rank": 1, "step": 4, "action": "kill"}, "killed by SIGKILL", "the local launcher"),
    ({"point": "train.batch_end", "rank": 1, "step": 4, "action": "raise"},
     "Python exception: RuntimeError: fault injection at train.batch_end", "its own last words"),
], ids=["sigkill", "exception"])
def test_the_ledger_names_the_rank_that_died_first_not_the_survivors_error(repo, runs_root, monkeypatch, fault,
                                                                        how, source):
    code, text, end = _run_local(repo, runs_root, monkeypatch, f"fd-{fault['action']}", fault)
    assert code != 0
    assert end["reason"] == "crashed", end
    death = end["first_death"]
    assert (death["rank"], death["how"], death["source"]) == (1, how, source), end
    assert end["detail"].startswith(f"rank 1 on {death['node']} died first: {how}"), end["detail"]
    assert "rank 0 saw:" in end["detail"]  # the symptom is kept, after the cause


def test_last_words_are_a_line_per_rank_in_their_nodes_file_and_a_run_of_befores_still_read(tmp_path):
    """One file per node (docs/scale.md: at a crash every rank that lost its peer has last words)."""
    from lmcore.run.rundir import RunLayout

    for rank, node, t in ((1, "n1", 3.0), (0, "n1", 2.0), (2, "gpu/7 a", 1.0)):
        LastWords(rank=rank, node=node, pid=10 + rank, time=t, how="exception", detail="boom").write(tmp_path, 2)
    logs = RunLayout.of(tmp_path).attempt_logs(2)
    assert sorted(p.name for p in logs.iterdir()) == ["exit-gpu_7_a.jsonl", "exit-n1.jsonl"]
    (logs / "exit-rank-5.json").write_text(json.dumps({"rank": 5, "node": "n9", "pid": 1, "time": 0.5,
                                                        "how": "signal", "detail": "SIGKILL"}))
    with open(logs / "exit-n1.jsonl", "a") as f:
        f.write('{"rank": 3, "node": "n1", "pi')  # a rank killed in its write
    LastWords.say_for(tmp_path, 2, rank=0, node="n1", pid=10, code=-9, source="agent")  # it has its own
    words = LastWords.read_all(tmp_path, 2)
    assert [(w.rank, w.node) for w in words] == [(5, "n9"), (2, "gpu/7 a"), (0, "n1"), (1, "n1")]
