"""Synthetic run directories and registry entries in the formats of docs/run-directory.md, for
the pure monitor/render/report tests (no SLURM, no training)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from launcher.runs import registry as runs
from lmcore.run.rundir import LEDGER, AttemptEnd, AttemptStart, Ledger

T0 = 1_800_000_000.0  # a fixed clock: rendered ages and times are stable


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def make_run(
    home: Path,
    name: str,
    *,
    job_ids: tuple[str, ...] = ("101",),
    max_steps: int = 100,
    attempts: list[dict] | None = None,
    step_every: int = 10,
    checkpoint_step: int | None = None,
    markers: tuple[str, ...] = (),
    log_lines: dict[int, list[str]] | None = None,
    submitted_at: float = T0,
) -> Path:
    """A run whose attempts are given as dicts {job_id, start_step, end_step, t0, t1, reason,
    requeued, nodes}; an attempt without 'reason' has no ledger end line (killed or running)."""
    run_dir = home / "runs" / name
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    env = {"LMLAUNCH_HOME": str(home)}
    runs.save_record(runs.RunRecord(name=name, profile="local", run_dir=str(run_dir), spec_path=None,
                                    job_ids=list(job_ids), submitted_at=[submitted_at] * len(job_ids),
                                    max_steps=max_steps), env)
    ledger: list[AttemptStart | AttemptEnd] = []
    beats: list[dict] = []
    for n, a in enumerate(attempts or [], start=1):
        jid, t0, t1 = a["job_id"], a["t0"], a["t1"]
        ledger.append(AttemptStart(attempt=n, job_id=jid, restart_count=a.get("restart", 0), time=t0,
                                   start_step=a["start_step"], nodes=a.get("nodes", ["n1", "n2"]), world_size=2))
        beats.append({"time": t0 + 1, "event": "start", "step": a["start_step"], "max_steps": max_steps,
                      "attempt": n, "job_id": jid, "world_size": 2})
        steps = list(range(a["start_step"] + step_every, a["end_step"] + 1, step_every))
        for i, s in enumerate(steps):
            t = t0 + 2 + (t1 - t0 - 4) * (i + 1) / max(1, len(steps))
            beats.append({"time": t, "event": "step", "step": s, "max_steps": max_steps, "loss": 5.0 - 0.02 * s,
                          "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 5000.0 + s, "mfu": 0.31 if s % 20 == 0 else 0.3,
                          "attempt": n, "job_id": jid, "world_size": 2})
        if a.get("reason"):
            ledger.append(AttemptEnd(attempt=n, job_id=jid, time=t1, end_step=a["end_step"], reason=a["reason"],
                                     detail=a.get("detail", ""), requeued=a.get("requeued", False),
                                     extra=a.get("extra", {})))
    for record in ledger:  # the runtime's own writer and records (lmcore.run.rundir)
        Ledger(run_dir / LEDGER).write(record)
    write_jsonl(run_dir / "metrics" / "heartbeat.jsonl", beats)
    if checkpoint_step is not None:
        ck = run_dir / "checkpoints" / f"step-{checkpoint_step}"
        ck.mkdir(parents=True)
        (ck / "COMPLETE").write_text("")
        os.utime(ck / "COMPLETE", (T0 - 90, T0 - 90))
        (run_dir / "checkpoints" / "latest").write_text(f"step-{checkpoint_step}\n")
    for m in markers:
        (run_dir / m).write_text("x\n")
    for n, lines in (log_lines or {}).items():
        d = run_dir / "logs" / f"attempt-{n}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "rank-0.log").write_text("".join(line + "\n" for line in lines))
    return run_dir
