"""`lmlaunch profile RUN` on the real local cluster: a running 2-node job profiles its next steps on
the ranks asked; each writes a Chrome/Perfetto trace and its top operators, and the command prints
them side by side. Bad input is refused before anything is written: a rank outside the world,
--steps 0, an unknown run, a run that is not running."""

from __future__ import annotations

import json
import re
from pathlib import Path

from preempt_helpers import SPEC, wait_step
from slurm_helpers import SMALL_MODEL, faults, pace

OVERRIDES = (
    "trainer.max_steps=100000",  # trains until the test cancels it
    "optim.warmup_steps=3",
    "trainer.val_check_interval=null",
    "trainer.log_every_n_steps=2",
    "checkpoint.every_n_steps=100000",
    *SMALL_MODEL,
)


def test_a_running_job_profiles_its_next_steps_on_the_ranks_asked(slurm_cluster, cli, lm_env, run_name, own_jobs):
    with faults(pace()):  # paced steps: it trains while the test asks, on little CPU
        r = cli("submit", str(SPEC), f"name={run_name}", *OVERRIDES)
    assert r.code == 0, r.out + r.err
    job_id = re.search(r"job (\d+)", r.out).group(1)
    own_jobs.append(job_id)
    run_dir = Path(lm_env["LMLAUNCH_RUNS_ROOT"]) / run_name
    wait_step(run_dir, 2, job_id=job_id)

    for argv, words in ((["--ranks", "2"], "--ranks: rank 2 is not a rank of this job: its ranks are 0..1"),
                        (["--steps", "0"], "--steps 0: profile 1 to 1000 steps"),
                        (["--ranks", "x"], "--ranks 'x': give global ranks as numbers")):
        bad = cli("profile", run_name, *argv)
        assert bad.code == 2 and words in bad.err, bad.err
    assert not (run_dir / "profile-request.json").exists()  # nothing half-written

    r = cli("profile", run_name, "--steps", "2", "--ranks", "0,1")
    assert r.code == 0, r.out + r.err
    assert re.search(r"rank 0 \(n1\)\s+self ms\s+rank 1 \(n2\)\s+self ms", r.out), r.out
    out_dir = next((run_dir / "logs" / "attempt-1").glob("profile-*"))
    for rank, node in ((0, "n1"), (1, "n2")):
        top = json.loads((out_dir / f"top-rank-{rank}.json").read_text())
        assert (top["rank"], top["node"], top["steps"], top["to_step"] - top["from_step"] + 1) == (rank, node, 2, 2)
        assert top["ops"] and top["ops"][0]["self_s"] >= top["ops"][-1]["self_s"] > 0
        assert any(op["name"].startswith("aten::") for op in top["ops"]), top["ops"]
        trace = json.loads((out_dir / f"trace-rank-{rank}.json").read_text())
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])

    one = cli("profile", run_name, "--steps", "1", "--ranks", "1", "--json")  # one rank, as JSON
    assert one.code == 0, one.err
    answer = json.loads(one.out)
    assert [t["rank"] for t in answer["ranks"]] == [1] and not (Path(answer["dir"]) / "top-rank-0.json").exists()

    assert cli("cancel", run_name).code == 0
    gone = cli("profile", run_name)
    assert gone.code == 2 and f"run '{run_name}' is not running" in gone.err, gone.err
    unknown = cli("profile", "no-such-run-xyz")
    assert unknown.code == 2 and "no run named or with job id 'no-such-run-xyz'" in unknown.err
