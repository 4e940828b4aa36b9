"""The eval task (lmtrain.task.evaluate) and pipeline files (launcher.submit.pipeline): an eval run computes
what the Trainer's validation computes, on the checkpoint it is pointed at; a pipeline's stages
are validated and planned before anything is submitted, with their references resolved."""

from __future__ import annotations

import io
import json

import pytest

from launcher.submit import pipeline
from lmcore.errors import SpecError

TINY = ["model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=32",
        "data.seq_len=32"]


def _pipe(tmp_path, stages) -> tuple[pipeline.PipelineFile, str]:
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"name": "pp", "stages": stages}))
    return pipeline.load(path), str(path)


def test_stages_get_run_names_dependencies_and_resolved_references(tmp_path):
    pipe, path = _pipe(tmp_path, [
        {"name": "train", "spec": "t.yaml", "overrides": ["trainer.max_steps=6"]},
        {"name": "eval", "spec": "t.yaml", "after": ["train"], "overrides": ["eval.checkpoint=${train.checkpoint}"]},
        {"name": "report", "spec": "t.yaml", "after": ["train:any", "eval:ok", "singleton"]},
    ])
    plans = pipeline.stage_plans(pipe, path, run_dir_of={"train": "/runs/pp.train"})
    assert [(p.run, p.after) for p in plans] == [
        ("pp.train", []), ("pp.eval", ["pp.train:ok"]), ("pp.report", ["pp.train:any", "pp.eval:ok", "singleton"])]
    assert plans[1].overrides == ["eval.checkpoint=/runs/pp.train", "name=pp.eval"]
    assert plans[0].spec_path == str(tmp_path / "t.yaml")


@pytest.mark.parametrize("stages, words", [
    ([{"name": "a", "spec": "t.yaml", "after": ["b"]}, {"name": "b", "spec": "t.yaml"}],
     "stages[0] (a): after 'b': no earlier stage 'b'"),
    ([{"name": "a", "spec": "t.yaml", "overrides": ["eval.checkpoint=${z.checkpoint}"]}],
     "${z.checkpoint} names no earlier stage"),
    ([{"name": "a", "spec": "t.yaml"}, {"name": "a", "spec": "t.yaml"}], "a second stage named 'a'"),
])
def test_bad_references_are_named_with_the_stage(tmp_path, stages, words):
    pipe, path = _pipe(tmp_path, stages)
    with pytest.raises(SpecError, match=None) as err:
        pipeline.stage_plans(pipe, path)
    assert words in str(err.value) and path in str(err.value)


def test_a_bad_pipeline_file_names_the_key_and_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: pp\nstages:\n  - name: a\n    spec: t.yaml\n    afterr: [b]\n")
    with pytest.raises(SpecError) as err:
        pipeline.load(path)
    assert "line 5" in str(err.value) and "afterr" in str(err.value) and "after" in str(err.value)


def _cli(*args, environ):
    from launcher.cli import main
    from launcher.context import Context

    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), Context(stdout=out, stderr=err, environ=environ))
    return code, out.getvalue(), err.getvalue()


def test_the_dry_run_plans_every_stage_and_an_invalid_one_stops_everything(repo, runs_root, tmp_path):
    env = {"LMLAUNCH_RUNS_ROOT": str(runs_root), "LMLAUNCH_HOME": str(tmp_path / "home")}
    code, out, err = _cli("pipeline", str(repo / "jobs" / "pipelines" / "tiny-train-eval.yaml"), "--dry-run", "--json",
                          environ=env)
    assert code == 0, err
    stages = json.loads(out)["stages"]
    assert [(s["run"], s["after"]) for s in stages] == [("tiny-pipe.train", []), ("tiny-pipe.eval", ["tiny-pipe.train:ok"])]
    assert f"eval.checkpoint={runs_root / 'tiny-pipe.train'}" in stages[1]["overrides"]
    bad = tmp_path / "bad.yaml"
    text = (repo / "jobs" / "pipelines" / "tiny-train-eval.yaml").read_text()
    bad.write_text(text.replace("eval.max_batches=20", "eval.max_batches=0")
                   .replace("spec: ../tiny-cpu.yaml", f"spec: {repo / 'jobs' / 'tiny-cpu.yaml'}"))
    code, out, err = _cli("pipeline", str(bad), environ=env)  # not a dry run: nothing may be submitted
    assert code == 4 and "pipeline stage 'eval'" in err and "eval.max_batches" in err, err
    assert not (runs_root.exists() and list(runs_root.iterdir())) and not (tmp_path / "home" / "registry").exists()


def _run(repo, runs_root, name: str, *extra: str) -> tuple[int, str]:
    code, out, err = _cli("run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", "--devices", "1", "--name", name,
                          *TINY, *extra, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)})
    return code, out + err


def _ledger(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_eval_computes_what_the_trainers_validation_computed_on_the_final_checkpoint(repo, runs_root):
    code, text = _run(repo, runs_root, "ev-train", "--max-steps", "8", "trainer.val_check_interval=4")
    assert code == 0, text[-3000:]
    plan = json.loads((runs_root / "ev-train" / "plan.json").read_text())
    last_val = [json.loads(x) for x in (runs_root / "ev-train" / "metrics" / "heartbeat.jsonl").read_text().splitlines()
                if '"val"' in x][-1]
    assert last_val["step"] == 8
    batches = plan["trainer"]["limit_val_batches"]
    code, text = _run(repo, runs_root, "ev-eval", f"eval.checkpoint={runs_root / 'ev-train'}",
                      f"eval.max_batches={batches}")
    assert code == 0, text[-3000:]
    result = next(e for e in _ledger(runs_root / "ev-eval" / "attempts.jsonl") if e["event"] == "eval")
    assert result["step"] == 8 and result["batches"] == batches
    assert result["val_loss"] == pytest.approx(last_val["val_loss"], abs=1e-5)
    assert result["perplexity"] == pytest.approx(2.718281828 ** result["val_loss"], rel=1e-6)
    end = [e for e in _ledger(runs_root / "ev-eval" / "attempts.jsonl") if e["event"] == "end"][-1]
    assert end["reason"] == "completed" and end["detail"].startswith("eval of step-8: val_loss")


def test_eval_of_a_run_without_a_checkpoint_fails_and_says_where_it_looked(repo, runs_root, tmp_path):
    (tmp_path / "empty").mkdir()
    code, text = _run(repo, runs_root, "ev-none", f"eval.checkpoint={tmp_path / 'empty'}")
    assert code != 0
    end = [e for e in _ledger(runs_root / "ev-none" / "attempts.jsonl") if e["event"] == "end"][-1]
    assert end["reason"] == "crashed" and f"no complete checkpoint in {tmp_path / 'empty'}" in end["detail"], end
