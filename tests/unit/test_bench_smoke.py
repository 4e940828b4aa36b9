"""The GPU benchmarks run end to end in their CPU smoke mode (tiny GPT-2, 32-true, 1 thread).

Each bench runs as its own process, exactly as a user starts it, and its JSON line is checked
field by field: the figures are CPU smoke timings, so only their sanity is pinned (positive,
finite, consistent with each other), never their size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _bench_lines(script: str, tmp_path: Path, *args: str) -> list[dict]:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--smoke", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = []
    for text in proc.stdout.splitlines():
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "bench" in obj:
                lines.append(obj)
    assert lines, f"{script} printed no JSON line:\n{proc.stdout[-3000:]}"
    return lines


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_throughput_smoke_compares_handwritten_loop_and_project_path_on_identical_batches(tmp_path):
    (line,) = _bench_lines("throughput.py", tmp_path, "--out", str(tmp_path / "tp.jsonl"))
    for key in (
        "config", "mode", "date", "command", "device", "torch", "lightning", "transformers", "data", "model_type",
        "n_params", "matmul_params", "n_layer", "hidden_size", "flops_per_token", "seq_len", "micro_batch_size",
        "tokens_per_step", "precision", "warmup_steps", "timed_steps", "flops_formula", "peak_flops",
        "a_name", "b_name", "tokens_per_s_a", "tokens_per_s_b", "mfu_a", "mfu_b", "ratio", "a", "b",
    ):
        assert key in line, f"missing {key}"
    assert line["bench"] == "throughput" and line["config"] == "smoke" and line["mode"] == "cpu-smoke"
    assert line["device"].startswith("cpu") and line["precision"] == "32-true"
    assert line["a_name"].startswith("hand-written loop") and line["b_name"] == "project path (ddp)"
    assert _positive(line["tokens_per_s_a"]) and _positive(line["tokens_per_s_b"])
    assert line["ratio"] == pytest.approx(line["tokens_per_s_b"] / line["tokens_per_s_a"], rel=1e-12)  # 1 round
    assert line["ratio_pairs"] == [pytest.approx(line["ratio"], rel=1e-12)]
    assert line["b"]["host_syncs"] is None  # counted on CUDA only (set_sync_debug_mode): nothing waits on a CPU
    # No peak FLOP/s is known for a CPU: MFU is null, never a guess.
    assert line["peak_flops"] is None and line["mfu_a"] is None and line["mfu_b"] is None
    assert "6*N + 12*L*H*T" in line["flops_formula"]
    n, L, H, T = line["matmul_params"], line["n_layer"], line["hidden_size"], line["seq_len"]
    assert line["flops_per_token"] == 6 * n + 12 * L * H * T
    assert 0 < n < line["n_params"]  # position embeddings are lookups, not matmuls
    for side in (line["a"], line["b"]):
        assert side["tokens"] == line["timed_steps"] * line["tokens_per_step"]
        assert _positive(side["seconds"])
        assert side["tokens_per_s"] == pytest.approx(side["tokens"] / side["seconds"])
        assert math.isfinite(side["loss_first"]) and math.isfinite(side["loss_last"])
    # Same initial weights, same batches, same optimizer: the first timed step has the same loss.
    assert line["a"]["loss_first"] == pytest.approx(line["b"]["loss_first"], rel=1e-4)
    assert line["a"]["optimizer"] == "AdamW(foreach=True)" and line["a"]["compile"] is False
    # --out got the same line.
    assert json.loads((tmp_path / "tp.jsonl").read_text().splitlines()[-1]) == line


def test_checkpoint_speed_smoke_stops_on_sigterm_checkpoints_and_resumes_in_a_new_process(tmp_path):
    (line,) = _bench_lines("checkpoint_speed.py", tmp_path)
    for key in (
        "config", "mode", "device", "torch", "model_type", "n_params", "strategy", "precision", "stop_signal",
        "reason", "signal_step", "checkpoint_step", "stop_to_complete_s", "save_s", "checkpoint_bytes",
        "resume_to_first_step_s", "resume_import_s", "resume_start_step", "resume_first_step",
    ):
        assert key in line, f"missing {key}"
    assert line["bench"] == "checkpoint_speed" and line["mode"] == "cpu-smoke"
    assert line["stop_signal"] == "SIGTERM" and line["reason"] == "preempted"
    # The stop is agreed at the first step boundary after the signal, and the checkpoint is of that step.
    assert line["checkpoint_step"] == line["signal_step"] + 1
    assert _positive(line["save_s"]) and line["stop_to_complete_s"] >= line["save_s"]
    # the stop's save is staged: what held training is part of the save, the ledger says the same
    assert 0 < line["held_s"] <= line["save_s"] and line["ledger_held_s"] == pytest.approx(line["held_s"], abs=0.002)
    assert line["checkpoint_bytes"] > 4 * line["n_params"]  # weights + AdamW moments at least
    assert line["dd_bytes"] >= line["checkpoint_bytes"] and _positive(line["dd_s"])  # the dd baseline, same bytes
    assert line["save_vs_dd"] == pytest.approx(line["save_s"] / line["dd_s"], rel=1e-12)
    # The new process resumed from that checkpoint and trained the next step.
    assert line["resume_start_step"] == line["checkpoint_step"]
    assert line["resume_first_step"] == line["checkpoint_step"] + 1
    assert _positive(line["resume_import_s"]) and line["resume_to_first_step_s"] > line["resume_import_s"]
    assert not list(tmp_path.glob("lmbench-*")), "the bench left its run directories behind"


def test_step_overhead_smoke_times_the_three_paths_and_the_stop_agreement(tmp_path):
    (line,) = _bench_lines("step_overhead.py", tmp_path)
    per_step = line["ms_per_step"]
    assert set(per_step) == {"handwritten", "lightning", "project"}
    assert all(math.isfinite(v) and 0 < v < 10_000 for v in per_step.values()), per_step
    assert line["overhead_over_lightning_ms"] == pytest.approx(per_step["project"] - per_step["lightning"], abs=1e-3)
    assert line["overhead_over_handwritten_ms"] == pytest.approx(per_step["project"] - per_step["handwritten"], abs=1e-3)
    assert 0 < line["stop_agreement_ms_per_step"] < 1000
    assert isinstance(line["meets_goal"], bool) and line["mode"].startswith("smoke")


@pytest.mark.parametrize("config, strategy", [("smoke-deepspeed", "deepspeed"), ("smoke-fsdp", "fsdp")])
def test_throughput_project_against_project_configurations_run_their_smoke(tmp_path, config, strategy):
    """The GPU configurations that compare two strategies of the project path (ZeRO-k and FSDP2
    against DDP), in their CPU smoke: both sides train the timed steps in one process, twice (ABBA:
    a second DeepSpeed engine in one process once failed on the first's destroyed groups)."""
    (line,) = _bench_lines("throughput.py", tmp_path, "--config", config, "--repeat", "2", "--steps", "3")
    assert line["config"] == config and line["mode"] == "cpu-smoke" and len(line["ratio_pairs"]) == 2
    assert line["a"]["strategy"] == "ddp" and line["b_strategy"] == strategy
    assert _positive(line["tokens_per_s_a"]) and _positive(line["tokens_per_s_b"]) and _positive(line["ratio"])
