"""Searches (a sweep file with ``search: optuna``): the file's checks, the storage a profile names
(no password in a URL, no SQLite), the driver's decisions as a table, a pruned attempt's end,
a trial's rank 0 reporting to a real Optuna study (journal storage) and being pruned, and the
results table. The search on the real cluster: tests/integration/test_search_on_cluster.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sweep_points import _cli  # the CLI in-process, as the sweep tests call it

from launcher.monitor import sweep_rows
from launcher.search import sweep
from launcher.search.policy import TrialFacts, next_steps, objective
from lmcore.errors import SpecError
from lmcore.search.search_spec import SearchFile
from lmcore.search.study_storage import StorageRef, SweepStorage, mask_password

BASE = {"name": "s", "search": "optuna", "trials": 4, "params": {"optim.lr": {"float": [1e-4, 1e-2], "log": True}}}


def _file(tmp_path: Path, d: dict) -> str:
    path = tmp_path / "search.yaml"
    path.write_text(json.dumps(d))
    return str(path)


def test_a_search_file_is_read_with_its_defaults(tmp_path):
    s = sweep.load(_file(tmp_path, BASE))
    assert isinstance(s, SearchFile) and s.trials == 4 and s.max_parallel == 1
    assert (s.sampler.name, s.pruner.name, s.objective.metric, s.objective.at) == ("tpe", "median", "val_loss", "last")
    assert s.run_name(3) == "s.3"


@pytest.mark.parametrize("change, words", [
    ({"sampler": {"name": "bayes"}}, "sampler.name"),
    ({"pruner": {"name": "patient"}}, "pruner.name"),
    ({"params": {"optim.lr": {"float": [0.01, 0.001]}}}, "is inverted"),
    ({"params": {"optim.lr": {"float": [0.01, 0.01]}}}, "is empty"),
    ({"params": {"optim.lr": {"float": [0.0, 0.01], "log": True}}}, "touches 0"),
    ({"params": {"optim.warmup_steps": {"int": [-2, 4], "log": True}}}, "touches 0"),
    ({"params": {"optim.lr": {"categorical": []}}}, "params.optim.lr.categorical"),
    ({"params": {"optim.lr": {"float": [0.1, 0.2], "int": [1, 2]}}}, "exactly one of float, int, categorical"),
    ({"params": {"lr": {"float": [0.1, 0.2]}}}, "is not a dotted key"),
    ({"params": {"resources.nodes": {"int": [1, 2]}}}, "not the job's name or shape"),
    ({"params": {}}, "params"),
    ({"trials": 0}, "trials"),
    ({"objective": {"metric": "accuracy"}}, "objective.metric"),
    ({"sampler": {"name": "grid"}}, "continuous range"),
    ({"sampler": {"name": "grid"}, "params": {"optim.warmup_steps": {"int": [0, 1]}}}, "trials(4) > the grid's 2"),
    ({"serach": 1}, "serach"),
])
def test_bad_search_files_are_refused_naming_the_key(tmp_path, change, words):
    path = _file(tmp_path, {**BASE, **change})
    with pytest.raises(SpecError) as err:
        sweep.load(path)
    assert words in str(err.value) and path in str(err.value), str(err.value)


def test_a_storage_url_with_a_password_is_refused_without_saying_the_password():
    with pytest.raises(ValueError) as err:
        SweepStorage.model_validate({"url": "mysql+pymysql://optuna:s3cr3t-pw@db.example.org/optuna"})
    text = str(err.value)
    assert "holds a password" in text and "password_file" in text and "s3cr3t-pw" not in text
    assert "mysql+pymysql://optuna:***@db.example.org/optuna" in text
    assert mask_password("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
    assert mask_password("mysql+pymysql://u@h/db") == "mysql+pymysql://u@h/db"


@pytest.mark.parametrize("storage, words", [
    ({"url": "sqlite:////shared/optuna.db"}, "not safe on a cluster's shared filesystem"),
    ({"url": "redis://h/0"}, "not a database URL"),
    ({"journal": "/shared/j.log", "local_cluster": True}, "exactly one of"),
    ({}, "exactly one of"),
    ({"journal": "/shared/j.log", "password_file": "/x"}, "password_file goes with url"),
])
def test_storages_a_cluster_cannot_share_are_refused(storage, words):
    with pytest.raises(ValueError) as err:
        SweepStorage.model_validate(storage)
    assert words in str(err.value)


@pytest.fixture
def env(runs_root, tmp_path):
    return {"LMLAUNCH_RUNS_ROOT": str(runs_root), "LMLAUNCH_HOME": str(tmp_path / "home")}


SMALL = ["resources.nodes=1", "optim.min_lr=1.0e-5", "trainer.max_steps=30", "trainer.val_check_interval=5"]


def test_the_dry_run_says_the_search_and_plans_every_parameters_ends(repo, env, tmp_path):
    path = _file(tmp_path, {**BASE, "max_parallel": 2, "params": {**BASE["params"], "optim.warmup_steps": {"int": [0, 8]}}})
    code, out, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, *SMALL, "--dry-run", environ=env)
    assert code == 0, err
    assert "# search 's': 4 trials, at most 2 queued or running at once; nothing submitted" in out
    assert "objective: minimize val_loss (last logged value)" in out and "pruner:    median" in out
    assert "study:     (the local cluster's MariaDB)" in out and "runs s.0 .. s.3" in out
    assert not Path(env["LMLAUNCH_RUNS_ROOT"]).exists() or not list(Path(env["LMLAUNCH_RUNS_ROOT"]).iterdir())


@pytest.mark.parametrize("params, extra, words", [
    ({"optim.nonsense": {"float": [0.1, 0.2]}}, [], "optim.nonsense"),
    ({"optim.lr": {"float": [1e-4, 1e-2]}}, ["optim.min_lr=3.0e-4"], "params.optim.lr = 0.0001"),
    ({"trainer.max_steps": {"int": [-5, 10]}}, [], "params.trainer.max_steps = -5"),
])
def test_a_space_the_spec_refuses_fails_before_anything_is_made(repo, env, tmp_path, params, extra, words):
    path = _file(tmp_path, {**BASE, "params": params})
    code, out, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, *SMALL, *extra, environ=env)
    assert code == 4 and words in err, err
    assert not (Path(env["LMLAUNCH_HOME"]) / "searches").exists()


def test_a_metric_the_runs_never_log_is_refused(repo, env, tmp_path):
    path = _file(tmp_path, BASE)
    code, _, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, *SMALL, "trainer.limit_val_batches=0",
                        "--dry-run", environ=env)
    assert code == 4 and "objective.metric val_loss: the runs never log it" in err, err
    code, _, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, *SMALL[:-1],
                        "trainer.val_check_interval=30", "--dry-run", environ=env)
    assert code == 4 and "nothing to prune on" in err, err
    ok = _file(tmp_path, {**BASE, "objective": {"metric": "loss"}})
    code, _, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), ok, *SMALL, "trainer.limit_val_batches=0",
                        "--dry-run", environ=env)
    assert code == 0, err


def test_a_profile_storage_url_with_a_password_is_an_error_naming_the_key(repo, env, tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    local = (repo / "cluster_profiles" / "local.yaml").read_text()
    (profiles / "pwsite.yaml").write_text(local.replace(
        "sweep_storage: {local_cluster: true}",
        "sweep_storage: {url: 'mysql+pymysql://optuna:hunter2@db/optuna'}"))
    code, _, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), _file(tmp_path, BASE), *SMALL,
                        "--cluster", "pwsite", "--dry-run", environ={**env, "LMLAUNCH_PROFILES_DIR": str(profiles)})
    assert code == 4 and "sweep_storage" in err and "holds a password" in err and "hunter2" not in err, err
    assert "pwsite.yaml" in err


# --------------------------------------------------------------------------- the driver's decisions
def _t(n, state="RUNNING", submitted=True, active=True, **kw):
    return TrialFacts(n, state, submitted, active, **kw)


@pytest.mark.parametrize("trials, total, parallel, kinds, active, done", [
    ([], 8, 2, ["ask", "ask"], 2, False),  # a fresh search fills its slots
    ([_t(0), _t(1)], 8, 2, [], 2, False),  # both running: wait
    ([_t(0), _t(1, active=False, end_reason="completed", value=3.0)], 8, 2, ["complete", "ask"], 2, False),
    ([_t(0), _t(1, active=False, end_reason="pruned", end_detail="pruned at 5")], 8, 2, ["prune", "ask"], 2, False),
    ([_t(0), _t(1, active=False, end_reason="crashed", end_detail="boom")], 8, 2, ["fail", "ask"], 2, False),
    ([_t(0), _t(1, active=False, end_reason="completed", value=None)], 8, 2, ["fail", "ask"], 2, False),
    ([_t(0), _t(1, active=False)], 8, 2, ["fail", "ask"], 2, False),  # gone without an end line
    ([_t(0), _t(1, submitted=False, active=None)], 8, 2, ["submit"], 2, False),  # asked, driver died before sbatch
    ([_t(0, active=None), _t(1)], 8, 2, [], 2, False),  # SLURM did not answer: wait, ask nothing more
    ([_t(i, "COMPLETE") for i in range(7)] + [_t(7)], 8, 2, [], 1, False),  # the last one runs: nothing more
    ([_t(i, "COMPLETE") for i in range(7)] + [_t(7, active=False, end_reason="completed", value=1.0)], 8, 2,
     ["complete"], 0, True),
    ([_t(i, "PRUNED") for i in range(3)], 3, 2, [], 0, True),
    ([_t(0, "COMPLETE")], 4, 3, ["ask", "ask", "ask"], 3, False),
])
def test_the_driver_keeps_max_parallel_trials_and_asks_exactly_the_total(trials, total, parallel, kinds, active, done):
    plan = next_steps(trials, total=total, max_parallel=parallel)
    assert [s.kind for s in plan.steps] == kinds and plan.active == active and plan.done is done


def test_a_cancelled_search_ends_what_ended_and_asks_nothing():
    trials = [_t(0, active=False, end_reason="cancelled"), _t(1), _t(2, submitted=False, active=None)]
    plan = next_steps(trials, total=8, max_parallel=3, stopping=True)
    assert [(s.kind, s.number) for s in plan.steps] == [("fail", 0), ("fail", 2)] and not plan.done
    plan = next_steps([_t(0, "FAIL"), _t(1, active=False, end_reason="cancelled")], total=8, max_parallel=3,
                      stopping=True)
    assert [s.kind for s in plan.steps] == ["fail"] and plan.done


def test_the_objective_is_the_last_or_the_best_logged_value():
    assert objective([3.0, 2.0, 2.5], at="last", direction="minimize") == 2.5
    assert objective([3.0, 2.0, 2.5], at="best", direction="minimize") == 2.0
    assert objective([3.0, 2.0, 2.5], at="best", direction="maximize") == 3.0
    assert objective([], at="last", direction="minimize") is None


def test_results_mark_the_best_and_the_step_a_trial_was_pruned_at():
    trials = [{"number": 1, "state": "PRUNED", "value": 4.7, "params": {"optim.lr": 1e-4}, "steps": [5, 10], "why": "p"},
              {"number": 0, "state": "COMPLETE", "value": 3.2, "params": {"optim.lr": 2e-3}, "steps": [5], "why": None},
              {"number": 2, "state": "COMPLETE", "value": 3.1, "params": {"optim.lr": 3e-3}, "steps": [5], "why": None},
              {"number": 3, "state": "RUNNING", "value": None, "params": {"optim.lr": 1e-3}, "steps": [], "why": None}]
    rows = sweep_rows.search_rows(trials, lambda n: f"s.{n}", ["optim.lr"], "minimize")
    assert [r["trial"] for r in rows] == [0, 1, 2, 3]
    assert [r["state"] for r in rows] == ["complete", "pruned", "complete", "running"]
    assert [r["best"] for r in rows] == [False, False, True, False]
    assert rows[1]["pruned_at"] == 10 and rows[0]["pruned_at"] is None and rows[3]["objective"] is None


# --------------------------------------------------------------------------- a pruned attempt's end
def test_a_pruned_stop_ends_the_attempt_clean_and_never_requeues():
    from lmcore.job.plan import PreemptionPlan
    from lmcore.job.spec import PreemptionSpec
    from lmtrain.preemption.policy import EndFacts, StartFacts, decide, start_gate

    policy = PreemptionPlan.of(PreemptionSpec())
    facts = EndFacts(end_step=6, start_step=0, max_steps=30, checkpoint_step=6, stopped=True, crashed=False,
                     requested_reason="pruned", requested_detail="pruned by search s (median pruner) at step 5",
                     slurm_state="RUNNING", job_id="7")
    d = decide(facts, policy)
    assert (d.reason, d.requeued, d.action, d.exit_code) == ("pruned", False, None, 0)
    assert d.detail.startswith("pruned by search s (median pruner) at step 5")
    # a preemption at the same moment: SLURM requeues it; the pruned trial is cancelled, not trained again
    d = decide(EndFacts(**{**facts.__dict__, "slurm_state": "PENDING"}), policy)
    assert (d.reason, d.action) == ("pruned", "cancel")
    from lmcore.run.rundir import LedgerAttempt

    pruned = LedgerAttempt(attempt=1, job_id="7", start_step=0, end_step=6, reason="pruned", requeued=False)
    gate = start_gate(StartFacts(done_marker=False, cancelled_marker=False, start_step=6, restart_count=1,
                                 job_id="7", history=[pruned]), policy)
    assert gate.exit and gate.reason == "pruned"


# --------------------------------------------------------------------------- a trial's rank 0 and a real study
def test_rank_zero_reports_each_step_once_and_requests_the_stop_when_pruned(tmp_path):
    import optuna

    from lmcore.search import study
    from lmtrain.observe.trial_report import TrialReport

    ref = StorageRef("journal", str(tmp_path / "journal.log"))
    search = SearchFile.model_validate({**BASE, "trials": 3, "pruner": {"name": "median", "startup_trials": 1}})
    st = study.create_study(search, ref)
    done = st.ask()  # a completed trial whose curve a worse one is measured against
    for step, v in ((5, 3.0), (10, 2.5)):
        done.report(v, step)
    st.tell(done, 2.5)
    trial = st.ask()
    asked: list[tuple[str, str]] = []
    plan = study.TrialPlan(ref, "s", trial.number, "val_loss", "minimize", search.pruner.model_dump())
    rank0 = TrialReport(plan.to_json(), lambda reason, detail: asked.append((reason, detail)))
    rank0.report(3.5, 5)
    assert asked and asked[0][0] == "pruned" and "at step 5: val_loss 3.5" in asked[0][1]
    rank0.report(3.6, 10)  # pruned once: nothing more
    assert len(asked) == 1
    # the same trial after a requeue: the step reported before is not reported again
    again = TrialReport(plan.to_json(), lambda reason, detail: asked.append((reason, detail)))
    again.report(9.9, 5)
    frozen = study.load_study(search, ref).trials[trial.number]
    assert frozen.intermediate_values == {5: 3.5}
    # a study the trial cannot reach costs the run nothing
    lost = study.TrialPlan(StorageRef("rdb", "mysql+pymysql://u@127.0.0.1:1/none"), "s", 0, "val_loss", "minimize",
                           search.pruner.model_dump())
    TrialReport(lost.to_json(), lambda *a: pytest.fail("no stop without a study")).report(1.0, 5)
    assert isinstance(optuna.__version__, str)


def test_a_resumed_driver_does_not_ask_the_values_it_asked_before(tmp_path):
    """Seeded afresh, a sampler repeats its first draws: resumed after k trials it is seeded past them."""
    from lmcore.search import study

    ref = StorageRef("journal", str(tmp_path / "journal.log"))
    search = SearchFile.model_validate({**BASE, "trials": 6, "params": {**BASE["params"],
                                                                        "optim.warmup_steps": {"int": [0, 50]}}})
    dists = {k: study.distribution(v) for k, v in search.params.items()}
    st = study.create_study(search, ref)
    first = [st.ask(dists).params for _ in range(3)]
    again = study.load_study(search, ref)  # the driver killed and resumed
    later = [again.ask(dists).params for _ in range(3)]
    assert not any(p in first for p in later), (first, later)
    assert [t.number for t in again.get_trials()] == list(range(6))


@pytest.mark.parametrize("sampler, pruner", [("tpe", "median"), ("random", "asha"), ("cmaes", "hyperband"),
                                             ("grid", "none")])
def test_every_sampler_and_pruner_asks_values_within_the_spaces(tmp_path, sampler, pruner):
    """Each sampler asks trials inside the spaces (grid: every point once), each pruner answers
    at a reported step, all on a real Optuna study."""
    from lmcore.search import study

    params = ({"optim.warmup_steps": {"int": [0, 4], "step": 2}, "data.micro_batch_size": {"categorical": [2, 4]}}
              if sampler == "grid" else
              {"optim.lr": {"float": [1e-4, 1e-2], "log": True}, "optim.warmup_steps": {"int": [0, 20]}})
    search = SearchFile.model_validate({**BASE, "trials": 6, "params": params, "sampler": {"name": sampler},
                                        "pruner": {"name": pruner, "min_resource": 1}})
    ref = StorageRef("journal", str(tmp_path / f"{sampler}.log"))
    study.create_study(search, ref)
    st = study.load_study(search, ref)
    dists = {k: study.distribution(v) for k, v in search.params.items()}
    seen = []
    for i in range(6):
        trial = st.ask(dists)
        p = dict(trial.params)
        seen.append(tuple(sorted(p.items())))
        if sampler == "grid":
            assert p["optim.warmup_steps"] in (0, 2, 4) and p["data.micro_batch_size"] in (2, 4)
        else:
            assert 1e-4 <= p["optim.lr"] <= 1e-2 and 0 <= p["optim.warmup_steps"] <= 20
        trial.report(float(i), 5)
        assert bool(trial.should_prune()) in (True, False)
        study.tell(st, trial.number, float(i))  # as the driver tells (the grid's last point stops the study)
    if sampler == "grid":
        assert len(set(seen)) == 6  # the 3 x 2 grid, each point once
