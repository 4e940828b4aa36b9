"""bench/gpu_report.py turns what a device call brought back into bench/RESULTS.md's GPU section:
every figure of the GPU goals' table against its goal, "not measured" (with the reason the run gave)
where the run did not produce it, never a guess."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_report


def _out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    (out / "profile").mkdir(parents=True)
    (out / "device.txt").write_text("GPU 0: NVIDIA H200 (UUID: GPU-x)\n3.12.3 2.11.0+cu130 2.6.6 5.24.0 0.19.8\n")
    lines = [
        {"bench": "throughput", "config": "gpt2-124m", "date": "2026-12-01T10:00:00+00:00", "ratio": 1.012,
         "ratio_pairs": [1.01, 1.02, 0.99], "tokens_per_s_a": 356800.0, "tokens_per_s_b": 361000.0,
         "b": {"host_syncs": {"total": 3, "non_logging_steps": 1, "where": {"module.py:40 training_step": 1}}}},
        {"bench": "throughput", "config": "fsdp", "date": "2026-12-01T10:03:00+00:00", "ratio": 0.81,
         "ratio_pairs": [0.8, 0.81, 0.83], "tokens_per_s_a": 300000.0, "tokens_per_s_b": 243000.0},
        {"bench": "throughput", "config": "zero2", "error": "exit code 1"},
    ]
    (out / "throughput.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "{not json\n")
    (out / "ckpt.jsonl").write_text(json.dumps({"bench": "checkpoint_speed", "config": "llama-1b", "held_s": 1.4,
                                                "save_s": 16.0, "dd_s": 15.3, "checkpoint_bytes": 15.4e9}) + "\n")
    (out / "profile" / "top-fsdp.json").write_text("{}")
    logs = {"gpu-tests.log": "tests/gpu/test_x.py::test_a PASSED\n==== 9 passed in 120.00s ====\n",
            "tp-llama.log": "step 3\nKilled at the cap of 110 s\n"}
    with tarfile.open(out / "logs-lease.tgz", "w:gz") as tar:
        for name, text in logs.items():
            data = text.encode()
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_every_figure_against_its_goal_and_what_is_missing_said(tmp_path):
    text = gpu_report.section(_out(tmp_path), "abc1234")
    assert text.startswith("## GPU: GPU 0: NVIDIA H200 (UUID: GPU-x) (measured 2026-12-01, commit abc1234")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "**1.012**" in rows["GPT-2 124M, project path / compiled hand loop"]
    assert rows["GPT-2 124M, project path / compiled hand loop"].endswith("| met |")
    assert rows["FSDP2 / DDP, GPT-2 124M"].endswith("| **not met** |")
    assert "not measured (exit code 1)" in rows["ZeRO-2 / DDP, GPT-2 124M"]
    assert "not measured (Killed at the cap of 110 s)" in rows["Llama 1.1B, project path / compiled hand loop"]
    syncs = rows["host syncs on non-logging steps (GPT-2, project path)"]
    assert "**1** of 3" in syncs and "module.py:40 training_step" in syncs and syncs.endswith("| **not met** |")
    assert rows["1B ZeRO-2 stop checkpoint, training held"].endswith("| met |")
    assert "**1.05x**" in rows["1B ZeRO-2 stop checkpoint, durable / dd"]
    assert rows["GPU tests (`pytest -m gpu tests/gpu`)"].endswith("| met |")
    assert "`bench/gpu-profiles/top-fsdp.json`" in text


def test_appends_to_results_and_keeps_the_profiles(tmp_path):
    out = _out(tmp_path)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    assert gpu_report.main([str(out), "--commit", "abc1234", "--append", str(results),
                            "--profiles-to", str(tmp_path / "profiles")]) == 0
    assert results.read_text().startswith("# Results\n\n## GPU: ")
    assert (tmp_path / "profiles" / "top-fsdp.json").is_file()


def test_the_sync_ledger_files_a_logging_steps_syncs_under_it_though_they_come_after_the_probes_batch_end():
    """Lightning runs a callback's on_train_batch_end before the module's, and its logger reads the
    logged values after both: the H200 run of 0b47bf8 filed the logging step's 12 syncs under the
    step after it and reported 60 syncs on non-logging steps where there were none."""
    from throughput import SyncLedger

    ledger = SyncLedger()
    for step in range(1, 21):  # logging every 10 steps, as the GPT-2 bench does
        ledger.batch_start()
        if step == 7:
            ledger.sync("forward of step 7")  # a real sync on a non-logging step
        ledger.batch_end(step, logging=step % 10 == 0)  # the probe's hook
        if step % 10 == 0:  # then the module's hook and Lightning's logger connector
            ledger.sync("module.py _log_step_metrics")
            ledger.sync("logger_connector.py to_item")
    ledger.batch_start()
    ledger.sync("forward of step 21")
    ledger.batch_end(21, logging=False)  # the window ends at the probe's hook of its last step
    summary = ledger.summary()
    assert summary["total"] == 6
    assert summary["non_logging_steps"] == 2
    assert summary["where"] == {"forward of step 7": 1, "forward of step 21": 1}


def test_a_test_log_cut_before_its_summary_is_counted_test_by_test():
    _test_counts = gpu_report._test_counts

    log = ("3 workers [4 items]\n\ntests/gpu/t.py::test_a \n[gw0] PASSED tests/gpu/t.py::test_a \n"
           "[gw1] FAILED tests/gpu/t.py::test_b[ddp] \n[gw1] FAILED tests/gpu/t.py::test_b[ddp] \n"
           "tests/gpu/t.py::test_c PASSED\n")
    assert _test_counts(log) == "2 passed, 1 failed, 1 not reached (cut before pytest's summary); failed: test_b[ddp]"
    assert _test_counts("nothing ran\n") is None
