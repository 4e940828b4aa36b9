"""Sweeps (launcher.search.sweep): points from grid, zip and seeded random parts; every point planned and
validated before anything is submitted; one job shape per array; the array script picks each
task's run directory; arrays larger than MaxArraySize are split and chained."""

from __future__ import annotations

import io
import json
import subprocess

import pytest

from launcher.search import sweep
from lmcore.errors import SpecError


def _sweep(tmp_path, d: dict) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(d))
    return str(path)


def test_points_are_the_product_of_grid_zip_and_random_samples(tmp_path):
    sw = sweep.load(_sweep(tmp_path, {
        "name": "s", "grid": {"optim.lr": [0.001, 0.003]},
        "zip": {"optim.warmup_steps": [1, 2], "optim.min_lr": [0.0001, 0.0002]},
        "random": {"n": 2, "seed": 7, "params": {"optim.weight_decay": {"uniform": [0.0, 0.1]},
                                                 "data.micro_batch_size": {"choice": [2, 4]}}}}))
    pts = sweep.points(sw)
    assert len(pts) == 2 * 2 * 2
    assert pts[0]["optim.lr"] == 0.001 and pts[0]["optim.warmup_steps"] == 1 and pts[0]["optim.min_lr"] == 0.0001
    assert {p["optim.lr"] for p in pts} == {0.001, 0.003}
    assert all(0.0 <= p["optim.weight_decay"] <= 0.1 and p["data.micro_batch_size"] in (2, 4) for p in pts)
    assert sweep.points(sw) == pts  # seeded: the same points every time
    assert sweep.overrides({"optim.lr": 0.001, "trainer.precision": "bf16-mixed"}) == [
        "optim.lr=0.001", "trainer.precision=bf16-mixed"]


@pytest.mark.parametrize("d, words", [
    ({"name": "s"}, "there is nothing to sweep"),
    ({"name": "s", "zip": {"optim.lr": [1, 2], "optim.min_lr": [1]}}, "every list must have one length"),
    ({"name": "s", "grid": {"lr": [1]}}, "is not a dotted key"),
    ({"name": "s", "grid": {"optim.lr": []}}, "an empty list sweeps nothing"),
    ({"name": "s", "random": {"n": 2, "params": {"optim.lr": {"uniform": [0, 1], "choice": [1]}}}}, "exactly one of"),
    ({"name": "s", "gird": {"optim.lr": [1]}}, "unknown key 'gird'"),
])
def test_bad_sweep_files_are_refused_with_the_file_and_the_key(tmp_path, d, words):
    path = _sweep(tmp_path, d)
    with pytest.raises(SpecError) as err:
        sweep.load(path)
    assert words in str(err.value) and path in str(err.value)


def _cli(*args, environ):
    from launcher.cli import main
    from launcher.context import Context

    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), Context(stdout=out, stderr=err, environ=environ))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def env(runs_root, tmp_path):
    return {"LMLAUNCH_RUNS_ROOT": str(runs_root), "LMLAUNCH_HOME": str(tmp_path / "home")}


def test_the_dry_run_shows_the_points_and_the_one_array_script(repo, env, tmp_path):
    path = _sweep(tmp_path, {"name": "lr", "max_parallel": 2, "grid": {"optim.lr": [0.001, 0.003, 0.01]},
                             "zip": {"optim.warmup_steps": [1, 2]}})
    code, out, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, "resources.nodes=1", "--dry-run",
                          environ=env)
    assert code == 0, err
    assert "# sweep 'lr': 6 points, one SLURM array, at most 2 at once; nothing submitted" in out
    assert "#SBATCH --array=0-5%2" in out and out.count("#SBATCH --array") == 1
    runs_root = env["LMLAUNCH_RUNS_ROOT"]
    assert f"LMLAUNCH_POINTS=({' '.join(f'{runs_root}/lr.{i}' for i in range(6))})" in out
    assert 'export LMLAUNCH_RUN_DIR="${LMLAUNCH_POINTS[$SLURM_ARRAY_TASK_ID]}"' in out
    assert 'export PYTHONPATH="$LMLAUNCH_RUN_DIR/code/lmlaunch-code.zip${PYTHONPATH:+:$PYTHONPATH}"' in out
    # each task's code snapshot first, a PYTHONPATH the cluster's setup gave kept after it, none empty
    points = out[out.index("LMLAUNCH_POINTS=("):].split("\n")[:3]
    code = f"{runs_root}/lr.1/code/lmlaunch-code.zip"
    for inherited, want in (("/opt/site", f"{code}:/opt/site"), ("", code)):
        shown = subprocess.run(["bash", "-c", "\n".join([*points, 'printf %s "$PYTHONPATH"'])], capture_output=True,
                               text=True, env={"SLURM_ARRAY_TASK_ID": "1", **({"PYTHONPATH": inherited} if inherited else {})})
        assert shown.stdout == want, shown
    assert f"-m lmtrain.task.main --signal USR2 {runs_root}/lr/submitit" in out


@pytest.mark.parametrize("cluster", ["h100-ib", "a100-roce"])
def test_a_gpu_sweep_in_a_container_sets_each_points_own_paths(repo, env, tmp_path, cluster):
    """A GPU profile plans a variable that names the run directory (the NCCL flight recorder's
    file): each array task gets its own point's, and the container starts in the sweep directory,
    as the array's tasks do on the host."""
    path = _sweep(tmp_path, {"name": "glr", "grid": {"optim.lr": [0.001, 0.003]}})
    code, out, err = _cli("sweep", str(repo / "jobs" / "llama-1b-container.yaml"), path, "--cluster", cluster,
                          "--dry-run", environ=env)
    assert code == 0, err
    runs_root = env["LMLAUNCH_RUNS_ROOT"]
    script = out[out.index("#!/bin/bash"):]
    script = script[:script.index("\n## ")] if "\n## " in script else script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    lines = out[out.index("LMLAUNCH_POINTS=("):].split("\n")
    flight = next(x for x in lines if x.startswith("export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="))
    shown = subprocess.run(["bash", "-c", "\n".join([*lines[:3], flight, 'printf %s "$TORCH_NCCL_DEBUG_INFO_TEMP_FILE"'])],
                           capture_output=True, text=True, env={"SLURM_ARRAY_TASK_ID": "1"})
    assert shown.stdout == f"{runs_root}/glr.1/logs/nccl-flight-rank-", shown
    workdir = "--container-workdir=" if cluster == "h100-ib" else "--pwd "
    assert f"{workdir}{runs_root}/glr " in out and f"{workdir}{runs_root}/glr.0" not in out


def test_one_invalid_point_fails_the_sweep_naming_it_and_nothing_is_written(repo, env, tmp_path):
    path = _sweep(tmp_path, {"name": "bad", "grid": {"trainer.max_steps": [10, 20, -1]}})
    code, out, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, environ=env)
    assert code == 4 and "point 2 (trainer.max_steps=-1)" in err and "trainer.max_steps" in err, err
    root = tmp_path / "runs"
    assert not (root.exists() and list(root.iterdir())) and not (tmp_path / "home" / "registry").exists()


def test_a_point_that_changes_the_jobs_shape_is_refused(repo, env, tmp_path):
    path = _sweep(tmp_path, {"name": "shape", "grid": {"resources.nodes": [1, 2]}})
    code, out, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, "--dry-run", environ=env)
    assert code == 4 and "point 1 (resources.nodes=2) changes the job's shape (slurm.nodes" in err, err


def test_an_array_larger_than_max_array_size_is_split_and_chained(repo, env, tmp_path, monkeypatch):
    from launcher.search import sweep_arrays as command  # where the sweep's arrays are submitted
    from lmcore.slurm import client as slurm

    calls = []

    def fake_submit(plan, run_dirs, sweep_dir, parallel, dependency=None):
        array = str(100 + len(calls))
        calls.append((len(run_dirs), parallel, dependency))
        return [f"{array}_{i}" for i in range(len(run_dirs))]

    monkeypatch.setattr(command, "submit_array", fake_submit)
    monkeypatch.setattr(slurm, "ping", lambda *a, **k: True)
    monkeypatch.setattr(slurm, "config", lambda *a, **k: {"MaxArraySize": "4"})
    path = _sweep(tmp_path, {"name": "big", "max_parallel": 3, "grid": {"optim.lr": [0.001 * i for i in range(1, 10)]}})
    code, out, err = _cli("sweep", str(repo / "jobs" / "tiny-cpu.yaml"), path, "resources.nodes=1", "--json",
                          environ=env)
    assert code == 0, err
    assert calls == [(4, 3, None), (4, 3, "afterany:100"), (1, 3, "afterany:101")]
    got = json.loads(out)
    assert got["arrays"] == ["100", "101", "102"] and got["points"][4] == {"run": "big.4", "job_id": "101_0"}
    code, out, err = _cli("status", "big", "--json", environ=env)
    assert code == 0 and [r["name"] for r in json.loads(out)["runs"]] == [f"big.{i}" for i in range(9)], out
