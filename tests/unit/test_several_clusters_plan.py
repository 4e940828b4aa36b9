"""A run over several clusters, the parts that need no cluster: which one it goes to (a table),
what is refused before anything is asked or submitted (the spec, the profiles, the commands that
plan one cluster), a profile's own way to its cluster (SLURM_CONF and commands, as `profile init`
reads it), and the registry's record of each job's cluster (status asks each cluster about its
own jobs). On the real clusters: tests/integration/test_several_clusters.py."""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context
from launcher.planning import transport
from launcher.planning.clusters import TIE_S, Answer, Queued, choose, move_due, move_target
from launcher.runs import registry
from launcher.spec.profile_draft import ClusterFacts, draft
from launcher.spec.profiles import load_profile_file
from launcher.submit.start_estimates import describe
from lmcore.slurm import client as slurm
from lmcore.slurm.batch_job import BatchJob
from lmcore.slurm.commands_target import CommandsTarget
from lmcore.slurm.rest import RestTarget

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "jobs" / "tiny-cpu.yaml"
LOCAL = (REPO / "cluster_profiles" / "local.yaml").read_text()
T0 = 1_800_000_000.0


def A(cluster: str, start: float | None = T0, *, accepted: bool = True, pending: int | None = 0,
      answered: bool = True) -> Answer:
    return Answer(cluster, accepted, start, "m", pending, answered)


@pytest.mark.parametrize("answers, chosen, why", [
    ([A("a", T0 + 1800), A("b", T0)], "b", "it starts soonest"),
    ([A("a", T0 + 30), A("b", T0)], "a", "it starts as soon as b and is named first"),  # within TIE_S
    ([A("a", T0 + 30, pending=3), A("b", T0, pending=1)], "b", "it starts as soon as a, with fewer of your jobs pending"),
    ([A("a", None), A("b", T0 + 86400)], "b", "it starts soonest"),  # an estimate beats none
    ([A("a", None), A("b", None)], "a", "it starts as soon as b and is named first"),
    ([A("a", accepted=False), A("b", T0 + 600)], "b", "the only cluster that would take it"),
    ([A("a", answered=False, accepted=False), A("b", T0 + 600)], "b", "the only cluster that would take it"),
    ([A("a", accepted=False), A("b", answered=False, accepted=False)], None, "no cluster would take the job"),
])
def test_the_run_goes_where_it_starts_soonest(answers, chosen, why):
    got, reason = choose(answers)
    assert (got.cluster if got else None, reason) == (chosen, why)
    assert TIE_S == 60.0


def test_the_answers_are_said_one_line_per_cluster():
    answers = [A("uni", T0 + 1800, pending=2), Answer("centre", True, T0, "x", 0),
               Answer("own", False, None, "skipped: `sbatch` did not answer within 10 s", answered=False),
               Answer("old", False, None, "Requested node configuration is not available")]
    lines = describe(answers, answers[1], "it starts soonest", now=T0)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + 1800))
    assert lines == [
        "clusters asked when the run would start (sbatch --test-only):",
        f"  uni: starts {stamp} (30 min from now); 2 of your jobs pending there",
        f"  centre: starts {time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(T0))} (now); 0 of your jobs pending there",
        "  own: skipped: `sbatch` did not answer within 10 s",
        "  old: would not take the job: Requested node configuration is not available",
        "chosen: centre (it starts soonest)",
    ]


# --------------------------------------------------------------------------- refused before anything is asked

def _profiles(tmp_path: Path, **extra: str) -> Path:
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    for name, tail in {"here": "", "there": "", **extra}.items():
        if not (d / f"{name}.yaml").exists():
            (d / f"{name}.yaml").write_text(LOCAL + tail)
    return d


def _lm(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    environ = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LMLAUNCH_HOME": str(tmp_path / "home"),
               "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_PROFILES_DIR": str(_profiles(tmp_path)),
               **(env or {})}
    code = main([str(a) for a in args], Context(stdout=out, stderr=err, environ=environ))
    return code, out.getvalue(), err.getvalue()


def test_validate_plans_the_run_on_each_cluster(tmp_path):
    code, out, err = _lm(tmp_path, "validate", SPEC, "clusters=[here, there]")
    assert code == 0, err
    assert out.startswith(f"ok: {SPEC} is valid for each of its clusters (here, there); submit places it where it "
                          "starts soonest\n  here: nodes(2)"), out
    code, out, err = _lm(tmp_path, "validate", SPEC, "--cluster", "there,here")
    assert code == 0 and "(there, here)" in out, err


@pytest.mark.parametrize("overrides, extra, expected", [
    (["clusters=[here, nowhere]"], {}, "clusters: nowhere: unknown profile 'nowhere' (did you mean 'here'?); available: "),
    (["clusters=[here, here]"], {}, "clusters: here named twice; each cluster once"),
    (["clusters=[here]"], {}, "clusters (override 'clusters=[here]'): List should have at least 2 items"),
    # one cluster cannot run it: its profile lacks the partition the spec asks for
    (["clusters=[here, small]", "resources.partition=high"], {"small": "\n"},
     "clusters: small: override 'resources.partition=high': resources.partition 'high' is not a partition of "
     "profile 'small'; allowed: low"),
    # a cluster over SSH gets a copy of the run directory, with its newest checkpoint: the checkpoints go with it
    (["clusters=[here, ssh]", "checkpoint.dir=/scratch/ck"], {"ssh": "\nlogin: {ssh: user@login.example.org}\n"},
     "clusters: ssh is reached over SSH: the run directory is copied there with its newest checkpoint, and "
     "checkpoint.dir (/scratch/ck) names a path of this machine"),
    (["clusters=[ssh, ssh2]"], {"ssh": "\nlogin: {ssh: user@login.example.org}\n",
                                "ssh2": "\nlogin: {ssh: user@login2.example.org}\n"},
     "clusters: every cluster named (ssh, ssh2) is reached over SSH (its profile's login section); a run over several "
     "clusters keeps its run directory on this machine"),
])
def test_what_a_run_over_several_clusters_cannot_be_is_refused_naming_the_cluster(tmp_path, overrides, extra, expected):
    d = _profiles(tmp_path, **extra)
    if "small" in extra:
        text = LOCAL.replace("  high: {max_time: \"2:00:00\"}\n", "").replace("high_priority_partition: high\n", "")
        (d / "small.yaml").write_text(text)
    code, out, err = _lm(tmp_path, "submit", SPEC, *overrides, "--dry-run")
    assert code == 4 and out == "", (out, err)
    assert expected in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home" / "registry").exists()  # nothing half-done


def test_clusters_without_one_runs_root_are_refused(tmp_path):
    d = _profiles(tmp_path)
    (d / "there.yaml").write_text(LOCAL.replace("runs_root: ~/.lmlaunch/runs", "runs_root: ~/elsewhere"))
    code, out, err = _lm(tmp_path, "validate", SPEC, "clusters=[here, there]", env={"LMLAUNCH_RUNS_ROOT": ""})
    assert code == 4, (out, err)
    assert f"the run's directory differs between them (here: {tmp_path}/.lmlaunch/runs/tiny-cpu, there: " \
           f"{tmp_path}/elsewhere/tiny-cpu)" in err, err
    assert "give their profiles the same runs_root" in err


@pytest.mark.parametrize("command", [["doctor"], ["notify-test"]])
def test_commands_that_plan_one_cluster_say_how_to_choose_one(tmp_path, command):
    code, out, err = _lm(tmp_path, *command, SPEC, "clusters=[here, there]")
    assert code == 4, (out, err)
    assert "override 'clusters=[here, there]': this command plans a run on one cluster, and the spec names 2 " \
           "(here, there): choose one with --cluster NAME (submit and validate take several)" in err, err


def test_a_search_over_several_clusters_places_each_trial_and_keeps_one_study(tmp_path):
    """Each trial goes where it starts soonest when it is submitted (its corners planned on every
    cluster first); the trials report to one study, the first cluster's sweep_storage
    (tests/integration/test_several_clusters.py runs one)."""
    search = tmp_path / "s.yaml"
    search.write_text('{"name": "s", "search": "optuna", "trials": 2, "params": {"optim.lr": {"float": [1e-3, 1e-2]}}}')
    code, out, err = _lm(tmp_path, "sweep", SPEC, search, "clusters=[here, there]", "--dry-run")
    assert code == 0, (out, err)
    assert "clusters:  here, there: each trial goes where it starts soonest when it is submitted" in out, out
    code, out, err = _lm(tmp_path, "sweep", SPEC, search, "clusters=[here, there]", "--cluster", "there", "--dry-run")
    assert code == 0 and "clusters:" not in out, (out, err)  # one named: every trial there
    d = _profiles(tmp_path)
    (d / "there.yaml").write_text(LOCAL.replace("sweep_storage: {local_cluster: true}", "sweep_storage: {journal: /x/j}"))
    code, out, err = _lm(tmp_path, "sweep", SPEC, search, "clusters=[here, there]", "--dry-run")
    assert code == 4 and "clusters: there's profile keeps its searches elsewhere ({'journal': '/x/j'}) than here's: " \
        "the trials of one search report to one study" in err, (out, err)
    _profiles(tmp_path, far="\nlogin: {ssh: user@login.example.org}\n")
    code, out, err = _lm(tmp_path, "sweep", SPEC, search, "clusters=[here, far]", "--dry-run")
    assert code == 4 and "clusters: far is reached over SSH: the lmlaunch there plans a trial's run again" in err, err


# --------------------------------------------------------------------------- a profile's own way to its cluster

def test_a_profile_names_its_clusters_slurm_conf_and_commands(tmp_path):
    d = _profiles(tmp_path, own="\nsubmit: {slurm_conf: /etc/other/slurm.conf, slurm_bin: ~/slurm-24/bin}\n",
                  bad="\nsubmit: {via: rest, url: 'http://h:6820', slurm_conf: /x}\n")
    p = load_profile_file(d / "own.yaml")
    target = transport.profile_target(p)
    assert target == CommandsTarget("/etc/other/slurm.conf", os.path.expanduser("~/slurm-24/bin"), "own")
    env = target.environ({"PATH": "/usr/bin:/bin", "SLURM_CONF": "/etc/slurm/slurm.conf"})
    assert env == {"PATH": f"{os.path.expanduser('~/slurm-24/bin')}:/usr/bin:/bin", "SLURM_CONF": "/etc/other/slurm.conf"}
    assert transport.profile_target(load_profile_file(d / "here.yaml")) is None
    with pytest.raises(Exception, match="slurm_conf and slurm_bin say how SLURM's commands reach this cluster"):
        load_profile_file(d / "bad.yaml")


def test_the_commands_and_the_jobs_they_submit_talk_to_the_profiles_cluster(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=other\n")
    (bin_dir / "squeue").write_text("#!/bin/sh\necho \"$SLURM_CONF\"\n")  # a cluster's client, as a site's module puts it
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/mine.conf")
    target = CommandsTarget(str(conf), str(bin_dir), "other")
    with transport.through(target):
        assert slurm.run(["squeue"]).stdout.strip() == str(conf)
        line = slurm.commands().submission_command(BatchJob("", ()), "job.sh", client_timeout_s=30)
        assert line[:3] == ["env", f"SLURM_CONF={conf}", f"PATH={bin_dir}:{os.environ['PATH']}"], line
        assert line[3:] == ["timeout", "--kill-after=5", "30", "sbatch", "job.sh"]
        with transport.through(None, exactly=True):  # this machine's own cluster, inside another's
            assert slurm.slurm_env()["SLURM_CONF"] == "/etc/slurm/mine.conf"
    assert slurm.commands().submission_command(BatchJob("", ()), "job.sh", client_timeout_s=30)[0] == "timeout"
    with pytest.raises(Exception, match=r"profile 'gone': submit.slurm_conf /nonexistent/slurm.conf is not a file"):
        with transport.through(CommandsTarget("/nonexistent/slurm.conf", None, "gone")):
            pass


def test_profile_init_writes_the_way_it_reached_the_cluster(tmp_path):
    facts = ClusterFacts(partitions=[{"PartitionName": "low", "Default": "YES", "MaxTime": "1:00:00", "State": "UP",
                                      "PriorityTier": "1", "PreemptMode": "OFF", "Nodes": "n[1-2]"}],
                         nodes=[], config={"SLURM_VERSION": "24.11.5", "ClusterName": "c"},
                         slurm_conf="/srv/c/slurm.conf", slurm_bin="/srv/c/bin")
    text = draft("c", facts, when="2026-11-29")
    assert 'submit:  # this machine\'s way to this cluster (the shell `profile init` ran in)\n' \
           '  slurm_conf: "/srv/c/slurm.conf"  # $SLURM_CONF\n' in text
    (tmp_path / "c.yaml").write_text(text)
    assert transport.profile_target(load_profile_file(tmp_path / "c.yaml")) == CommandsTarget("/srv/c/slurm.conf", "/srv/c/bin", "c")
    plain = ClusterFacts(partitions=facts.partitions, nodes=[], config=facts.config)
    assert "submit:" not in draft("c", plain, when="2026-11-29")


# --------------------------------------------------------------------------- the registry: each job's cluster

def test_the_registry_keeps_each_jobs_cluster_and_status_groups_by_it(tmp_path):
    env = {"LMLAUNCH_HOME": str(tmp_path)}
    there = transport.target_json(CommandsTarget("/srv/b/slurm.conf", "/srv/b/bin", "b"))
    rest = transport.target_json(RestTarget("http://r:6820", "/t", None, None, "r"))
    assert transport.target_from_json(rest) == RestTarget("http://r:6820", "/t", None, None, "r")
    old = registry.RunRecord(name="old", profile="a", run_dir="/x", spec_path=None, job_ids=["5"], submitted_at=[1.0])
    moved = registry.RunRecord(name="moved", profile="a", run_dir="/y", spec_path=None, job_ids=["35", "231"],
                               submitted_at=[1.0, 2.0], job_profiles=["b", "a"], targets={"b": there})
    away = registry.RunRecord(name="away", profile="b", run_dir="/z", spec_path=None, job_ids=["5"],
                              submitted_at=[1.0], job_profiles=["b"], targets={"b": there})
    assert (moved.profile_of("35"), moved.profile_of("231"), old.profile_of("5")) == ("b", "a", "a")
    assert moved.jobs_by_profile() == {"b": ["35"], "a": ["231"]}
    groups = transport.by_cluster([old, moved, away])
    assert [(t, i) for t, i in groups] == [(None, [0, 1]), (transport.target_from_json(there), [2])]
    for rec in (old, moved, away):
        registry.save_record(rec, env)
    # job 5 ended on this machine's cluster long ago: the run there is skipped unread, the one
    # whose job 5 is another cluster's is read (its own cluster says how it is)
    kept, skipped = registry.recent_or_unfinished({"5"}, now=10 * 86400.0, environ=env)
    assert [r.name for r in kept] == ["away", "moved"] and skipped == 1
    kept, skipped = registry.recent_or_unfinished({"5"}, now=10 * 86400.0, environ=env)  # from the index's heads
    assert [r.name for r in kept] == ["away", "moved"] and skipped == 1


# --------------------------------------------------------------------------- moving a queued run

def Q(state: str = "PENDING", reason: str = "Priority", waited: float = 0.0, preempted: bool = False) -> Queued:
    return Queued("a", "17", state, reason, waited, preempted)


@pytest.mark.parametrize("q, after_s, on_preemption, due", [
    (Q(preempted=True), None, True, "preempted"),
    (Q(preempted=True), None, False, None),
    (Q(waited=1799), 1800.0, True, None),
    (Q(waited=1800), 1800.0, True, "queued 1800 s (move.after 1800 s)"),
    (Q(state="RUNNING", preempted=True, waited=9999), 60.0, True, None),  # a running job is never moved
    (Q(reason="JobHeldUser", waited=9999, preempted=True), 60.0, True, None),  # someone holds it on purpose
    (Q(reason="Dependency", waited=9999), 60.0, True, None),  # it waits for another job, not for nodes
    (Q(reason="BeginTime", preempted=True), None, True, "preempted"),  # the requeue's BeginTime delay
])
def test_a_move_is_due_only_for_a_queued_job_after_a_preemption_or_the_wait_allowed(q, after_s, on_preemption, due):
    assert move_due(q, after_s=after_s, on_preemption=on_preemption) == due


def test_a_queued_run_moves_only_where_it_starts_more_than_a_minute_sooner():
    q = Q(preempted=True)
    here = A("a", T0 + 120)
    dest, why = move_target(q, here, [A("b", T0)])
    assert dest.cluster == "b" and why.startswith("b starts it sooner"), why
    assert move_target(q, here, [A("b", T0 + 90)]) == (None, move_target(q, here, [A("b", T0 + 90)])[1])
    assert "no other cluster starts it sooner" in move_target(q, here, [A("b", T0 + 90)])[1]
    assert move_target(q, here, [A("b", answered=False, accepted=False)])[0] is None
    assert move_target(q, Answer("a", True, None, "none"), [A("b", T0 + 86400)])[0].cluster == "b"  # vs no estimate
    assert move_target(q, here, [A("a", T0)])[0] is None  # never to where it is


@pytest.mark.parametrize("overrides, expected", [
    (["move={after: '30:00'}"], "move: a run moves between the clusters it names; give clusters: [a, b]"),
    (["clusters=[here, there]", "move={after: soon}"], "'soon' is not a SLURM time; use MM:SS, HH:MM:SS or D-HH"),
    (["clusters=[here, there]", "move={poll_s: 0}"], "move.poll_s"),
])
def test_a_move_section_that_cannot_work_is_refused(tmp_path, overrides, expected):
    code, out, err = _lm(tmp_path, "validate", SPEC, *overrides)
    assert code == 4 and expected in err, (out, err)


def test_clusters_whose_plans_split_the_model_differently_are_refused(tmp_path):
    import dataclasses

    from launcher.planning.clusters import shared_run_problems
    from launcher.planning.resolve import resolve
    from lmcore.job.parallelism import Parallelism

    environ = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LMLAUNCH_HOME": str(tmp_path / "home"),
               "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_PROFILES_DIR": str(_profiles(tmp_path))}
    here, there = (resolve(str(SPEC), ["clusters=[here, there]"], name, environ, several=True) for name in ("here", "there"))
    assert shared_run_problems([here, there]) == []
    other = dataclasses.replace(there.plan, topology=dataclasses.replace(
        there.plan.topology, parallelism=Parallelism.of("deepspeed", 2, zero_stage=3)))
    assert shared_run_problems([here, dataclasses.replace(there, plan=other)]) == [
        "clusters: here plans ddp, tensor x pipeline 1x1, there deepspeed ZeRO-3, tensor x pipeline 1x1: a checkpoint "
        "of one could not be resumed on the other (the elastic path bridges world sizes, not strategies or model splits)"]


def test_a_run_is_changed_by_one_lmlaunch_at_a_time(tmp_path):
    """submit, move and cancel hold the run's lock: re-entrant in one process (a move submits), and
    another process waits for it, then is told who holds it."""
    import subprocess
    import sys

    from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

    from launcher.runs.run_lock import run_lock

    env = {"LMLAUNCH_HOME": str(tmp_path)}
    other = [sys.executable, "-c", "import sys; from launcher.runs.run_lock import run_lock\n"
             "try:\n with run_lock('r', {'LMLAUNCH_HOME': sys.argv[1]}, wait_s=0.5): print('got it')\n"
             "except Exception as e: print(e)", str(tmp_path)]
    pythonpath = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with run_lock("r", env), run_lock("r", env):  # re-entered by this process
        said = subprocess.run(other, capture_output=True, text=True, env=pythonpath, timeout=HANG_S).stdout
        assert "run 'r' is being changed by another lmlaunch" in said, said
    assert subprocess.run(other, capture_output=True, text=True, env=pythonpath, timeout=HANG_S).stdout.strip() == "got it"


def test_rest_forced_wins_and_a_jobs_own_cluster_is_asked_exactly(tmp_path):
    """`--rest P` sends every call through P's slurmrestd; otherwise a job asked about `exactly` is
    asked on its own cluster even inside a command about a run submitted through a slurmrestd."""
    rest = RestTarget("http://r:6820", None, None, None, "r")
    (tmp_path / "slurm.conf").write_text("ClusterName=b\n")
    mine = CommandsTarget(str(tmp_path / "slurm.conf"), None, "b")
    with transport.through(rest):
        assert slurm.rest_client() is not None
        with transport.through(None):
            assert slurm.rest_client() is not None  # nothing changes
        with transport.through(None, exactly=True):
            assert slurm.rest_client() is None and slurm.commands_target() == CommandsTarget()
        with transport.through(mine, exactly=True):
            assert slurm.rest_client() is None and slurm.commands_target() == mine
        assert slurm.rest_client().target == rest
    with transport.forced(rest):
        with transport.through(None, exactly=True):
            assert slurm.rest_client().target == rest  # --rest wins
    assert slurm.rest_client() is None


# --------------------------------------------------------------------------- a sweep over several clusters

@pytest.mark.parametrize("n, answers, parallel, expected", [
    (4, [A("a", T0 + 600), A("b", T0)], 2, [("b", [0, 2], 1), ("a", [1, 3], 1)]),  # soonest first
    (4, [A("a", T0), A("b", T0)], 3, [("a", [0, 2], 2), ("b", [1, 3], 1)]),  # the soonest gets the rest of %N
    (5, [A("a", T0), A("b", T0)], 1, [("a", [0, 1, 2, 3, 4], 1)]),  # one at once: one cluster
    (1, [A("a", T0), A("b", T0)], 4, [("a", [0], 1)]),
    (3, [A("a", accepted=False), A("b", T0), A("c", answered=False, accepted=False)], 2, [("b", [0, 1, 2], 2)]),
    (3, [A("a", accepted=False)], 2, []),
])
def test_a_sweeps_points_are_dealt_to_the_clusters_that_take_them_with_one_max_parallel(n, answers, parallel, expected):
    from launcher.search.spread import spread

    got = spread(n, answers, parallel)
    assert [(s.cluster, s.points, s.max_parallel) for s in got] == expected
    assert sum(s.max_parallel for s in got) <= parallel and sorted(i for s in got for i in s.points) == (
        list(range(n)) if expected else [])


def test_a_watcher_whose_run_directory_is_gone_ends(tmp_path, monkeypatch):
    """A run directory removed under its watcher (a test's temporary one, a user's rm -r): the watcher
    ends, rather than asking an unreachable cluster about the run for ever."""
    from types import SimpleNamespace

    from launcher.runs.registry import RunRecord
    from launcher.submit import mover, watcher

    run_dir = tmp_path / "runs" / "gone"
    run_dir.mkdir(parents=True)
    rec = RunRecord(name="gone", profile="here", run_dir=str(run_dir), spec_path=None, job_ids=["7"])
    move = SimpleNamespace(after=None, after_s=None, on_preemption=True, poll_s=0.01)

    def plans_then_removed(r, c, one=False):  # the watcher holds its lock and has read the run's plans: then it goes
        shutil.rmtree(run_dir)
        return [SimpleNamespace(spec=SimpleNamespace(move=move, clusters=["here", "there"]),
                                profile=SimpleNamespace(name="here", login=None),
                                plan=SimpleNamespace(slurm=SimpleNamespace(spare_nodes=0)))]

    monkeypatch.setattr(mover, "plans_of", plans_then_removed)
    out = io.StringIO()
    assert watcher.watch(rec, Context(stdout=out, stderr=out, environ={"LMLAUNCH_HOME": str(tmp_path / "home")})) == 0
    assert f"the run directory {run_dir} is gone: the watcher ends" in out.getvalue(), out.getvalue()
