"""What each task of a submitted plan sees, with a trivial callable in place of training:
two tasks on n1 and n2 launched by srun, the planned variables exported, accounting states."""

from __future__ import annotations

import sys
from pathlib import Path

from slurm_helpers import REPO, wait_accounted, wait_terminal
from submitit.helpers import CommandFunction

from launcher.planning.resolve import resolve
from launcher.runs import registry as runs
from launcher.submit.submission import _submit_with_submitit


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k] = v
    return out


def test_two_tasks_run_on_n1_and_n2_with_the_planned_environment(slurm_cluster, lm_env, run_name, own_jobs):
    plan = resolve(str(REPO / "jobs" / "tiny-cpu.yaml"), [f"name={run_name}"], environ=lm_env, python=sys.executable).plan
    run_dir = Path(plan.paths.run_dir)
    runs.prepare_run_dir(run_dir)
    runs.write_launch_files(plan)
    dump = CommandFunction(["bash", "-c", 'env > "$LMLAUNCH_RUN_DIR/env-$SLURM_PROCID.txt"; echo "$SLURMD_NODENAME"'])
    job_id = _submit_with_submitit(plan, dump)
    own_jobs.append(job_id)

    assert wait_terminal(job_id) == "COMPLETED"
    assert wait_accounted(job_id).state == "COMPLETED"
    envs = [_env_file(run_dir / f"env-{rank}.txt") for rank in (0, 1)]
    assert [e["SLURMD_NODENAME"] for e in envs] == ["n1", "n2"]
    for rank, e in enumerate(envs):
        assert e["SLURM_PROCID"] == str(rank) and e["SLURM_NODEID"] == str(rank)
        assert e["SLURM_NTASKS"] == "2" and e["SLURM_NNODES"] == "2"
        assert e["SLURM_JOB_NAME"] == run_name and e["SLURM_JOB_ID"] == job_id
        assert e["SLURM_JOB_NODELIST"] == "n[1-2]"
        for name, value in plan.env.items():
            assert e.get(name) == value, f"rank {rank}: {name}={e.get(name)!r}, planned {value!r}"
    # the private submitit folder: task 0's result (the only one written), srun's output a file per node,
    # each line marked with its task, and no file per task
    sub = run_dir / "submitit"
    assert (sub / f"{job_id}_0_result.pkl").exists() and not (sub / f"{job_id}_1_result.pkl").exists()
    for node in (0, 1):
        lines = (sub / f"{job_id}_node-{node}_log.out").read_text().splitlines()
        assert lines and all(line.startswith(f"{node}: ") for line in lines), lines  # task N runs on node N here
    assert not list(sub.glob(f"{job_id}_1_log.*"))
