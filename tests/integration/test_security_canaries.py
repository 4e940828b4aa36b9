"""Hostile paths and secrets on a real job: a runs root with a space and a quote trains end to end
in private directories, and secret canaries passed by reference (env.passthrough) reach the
tasks' environment but never the dry-run output, the job script, submitit's pickles, logs,
TensorBoard/CSV hparams, checkpoints or `scontrol show job -d` of the running job."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import uuid
from pathlib import Path

import waiting
from slurm_helpers import REPO, faults, gate, wait_terminal

from lmcore.slurm import client as slurm

SPEC = str(REPO / "jobs" / "tiny-cpu.yaml")


def _task_environs(folder: str) -> list[bytes]:
    """The environment blocks of this machine's processes started for the job's submitit folder."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"lmtrain.task.main" in cmd and folder.encode() in cmd:
                out.append(Path(f"/proc/{pid}/environ").read_bytes())
        except OSError:
            continue
    return out


def test_quoted_spaced_runs_root_trains_privately_and_secret_canaries_appear_nowhere(
    slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path, monkeypatch
):
    root = tmp_path / "x y" / "it's"
    wandb, hf = f"canary-wandb-{uuid.uuid4().hex}", f"canary-hf-{uuid.uuid4().hex}"
    monkeypatch.setenv("WANDB_API_KEY", wandb)
    monkeypatch.setenv("HF_TOKEN", hf)
    env = {**lm_env, "LMLAUNCH_RUNS_ROOT": str(root), "WANDB_API_KEY": wandb, "HF_TOKEN": hf}
    args = (SPEC, f"name={run_name}", "trainer.max_steps=12", "optim.warmup_steps=2", "trainer.val_check_interval=6",
            "trainer.log_every_n_steps=2", "checkpoint.every_n_steps=6", "env.passthrough=[WANDB_API_KEY, HF_TOKEN]")

    dry = cli("submit", *args, "--dry-run", env=env)
    assert dry.code == 0, dry.err
    assert "WANDB_API_KEY" in dry.out  # by name ...
    assert wandb not in dry.out + dry.err and hf not in dry.out + dry.err  # ... never by value

    released = tmp_path / "seen"  # every rank held after its second step until the test has read the tasks' environment
    with faults(gate("train.batch_end", released, step=2)):
        r = cli("submit", *args, env=env)
    assert r.code == 0, r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job_id)
    run_dir = root / run_name
    assert wandb not in r.out + r.err

    # while it runs: the tasks have the secrets in their environment, SLURM does not show them
    shown = b""
    environs: list[bytes] = []

    def seen_or_ended() -> bool:
        nonlocal shown, environs
        proc = subprocess.run(["scontrol", "show", "job", "-d", job_id], capture_output=True, env=slurm.slurm_env())
        shown += proc.stdout + proc.stderr
        environs = _task_environs(str(run_dir / "submitit"))
        return bool(environs) or slurm.state_group(slurm.job_state(job_id)) not in ("queued", "running")

    waiting.until(seen_or_ended, progress=waiting.job(job_id), what=f"a task of job {job_id} running")
    released.touch()
    assert environs, "no task process of the job was seen running"
    assert all(f"WANDB_API_KEY={wandb}".encode() in e and f"HF_TOKEN={hf}".encode() in e for e in environs)
    assert b"JobState=RUNNING" in shown or b"JobState=" in shown
    assert wandb.encode() not in shown and hf.encode() not in shown

    state = wait_terminal(job_id)
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in run_dir.rglob("*.log"))
    assert state == "COMPLETED", f"{state}\n{logs}"
    ends = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines() if '"end"' in x]
    assert ends[-1]["reason"] == "completed" and ends[-1]["end_step"] == 12

    # private directories on the hostile path
    for d in (run_dir, run_dir / "submitit", run_dir / "logs", run_dir / "checkpoints"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d

    # every byte the run wrote (script, pickles, logs, tensorboard events, csv hparams, checkpoints)
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    kinds = {p.suffix for p in files} | {p.name.split(".")[0] for p in files}
    assert ".pkl" in kinds and ".sh" in kinds and ".log" in kinds and ".pt" in kinds and "events" in kinds, kinds
    assert any(p.name == "hparams.yaml" for p in files)
    for p in files:
        data = p.read_bytes()
        assert wandb.encode() not in data and hf.encode() not in data, p
    # the canaries are also absent from the registry
    for p in Path(lm_env["LMLAUNCH_HOME"]).rglob("*"):
        if p.is_file():
            assert wandb.encode() not in p.read_bytes(), p


def test_group_writable_submitit_folder_of_an_existing_run_is_refused(slurm_cluster, cli, lm_env, run_name):
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    (run_dir / "submitit").mkdir(parents=True)
    os.chmod(run_dir, 0o700)
    os.chmod(run_dir / "submitit", 0o777)
    planted = run_dir / "submitit" / "planted.pkl"
    planted.write_bytes(b"not ours")
    r = cli("submit", SPEC, f"name={run_name}", "trainer.max_steps=5", "optim.warmup_steps=1", "--resume")
    assert r.code == 2, r.out + r.err
    assert "submitit folder of the run directory" in r.err and "writable by group or others" in r.err
    assert str(run_dir / "submitit") in r.err
    assert stat.S_IMODE((run_dir / "submitit").stat().st_mode) == 0o777  # left as found, nothing submitted
    assert not (run_dir / "plan.json").exists()
    assert [j.job_id for j in slurm.squeue(name=run_name)] == []
