"""The compiled training step (``model.compile: true``: each block compiled in place, and the loss)
has no graph break and compiles nothing twice over 20 steps of 2 DDP ranks, validation included:
counted by dynamo itself (``TORCH_LOGS=graph_breaks,recompiles``) in every rank's output.
bench/graph_breaks.py prints the same for GPT-2 and Llama, DDP and FSDP2, with the reasons."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from launcher.submit.local_run import prepare_local_run
from lmtrain.local.launch import launch

pytestmark = pytest.mark.slow


def _dynamo_events(text: str) -> tuple[list[str], list[str]]:
    """Graph breaks (where) and recompiles (which function, the guard that failed), each once."""
    lines = list(dict.fromkeys(text.splitlines()))  # a rank's line may reach two logs
    breaks = [line for line in lines if re.search(r"\] Graph break ", line)]
    recompiles = []
    for i, line in enumerate(lines):
        if m := re.search(r"Recompiling function (\S+) in (\S+)", line):
            guard = next((g.split(": ", 1)[-1] for g in lines[i + 1:i + 6] if re.search(r"\]\s+- \d+/\d+: ", g)), "?")
            recompiles.append(f"{m.group(1)} ({Path(m.group(2)).name}): {guard.strip()}")
    return breaks, recompiles


def test_the_compiled_step_has_no_graph_break_and_no_recompile_over_20_steps(repo, runs_root, monkeypatch):
    # dynamo reads TORCH_LOGS when torch is imported: the ranks import it themselves (no zygote that
    # imported it before the variable was set)
    monkeypatch.setenv("LMTRAIN_ZYGOTE", "off")
    plan = prepare_local_run(
        str(repo / "jobs" / "tiny-cpu.yaml"), ["model.compile=true", "trainer.val_check_interval=10"],
        devices=2, max_steps=20, name="compiled-step", environ=dict(os.environ), say=lambda *_: None,
    )
    run_dir = Path(plan.paths.run_dir)
    with open(run_dir / "launcher.out", "w") as out:
        code = launch(plan.paths.run_dir, 2, plan_env={**plan.env, "TORCH_LOGS": "dynamo,graph_breaks,recompiles"},
                      threads_per_proc=1, out=out)
    text = "\n".join(p.read_text(errors="replace") for p in [run_dir / "launcher.out", *run_dir.rglob("rank-*.out")])
    assert code == 0, text[-3000:]
    breaks, recompiles = _dynamo_events(text)
    assert breaks == [], breaks
    assert recompiles == [], recompiles
    # dynamo's own account of what it traced, per rank: the block and the loss, each exactly once
    # (the positive control that its logs reached us; a second trace of one would be a recompile)
    for rank in (0, 1):
        traced = re.findall(rf"\[rank{rank}\].*torchdynamo start tracing (\w+)", "\n".join(dict.fromkeys(text.splitlines())))
        assert sorted(traced) == ["ForCausalLMLoss", "forward_with_checkpointing"], (rank, traced)
    # validation ran inside the 20 steps (and the sanity check before them), eagerly: the reason a
    # compiled function would otherwise be compiled again (dynamo's guard on grad_mode)
    ledger = (run_dir / "metrics" / "heartbeat.jsonl").read_text()
    assert '"val"' in ledger or "val_loss" in ledger, ledger[-2000:]
