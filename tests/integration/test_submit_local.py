"""`lmlaunch submit` against the real local cluster: run directory, registry, the script
submitit wrote, --new/--resume, and clean failures. The jobs are cancelled right after
submission (their training is tested in test_submit_tiny_cpu_trains.py)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from slurm_helpers import HELD, REPO, wait_for
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.planning.resolve import resolve
from launcher.runs import registry as runs
from launcher.submit.script import render_script
from lmcore.slurm import admin, client as slurm

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")
SMALL = ("trainer.max_steps=12", "optim.warmup_steps=2")


def _job_id(out: str) -> str:
    m = re.search(r"job (\d+)", out)
    assert m, out
    return m.group(1)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_submit_creates_private_run_dir_registry_and_the_rendered_script(slurm_cluster, cli, lm_env, run_name, own_jobs):
    r = cli("submit", SPEC, f"name={run_name}", *SMALL)
    assert r.code == 0, r.err
    job_id = _job_id(r.out)
    own_jobs.append(job_id)
    # SLURM knows the job by the run name
    queued = slurm.squeue([job_id])
    slurm.cancel([job_id])
    assert [j.name for j in queued] == [run_name]

    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    assert f"run directory: {run_dir}" in r.out
    for cmd in ("status", "logs", "cancel"):
        assert f"lmlaunch {cmd} {run_name}" in r.out
    assert _mode(run_dir) == 0o700
    assert _mode(run_dir / "submitit") == 0o700
    assert _mode(run_dir / "logs") == 0o700

    plan = resolve(SPEC, [f"name={run_name}", *SMALL], environ=lm_env, python=sys.executable).plan
    written = json.loads((run_dir / "plan.json").read_text())
    assert written["run_name"] == run_name
    assert written["slurm"] == plan.to_dict()["slurm"]
    assert written["trainer"]["max_steps"] == 12
    assert "name: " + run_name in (run_dir / "spec.yaml").read_text()
    # the sbatch script submitit wrote is exactly what --dry-run prints
    assert (run_dir / "submitit" / f"{job_id}_submission.sh").read_text() == render_script(plan)
    # the pickled callable is lmtrain's task, by reference (no torch on the login node)
    pickle_bytes = (run_dir / "submitit" / f"{job_id}_submitted.pkl").read_bytes()
    assert b"lmtrain.task.train_task" in pickle_bytes and b"TrainTask" in pickle_bytes

    rec = runs.load_record(run_name, lm_env)
    assert rec is not None and rec.job_ids == [job_id]
    assert rec.run_dir == str(run_dir) and rec.profile == "local" and rec.max_steps == 12
    assert rec.spec_path == SPEC
    assert runs.find_run(job_id, lm_env).name == run_name


def test_same_run_name_is_refused_then_resume_and_new_work(slurm_cluster, cli, lm_env, run_name, own_jobs):
    first = cli("submit", SPEC, f"name={run_name}", *SMALL, HELD)  # held: still queued when --resume is refused
    assert first.code == 0, first.err
    job1 = _job_id(first.out)
    own_jobs.append(job1)
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name

    again = cli("submit", SPEC, f"name={run_name}", *SMALL)
    assert again.code == 2
    assert "already exists" in again.err and "--resume" in again.err and "--new" in again.err

    # the first job is still queued or running: --resume and --new must not mix two jobs in one run
    busy = cli("submit", SPEC, f"name={run_name}", *SMALL, "--resume")
    assert busy.code == 2 and job1 in busy.err and "still has a job" in busy.err
    dry = cli("submit", SPEC, f"name={run_name}", *SMALL, "--resume", "--dry-run")  # the dry run says the same
    assert dry.code == 2 and job1 in dry.err and "still has a job" in dry.err and dry.out == "", dry.out + dry.err
    assert runs.load_record(run_name, lm_env).job_ids == [job1]

    slurm.cancel([job1])
    wait_for(job1, {"cancelled", "completed", "failed"}, poll=0.5)
    (run_dir / "CANCELLED").write_text("test\n")
    resumed = cli("submit", SPEC, f"name={run_name}", *SMALL, "--resume")
    assert resumed.code == 0, resumed.err
    job2 = _job_id(resumed.out)
    own_jobs.append(job2)
    slurm.cancel([job2])
    assert runs.load_record(run_name, lm_env).job_ids == [job1, job2]
    assert not (run_dir / "CANCELLED").exists()  # an explicit resume lifts the earlier cancel
    assert (run_dir / "submitit" / f"{job1}_submission.sh").exists()
    assert (run_dir / "submitit" / f"{job2}_submission.sh").exists()

    wait_for(job2, {"cancelled", "completed", "failed"}, poll=0.5)
    fresh = cli("submit", SPEC, f"name={run_name}", *SMALL, "--new")
    assert fresh.code == 0, fresh.err
    job3 = _job_id(fresh.out)
    own_jobs.append(job3)
    slurm.cancel([job3])
    archived = [p for p in run_dir.parent.iterdir() if p.name.startswith(f"{run_name}.archived-")]
    assert len(archived) == 1
    old = json.loads((archived[0] / "registry.json").read_text())
    assert old["job_ids"] == [job1, job2]
    assert (archived[0] / "submitit" / f"{job1}_submission.sh").exists()
    assert runs.load_record(run_name, lm_env).job_ids == [job3]
    assert not (run_dir / "submitit" / f"{job1}_submission.sh").exists()


def test_group_writable_run_dir_is_refused(slurm_cluster, cli, lm_env, run_name):
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    run_dir.mkdir(parents=True)
    os.chmod(run_dir, 0o775)
    r = cli("submit", SPEC, f"name={run_name}", "--resume")
    assert r.code == 2
    assert "writable by group or others" in r.err and str(run_dir) in r.err
    assert runs.load_record(run_name, lm_env) is None
    assert sorted(os.listdir(run_dir)) == []


def test_sbatch_refusal_leaves_no_run_dir_and_no_registry_entry(slurm_cluster, cli, lm_env, run_name, tmp_path):
    # a profile whose partition the cluster does not have: the plan is valid, sbatch refuses it
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    text = (REPO / "cluster_profiles" / "local.yaml").read_text()
    (profiles / "ghostly.yaml").write_text(text.replace("default_partition: low", "default_partition: ghost").replace(
        "partitions:\n", "partitions:\n  ghost: {max_time: \"1:00:00\"}\n", 1))
    env = {**lm_env, "LMLAUNCH_PROFILES_DIR": str(profiles)}
    os.environ["LMLAUNCH_PROFILES_DIR"] = str(profiles)
    try:
        r = cli("submit", SPEC, f"name={run_name}", "--cluster", "ghostly", env=env)
    finally:
        del os.environ["LMLAUNCH_PROFILES_DIR"]
    assert r.code == 5, r.out + r.err  # REFUSED
    assert "sbatch refused the job" in r.err and "partition" in r.err.lower()
    assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name).exists()
    assert runs.load_record(run_name, lm_env) is None
    dry = cli("submit", SPEC, f"name={run_name}", "--cluster", "ghostly", "--dry-run", env=env)
    assert dry.code == 0 and dry.out.startswith(
        "# the cluster: not asked (the SLURM that answers here lists no partition 'ghost'"), dry.out[:300]


def test_the_dry_run_asks_the_controller_and_is_refused_as_submit_would_be(slurm_cluster, cli, lm_env, run_name):
    """The dry run is the submission minus the queue: `sbatch --test-only` on the script submit would
    send; what the controller refuses exits 5 (REFUSED) with its words, nothing queued or written."""
    ok = cli("submit", SPEC, f"name={run_name}", *SMALL, "--dry-run")
    assert ok.code == 0 and re.match(r"# the cluster would take it \(sbatch --test-only: .*Job \d+ to start at .*"
                                     r"in partition low\)\n# lmlaunch plan", ok.out), ok.out[:400]
    said = json.loads(cli("submit", SPEC, f"name={run_name}", *SMALL, "--dry-run", "--json").out)["cluster"]
    assert said.startswith("the cluster would take it (sbatch --test-only: "), said
    shape = cli("submit", SPEC, f"name={run_name}", *SMALL, "resources.cpus_per_task=8", "--dry-run")
    assert shape.code == 5 and shape.out == "", shape.out + shape.err
    assert ("resources: the cluster cannot run this job as asked (sbatch --test-only: " in shape.err
            and "cpus_per_task(8) on partition 'low', which has 2 node(s) of 4 CPUs" in shape.err), shape.err
    refused = cli("submit", SPEC, f"name={run_name}", *SMALL, "slurm.sbatch.reservation=nowhere", "--dry-run", "--json")
    got = json.loads(refused.out)["error"]
    assert refused.code == 5 and got["kind"] == "refused" and "reservation" in got["message"].lower(), got
    assert "; it concerns slurm.sbatch.reservation;" in got["message"], got  # the key SLURM's words name
    feature = cli("submit", SPEC, f"name={run_name}", *SMALL, "resources.constraint=nowhere", "--dry-run")
    assert feature.code == 5 and "Invalid feature specification); it concerns resources.constraint" in feature.err, \
        feature.err
    assert not [j for j in slurm.squeue() if j.name == run_name]
    assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name).exists() and runs.load_record(run_name, lm_env) is None
    # a node out of service now is not a shape the cluster cannot hold: sbatch would queue the job
    # to wait for it, and the dry run says so (naming it), while a shape too large is still refused
    admin.set_node_state("n2", "DRAIN", "dry-run test")
    try:
        waits = cli("submit", SPEC, f"name={run_name}", *SMALL, "--dry-run")
        too_big = cli("submit", SPEC, f"name={run_name}", *SMALL, "resources.cpus_per_task=8", "--dry-run")
        alongside = cli("submit", str(REPO / "jobs" / "tiny-cpu-eval.yaml"), f"name={run_name}", "resources.nodes=2",
                        "trainer.global_batch_size=16", "--dry-run")  # a heterogeneous job: the same
    finally:
        admin.set_node_state("n2", "RESUME")
    assert waits.code == 0 and waits.out.startswith("# the cluster would queue it to wait (sbatch --test-only: "), \
        waits.out[:400] + waits.err
    assert "out of service: n2 (drain" in waits.out and ": dry-run test)" in waits.out, waits.out[:600]
    assert too_big.code == 5 and "cannot run this job as asked" in too_big.err, too_big.err
    assert alongside.code == 0 and "out of service: n2 (drain" in alongside.out.splitlines()[0], \
        alongside.out[:400] + alongside.err


def test_unreachable_controller_is_a_clear_message_and_nothing_is_written(slurm_cluster, lm_env, run_name, tmp_path):
    conf = tmp_path / "slurm.conf"
    text = Path(slurm_cluster.slurm_conf).read_text()
    conf.write_text(re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=6999", text))
    env = {**lm_env, "SLURM_CONF": str(conf)}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "lmlaunch"), "submit", SPEC, f"name={run_name}"],
        capture_output=True, text=True, env=env, timeout=HANG_S,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "controller does not answer" in proc.stderr and "lmlaunch cluster up" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name).exists()
    assert runs.load_record(run_name, lm_env) is None
