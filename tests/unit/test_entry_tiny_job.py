"""The shipped tiny job trains on the shipped corpus through `lmlaunch run --local` (2 processes,
DDP on gloo, the same entry a SLURM task runs) and its loss clearly falls.

Threshold: a byte-level model starts at ln(260) = 5.56 nats; after 60 steps (global batch 16 x
128 tokens) the logged train loss and the validation loss must both be below 3.3 (measured on
2 CPU cores: about 3.0 train / 2.95 val)."""

from __future__ import annotations

import io
import json
import math

import pytest

from launcher.cli import main
from launcher.context import Context
from lmcore.run.rank_logs import rank_text
from lmcore.run.rundir import STARTUP_PHASES

THRESHOLD = 3.3
STEPS = 60


@pytest.mark.slow
def test_tiny_job_loss_falls_below_threshold_via_lmlaunch_run_local(repo, runs_root):
    if not (repo / "data" / "prepared" / "tiny" / "meta.json").exists():
        pytest.fail("data/prepared/tiny is missing: run `lmlaunch data prepare --shipped-corpus --out data/prepared/tiny`")
    out = io.StringIO()
    ctx = Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)})
    code = main(["run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", "--max-steps", str(STEPS),
                 "profile.start_step=10", "profile.steps=2", "profile.ranks=[1]"], ctx)  # the spec's profile window
    assert code == 0, out.getvalue()[-4000:]
    run_dir = runs_root / "tiny-cpu-local"
    lines = [json.loads(x) for x in (run_dir / "metrics" / "heartbeat.jsonl").read_text().splitlines()]
    steps = [d for d in lines if d["event"] == "step"]
    vals = [d for d in lines if d["event"] == "val"]
    assert steps[0]["world_size"] == 2
    assert steps[0]["loss"] > 4.5 and steps[0]["loss"] < math.log(260) + 0.5
    assert steps[-1]["step"] == STEPS and steps[-1]["loss"] < THRESHOLD, steps[-1]
    assert vals and vals[-1]["step"] == STEPS and vals[-1]["val_loss"] < THRESHOLD, vals
    assert all(d["tokens_per_s"] is None or d["tokens_per_s"] > 0 for d in steps)
    ledger = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [e["event"] for e in ledger] == ["start", "preflight", "startup", "memory", "end"] and ledger[-1]["reason"] == "completed"
    held = max(sum(r[k] for k in ("params", "grads", "optimizer")) for r in ledger[3]["held"])
    assert ledger[3]["planned"]["model_states"] == held and ledger[3]["planned"]["world_size"] == 2  # beside it
    from tests.memory_helpers import assert_states_as_planned  # what the rank held, as the plan said

    assert_states_as_planned(run_dir)
    startup = ledger[2]  # where the attempt spent its time before the first step (history --timing)
    assert list(startup["phases"]) == list(STARTUP_PHASES) and startup["checkpoint_bytes"] is None
    ends = list(startup["phases"].values())
    assert ends == sorted(ends) and 0 < ends[-1] < 600, startup
    assert abs(startup["process_start"] + ends[-1] - steps[0]["time"]) < 5, (startup, steps[0])
    assert (run_dir / "DONE").exists()
    # one log for the node, every line marked with its rank (lmcore.run.rank_logs)
    logs = run_dir / "logs" / "attempt-1"
    assert [p.name for p in logs.glob("*.log")] == ["node-0.log"]
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in (logs / "node-0.log").read_text().splitlines())
    assert rank_text(logs, 1).strip()
    # each event once, with lmtrain's prefix; third-party advice that does not apply is left out
    rank0 = rank_text(logs, 0)
    for text in (rank0, out.getvalue()):
        assert not [line for line in text.splitlines() if line.startswith("INFO: ")]  # Lightning's own handler
        assert "litlogger" not in text and "The `srun` command is available on your system" not in text
    records = [line.split(" [rank 0] ", 1)[1] for line in rank0.splitlines() if " [rank 0] " in line]
    assert records and len(records) == len(set(records)), [r for r in records if records.count(r) > 1]
    environment = json.loads((run_dir / "logs" / "attempt-1" / "environment.json").read_text())
    assert environment["packages"]["torch"] and environment["world_size"] == 2 and environment["attempt"] == 1
    assert environment["env"]["LMLAUNCH_RUN_DIR"] == str(run_dir) and len(environment["plan_sha256"]) == 64
    assert list((run_dir / "tensorboard" / "version_0").glob("events.out.tfevents.*"))
    assert "train/loss" in (run_dir / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS}"
    # the spec's profile window: rank 1 alone, steps 11-12, a trace and its top operators
    (profile,) = (run_dir / "logs" / "attempt-1").glob("profile-*")
    assert profile.name == "profile-spec-10" and sorted(p.name for p in profile.iterdir()) == [
        "top-rank-1.json", "trace-rank-1.json"]
    top = json.loads((profile / "top-rank-1.json").read_text())
    assert (top["from_step"], top["to_step"], top["rank"]) == (11, 12, 1) and top["ops"][0]["self_s"] > 0
    # operators only: no range that code names (Lightning's Optimizer.step#AdamW.step holds the whole step)
    assert not [op["name"] for op in top["ops"] if "#" in op["name"] or op["name"].startswith("ProfilerStep")]
    # every rank's step timing, a line per logging interval, in its node's file (the local launcher's
    # ranks share one node: one file; lmtrain.observe.timing_lines); nobody slow
    node = [json.loads(x) for x in (run_dir / "logs" / "attempt-1" / "timing-node-0.jsonl").read_text().splitlines()]
    assert sorted(p.name for p in (run_dir / "logs" / "attempt-1").glob("timing-*")) == ["timing-node-0.jsonl"]
    for rank in (0, 1):
        timing = [t for t in node if t["rank"] == rank]
        assert sum(t["steps"] for t in timing) == STEPS and timing[-1]["step"] == STEPS, timing
        assert all(t["node"] for t in timing)
        assert all(t["forward_s"] > 0 and t["backward_s"] > 0 and t["optimizer_s"] > 0 and t["data_s"] >= 0
                   and t["wall_s"] >= t["forward_s"] + t["backward_s"] for t in timing), timing
