"""W&B (offline, as the tests run it) logs every attempt of a run into ONE run id: the id is the
run's (``<run dir>/wandb_id``), every attempt resumes it. TensorBoard and CSV across a lost-work
restart: tests/unit/test_preemption_signals.py; across ten preemptions on SLURM:
tests/integration/test_preempt_resume.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from launcher.commands.run import prepare_local_run
from lmtrain.local import launch

HELPER = Path(__file__).with_name("_train_with_stop.py")
OVERRIDES = ["model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=32",
             "data.seq_len=32", "data.micro_batch_size=4", "trainer.global_batch_size=4", "trainer.log_every_n_steps=1",
             "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "checkpoint.every_n_steps=100",
             "optim.warmup_steps=1", "logging.wandb.project=lmlaunch-tests", "logging.wandb.mode=offline"]


@pytest.mark.slow
def test_every_attempt_logs_into_one_wandb_run(repo, runs_root):
    def attempt(stop_at: int) -> Path:
        plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), OVERRIDES, devices=1, max_steps=6, name="wb",
                                 environ=dict(os.environ), say=lambda *_: None,
                                 resume=(runs_root / "wb").is_dir())
        run_dir = Path(plan.paths.run_dir)
        env = {**plan.env, "WANDB_SILENT": "true", "WANDB_DIR": str(run_dir)}
        with open(run_dir / "launcher.out", "a") as out:
            code = launch(plan.paths.run_dir, 1, plan_env=env, out=out, threads_per_proc=1,
                          command=[sys.executable, "-u", str(HELPER), plan.paths.run_dir, str(stop_at)])
        assert code == 0, (run_dir / "launcher.out").read_text()[-3000:]
        return run_dir

    run_dir = attempt(stop_at=3)  # stopped at step 3 (as a preemption would), checkpointed
    run_dir = attempt(stop_at=0)  # resumed to the end
    run_id = (run_dir / "wandb_id").read_text().strip()
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline), (run_id, offline)
