"""eval.alongside without a cluster: the spec's keys and its refusals, the heterogeneous job's script,
which checkpoint the evaluator scores next and what retention keeps for it, its records (a torn
line, a step written twice), the task-name index, and what status, history and the exporter say.
The evaluator's run on the real cluster: tests/integration/test_eval_alongside_on_cluster.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.monitor import eval_rows
from launcher.planning import eval_tasks
from launcher.planning.planner import make_plan
from launcher.planning.resolve import eval_interpreter
from launcher.spec.jobfile import load_job
from launcher.spec.profiles import load_profile
from launcher.submit.script import render_script
from lmcore.errors import SpecError
from lmcore.job.plan import LaunchPlan
from lmcore.run import eval_alongside as ev

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "jobs" / "tiny-cpu-eval.yaml"


def plan_of(tmp_path: Path, overrides: list[str] | None = None) -> LaunchPlan:
    spec = load_job(JOB, overrides or [])
    return make_plan(spec, load_profile("local"), runs_root=str(tmp_path), python="python3")


def evaluator(**kw) -> ev.EvaluatorPlan:
    return ev.EvaluatorPlan(**{"partition": "low", "nodes": 1, "cpus_per_task": 1, "gpus": 0, "gres": None,
                               "mem": None, "tasks": ("t",), **kw})


# --------------------------------------------------------------------------- the spec and the plan
def test_eval_gives_exactly_one_of_checkpoint_and_alongside(tmp_path):
    with pytest.raises(SpecError, match="exactly one of checkpoint"):
        load_job(JOB, ["eval.checkpoint=/tmp/x"])
    with pytest.raises(SpecError, match="exactly one of checkpoint"):
        load_job(JOB, ["eval.alongside=null"])


@pytest.mark.parametrize("override, said", [
    ("eval.alongside.partition=nope", "eval.alongside.partition 'nope' is not a partition of profile 'local'"),
    ("eval.alongside.gpus_per_node=2", "eval.alongside.gpus_per_node(2) is more than a node of profile 'local' has"),
    ("eval.alongside.every_n_steps=75", "eval.alongside.every_n_steps(75) is not a multiple of "
                                        "checkpoint.every_n_steps(50)"),
])
def test_an_evaluator_that_cannot_run_is_refused_at_planning(tmp_path, override, said):
    with pytest.raises(SpecError) as exc:
        plan_of(tmp_path, [override])
    assert any(said in p for p in exc.value.problems), exc.value.problems


def test_the_run_is_one_heterogeneous_job_and_the_exit_status_stays_the_trainers(tmp_path):
    plan = plan_of(tmp_path)
    script = render_script(plan)
    lines = script.splitlines()
    het = lines.index("#SBATCH hetjob")
    assert all(line.startswith("#SBATCH ") for line in lines[het - 3: het + 5])  # after the trainer's options
    assert lines[het + 1:het + 5] == ["#SBATCH --partition=low", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
                                      "#SBATCH --cpus-per-task=1"]
    assert not [line for line in lines[het + 5:] if line.startswith("#SBATCH")]
    evaluator_srun = next(line for line in lines if "--het-group=1" in line)
    assert "-m lmtrain.evaluator.main " + plan.paths.run_dir in evaluator_srun and evaluator_srun.startswith("( LMLAUNCH_TASK_ROLE=evaluator srun ")
    trainer_srun = next(line for line in lines if line.startswith("srun ") and "lmtrain.task.main" in line)
    assert "--het-group" not in trainer_srun  # a plain srun is the first component's
    assert lines.index(evaluator_srun) < lines.index(trainer_srun)
    tail = lines[lines.index("# teardown"):]
    assert tail[1].startswith("lmlaunch_rc=$?") and tail[-1] == 'exit "$lmlaunch_rc"'
    assert any("eval/training-ended" in line for line in tail) and "lmlaunch_most=300" in tail
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    saved = LaunchPlan.from_dict(json.loads(plan.to_json()))
    assert ev.EvaluatorPlan.from_json(saved.evaluator) == ev.EvaluatorPlan(
        partition="low", nodes=1, cpus_per_task=1, gpus=0, gres=None, mem=None,
        tasks=("lmlaunch_pydoc_choice", "lmlaunch_pydoc_perplexity"), limit=32, finish_wait_s=300,
        log=plan.paths.run_dir + "/logs/evaluator-%j.log", python="python3")


def test_a_run_without_an_evaluator_keeps_its_script(tmp_path):
    plan = plan_of(tmp_path, ["eval=null"])
    assert plan.evaluator is None
    script = render_script(plan)
    assert "hetjob" not in script and "--het-group" not in script and "# teardown" not in script


# --------------------------------------------------------------------------- which checkpoint next, and retention
@pytest.mark.parametrize("kw, complete, scored, ended, expected", [
    ({}, [50, 100, 150], [], False, 50),  # every one, in step order
    ({}, [50, 100, 150], [50, 150], False, 100),  # one skipped earlier (a requeue) is not lost
    ({}, [50, 100], [50, 100], False, None),
    ({"every_n_steps": 100}, [50, 100, 150], [], False, 100),
    ({"every_n_steps": 100}, [50, 100, 150], [100], False, None),
    ({"every_n_steps": 100}, [50, 100, 150], [100], True, 150),  # the run's last, whatever its step
    ({"behind": "newest"}, [50, 100, 150], [], False, 150),
    ({"behind": "newest"}, [50, 100, 150], [150], False, None),  # never back to one it skipped
    ({"behind": "newest"}, [50, 100, 150, 200], [100], False, 200),
])
def test_the_next_checkpoint_to_score(kw, complete, scored, ended, expected):
    assert ev.next_step(complete, scored, evaluator(**kw), ended=ended) == expected


def test_retention_keeps_what_the_evaluator_has_still_to_score(tmp_path):
    assert ev.still_to_score([50, 100, 150], [50], evaluator()) == {100, 150}
    assert ev.still_to_score([50, 100, 150], [], evaluator(every_n_steps=100)) == {100}
    assert ev.still_to_score([50, 100, 150], [], evaluator(behind="newest")) == set()
    ev.append_scores(tmp_path, record(50))
    assert ev.kept_for_evaluator(tmp_path, [50, 100, 150], evaluator()) == {100, 150}
    (tmp_path / ev.EVALUATOR_EXIT).write_text("7 137 1.0 stopped\n")  # a preemption stopped it: scored after the requeue
    assert ev.kept_for_evaluator(tmp_path, [50, 100, 150], evaluator()) == {100, 150}
    (tmp_path / ev.EVALUATOR_EXIT).write_text("7 137 1.0 exited\n")  # killed (the OOM killer): nothing kept for it
    assert ev.kept_for_evaluator(tmp_path, [50, 100, 150], evaluator()) == set()


# --------------------------------------------------------------------------- the records
def record(step: int, value: float = 0.5) -> ev.CheckpointScores:
    return ev.CheckpointScores(step=step, checkpoint=f"/c/step-{step}", time=1.0, job_id="7", lm_eval="0.4.13",
                               seconds=2.0, scores=({"task": "t", "metric": "acc", "value": value, "stderr": 0.1},
                                                    {"task": "p", "metric": "byte_perplexity", "value": 20.0,
                                                     "stderr": None}))


def test_a_torn_last_line_and_a_step_written_twice_count_once(tmp_path):
    ev.append_scores(tmp_path, record(50, 0.25))
    ev.append_scores(tmp_path, record(100, 0.5))
    ev.append_scores(tmp_path, record(50, 0.75))  # never written so by the evaluator: the first one counts
    with open(ev.scores_path(tmp_path), "a") as f:
        f.write('{"step": 150, "checkpoint": "/c/st')  # killed mid-write
    got = ev.read_scores(tmp_path)
    assert [(r.step, r.scores[0]["value"]) for r in got] == [(50, 0.25), (100, 0.5)]
    assert ev.latest_scores(got) == {"step": 100, "scores": {"t/acc": 0.5, "p/byte_perplexity": 20.0}}
    assert ev.flat_scores(got)[0] == {"step": 50, "task": "t", "metric": "acc", "value": 0.25, "stderr": 0.1,
                                      "lm_eval": "0.4.13"}
    # the torn line is left alone; the next line starts anew, and a further line of other tasks
    # (`lmlaunch eval --tasks`) adds them to the step
    more = ev.CheckpointScores(step=100, checkpoint="/c/step-100", time=2.0, job_id="8", lm_eval="0.4.13", seconds=1.0,
                               scores=({"task": "u", "metric": "acc", "value": 0.9, "stderr": None},), tasks=("u",))
    ev.append_scores(tmp_path, more)
    got = ev.read_scores(tmp_path)
    assert [r.step for r in got] == [50, 100] and ev.latest_scores(got)["scores"]["u/acc"] == 0.9
    assert ev.scored_steps(got, ["t"]) == {50, 100} and ev.scored_steps(got, ["t", "u"]) == {100}


def test_status_says_the_newest_scores_and_an_evaluator_killed_mid_checkpoint(tmp_path):
    ev.append_scores(tmp_path, record(50))
    (tmp_path / ev.STATE).write_text(json.dumps({"state": "scoring", "step": 100}))
    (tmp_path / ev.EVALUATOR_EXIT).write_text("7 137 1.0 exited\n")
    e = eval_rows.read_evaluation(tmp_path)
    note = eval_rows.note(e, "r")
    assert note.startswith("eval step 50: t/acc 0.5, p/byte_perplexity 20;")
    assert "evaluator killed (SIGKILL: the OOM killer, or kill -9) while scoring step 100; training goes on" in note
    assert "`lmlaunch logs r --errors`" in note
    s = eval_rows.summary(e)
    assert s is not None and s["scored"] == 1 and s["latest"]["step"] == 50 and s["trouble"]
    assert eval_rows.Evaluation.from_json(e.to_json()).to_json() == e.to_json()  # the status cache's copy
    (tmp_path / ev.STATE).write_text(json.dumps({"state": "done", "step": 50}))
    (tmp_path / ev.EVALUATOR_EXIT).write_text("7 0 1.0 exited\n")
    assert eval_rows.trouble(eval_rows.read_evaluation(tmp_path)) is None
    (tmp_path / ev.STATE).write_text(json.dumps({"state": "scoring", "step": 100}))
    (tmp_path / ev.EVALUATOR_EXIT).write_text("7 137 1.0 stopped\n")  # a cancel or a preemption: not its fault
    assert eval_rows.trouble(eval_rows.read_evaluation(tmp_path)) is None


def test_the_exporter_has_the_newest_scores_by_task_and_metric(tmp_path):
    from launcher.serve.exporter import eval_families

    ev.append_scores(tmp_path, record(100))

    class Row:
        name = "r"
        eval = eval_rows.summary(eval_rows.read_evaluation(tmp_path))

    value, step, scored, trouble = eval_families([Row()])
    assert sorted((s.labels["task"], s.labels["metric"], s.value) for s in value.samples) == \
        [("p", "byte_perplexity", 20.0), ("t", "acc", 0.5)]
    assert [s.value for s in step.samples] == [100.0] and [s.value for s in scored.samples] == [1.0]
    assert [s.value for s in trouble.samples] == [0.0]


# --------------------------------------------------------------------------- task names
def test_task_names_are_read_from_task_files_without_lm_eval(tmp_path):
    (tmp_path / "a.yaml").write_text("task: mine\ntag:\n  - fam1\n  - fam2\ndataset_path: json\n")
    (tmp_path / "b.yaml").write_text("group: grp\ntask: [x1, x2]\n")
    assert eval_tasks.names_under(tmp_path) == {"mine", "fam1", "fam2", "grp", "x1", "x2"}
    python = eval_interpreter(load_profile("local"), sys.executable)  # <venv>-eval: scripts/setup.sh makes it
    unknown, looked = eval_tasks.unknown_tasks(["mine", "lmlaunch_pydoc_choice", "no_such_task_xyz"], [str(tmp_path)],
                                               python)
    assert unknown == ["no_such_task_xyz"] and looked, (python, looked)
    assert eval_tasks.unknown_tasks(["hellaswag", "mmlu"], [], python) == ([], True)  # lm-eval's own names count
    assert eval_tasks.unknown_tasks(["hellaswag"], [], "/nonexistent/python") == (["hellaswag"], False)


def test_the_evaluators_environment_is_beside_the_tasks_and_keeps_scipy_from_them():
    """The local profile's eval_python: auto is ``<venv>-eval`` (scripts/setup.sh), which has lm-eval; the
    tasks' environment has neither lm-eval nor scipy, which torchmetrics would import at every rank's start."""
    python = eval_interpreter(load_profile("local"), sys.executable)
    assert python != sys.executable and Path(python).parent.parent.name.endswith("-eval"), python
    check = "import importlib.util as u; print(bool(u.find_spec('lm_eval')), bool(u.find_spec('scipy')))"
    assert subprocess.run([python, "-c", check], capture_output=True, text=True).stdout.split() == ["True", "True"]
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True).stdout.split() == \
        ["False", "False"]
