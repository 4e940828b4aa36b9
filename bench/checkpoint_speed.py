"""Checkpoint speed of the project's path: stop request -> checkpoint complete, and resume -> first step.

For each configuration (one process each):

1. The project's path (``lmtrain.task.entry.run_task`` on a run directory planned like
   ``lmlaunch run --local [--gpus]`` plans it, in this process, one rank) trains ``stop_after``
   steps; right after that step boundary the process sends itself SIGTERM, exactly what SLURM
   sends on preemption. lmtrain's handler records it, every rank agrees to stop at the next step
   boundary, the collective ``CheckpointManager.save`` writes the checkpoint with optimizer state
   (tmp dir, fsync, rename, COMPLETE marker), and the attempt ends ``preempted``.
   ``stop_to_complete_s`` is what the attempts ledger records as ``checkpoint_seconds``: from the
   signal to the checkpoint marked complete. Because the signal arrives just after a boundary,
   it includes one whole training step (the worst case) before the save; ``save_s`` is the save
   alone to COMPLETE (the heartbeat's ``checkpoint`` event), ``held_s`` what of it held training
   (the stop's save is staged: the copy into pinned host memory; goal <= 2 s for the 1B shape).
   The baseline: the same bytes written by ``dd conv=fsync`` to the same directory right after
   (``dd_s``; ``save_vs_dd`` and ``stop_to_complete_vs_dd`` are the save and the stop as multiples
   of it: the goal is at most 1.1x).
2. A fresh Python process (as a requeued task would be) runs the same entry on the same run
   directory: it resumes from the newest complete checkpoint and trains one step.
   ``resume_to_first_step_s`` runs from that process's start (interpreter and imports included)
   to the end of its first optimizer step (CUDA synchronized); ``resume_import_s`` is the import
   part. SLURM queueing time is not included. torch.compile's on-disk cache of the first process
   is warm, as it is when a job is requeued onto the same node.

    python bench/checkpoint_speed.py --smoke                  # tiny GPT-2 on CPU
    python bench/checkpoint_speed.py --config gpt2-124m       # needs CUDA
    python bench/checkpoint_speed.py --config llama-1b --no-resume   # the stop checkpoint only
    python bench/checkpoint_speed.py --config all --out bench/checkpoint_speed.jsonl

One JSON line per configuration.
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()  # before the heavy imports (the resume child reports it)

import argparse
import datetime as _dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp

from lmtrain.distributed.task_env import free_port


@dataclass(frozen=True)
class CkptConfig:
    name: str
    description: str
    base: tp.BenchConfig  # spec and overrides of a throughput configuration
    extra: tuple[str, ...]
    stop_after: int  # steps trained before the stop request


CONFIGS: dict[str, CkptConfig] = {
    c.name: c
    for c in (
        CkptConfig("gpt2-124m", "GPT-2 124M, DDP (1 GPU), bf16-mixed, compile, AdamW state in the checkpoint",
                   tp.CONFIGS["gpt2-124m"], (), stop_after=5),
        CkptConfig("llama-1b", "Llama ~1.1B, DeepSpeed ZeRO-2 (1 GPU) as jobs/llama-1b-zero2.yaml, bf16-mixed, "
                   "optimizer state in the checkpoint",
                   tp.CONFIGS["llama-1b"],
                   ("trainer.strategy=deepspeed", "trainer.zero_stage=2", "model.compile=false"), stop_after=5),
        CkptConfig("llama-1b-ddp", "Llama ~1.1B, DDP (1 GPU), bf16-mixed, compile, AdamW state in the checkpoint",
                   tp.CONFIGS["llama-1b"], (), stop_after=5),
        CkptConfig("smoke", "CPU smoke: tiny GPT-2, DDP on gloo, 32-true (not a performance figure)",
                   tp.CONFIGS["smoke"], (), stop_after=3),
    )
}
GPU_CONFIGS = ("gpt2-124m", "llama-1b", "llama-1b-ddp")


def _jsonl(path: str | Path) -> list[dict[str, Any]]:
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return out


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def stop_and_checkpoint(plan, stop_after: int) -> dict[str, Any]:
    """Train, SIGTERM this process after step ``stop_after``, let lmtrain checkpoint and stop."""
    sent: dict[str, float] = {}

    def on_step(step: int) -> None:
        if step == stop_after and "at" not in sent:
            sent["at"] = time.time()
            os.kill(os.getpid(), signal.SIGTERM)  # what SLURM sends on preemption

    probe = tp._probe_class()(None, None, on_step=on_step)
    tp.run_project_path(plan.paths.run_dir, probe)
    if "at" not in sent:
        raise RuntimeError(f"training ended before step {stop_after}: no stop was requested")
    ends = [e for e in _jsonl(plan.paths.ledger) if e.get("event") == "end"]
    ckpts = [e for e in _jsonl(plan.paths.heartbeat) if e.get("event") == "checkpoint"]
    if not ends or ends[-1].get("reason") != "preempted" or "checkpoint_seconds" not in ends[-1]:
        raise RuntimeError(f"the attempt did not end with a preemption checkpoint: ledger end {ends[-1:]}")
    end, ck = ends[-1], ckpts[-1]
    del probe
    tp.free_memory()
    return {
        "reason": end["reason"], "signal_step": stop_after, "checkpoint_step": ck["step"],
        "stop_to_complete_s": float(end["checkpoint_seconds"]), "save_s": float(ck["seconds"]),
        # the stop's save is staged (checkpoint.async_save): training held for the copy into host memory
        "held_s": float(ck.get("blocked_s", ck["seconds"])), "ledger_held_s": end.get("checkpoint_held_s"),
        "checkpoint_bytes": _tree_bytes(Path(ck["path"])), "checkpoint_path": ck["path"],
    }


def resume_in_new_process(run_dir: str, out: Path) -> dict[str, Any]:
    """Start ``--resume-child`` (a new interpreter, like a requeued task) and read its report."""
    env = {**os.environ, "LMTRAIN_JOB_ID": f"bench-{os.getpid()}-resume", "MASTER_PORT": str(free_port("127.0.0.1")),
           "WORLD_SIZE": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--resume-child", run_dir, "--child-report", str(out)]
    started = time.time()
    code = subprocess.call(cmd, env=env)
    if code != 0 or not out.exists():
        raise RuntimeError(f"the resuming process failed with exit code {code}: {' '.join(cmd)}")
    child = json.loads(out.read_text())
    starts = [e for e in _jsonl(Path(run_dir) / "metrics" / "heartbeat.jsonl") if e.get("event") == "start"]
    return {
        "resume_to_first_step_s": child["first_step_done_at"] - started,
        "resume_import_s": child["imported_at"] - child["process_start"],
        "resume_interpreter_start_s": child["process_start"] - started,
        "resume_start_step": starts[-1]["step"] if starts else None,
        "resume_first_step": child["first_step"],
    }


def resume_child(run_dir: str, report: Path) -> int:
    """The resuming process: the project's entry on ``run_dir``; report when its first step ended."""
    import lightning  # noqa: F401  (counted in the import time, as in a real task)
    import torch  # noqa: F401

    import lmtrain.task.entry  # noqa: F401

    imported_at = time.time()
    probe = tp._probe_class()(None, None)
    tp.run_project_path(run_dir, probe)
    report.write_text(json.dumps({
        "process_start": _PROCESS_START, "imported_at": imported_at,
        "first_step_done_at": probe.first_step_done_at, "first_step": probe.first_step,
    }))
    return 0


def dd_baseline(directory: Path, nbytes: int) -> dict[str, Any]:
    """The same bytes written by ``dd conv=fsync`` to the same directory (the disk's own speed for a
    checkpoint's size): seconds, and the save and the stop-to-complete as multiples of it."""
    block = 1 << 20
    count = max(1, -(-nbytes // block))
    target = directory / ".dd-baseline"
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "conv=fsync",
                    "status=none"], check=True)
    seconds = time.perf_counter() - started
    target.unlink()
    return {"dd_bytes": count * block, "dd_s": seconds}


def run_config(cfg: CkptConfig, *, work: Path, threads: int, stop_after: int, resume: bool = True) -> dict[str, Any]:
    import torch

    base = cfg.base
    if base.gpu and not torch.cuda.is_available():
        raise SystemExit(f"configuration {cfg.name} needs a CUDA GPU (none here); on CPU run --smoke")
    if not base.gpu:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    tp.set_single_rank_env(f"bench-{os.getpid()}")
    data = tp.ensure_data()
    # max_steps = the stop step + 1 more for the resumed process: it trains exactly one step.
    plan = tp.make_run(base, work / "runs", f"ckpt-{cfg.name}", cfg.extra, stop_after + 2, data)
    env_applied = tp.apply_plan_env(plan) if base.gpu else []
    stop = stop_and_checkpoint(plan, stop_after)
    dd = dd_baseline(Path(stop["checkpoint_path"]).parent, stop["checkpoint_bytes"])
    dd["save_vs_dd"] = stop["save_s"] / dd["dd_s"]
    dd["stop_to_complete_vs_dd"] = stop["stop_to_complete_s"] / dd["dd_s"]
    resumed = resume_in_new_process(plan.paths.run_dir, work / "resume-report.json") if resume else {}
    facts = tp.model_facts(plan.spec["model"], int(plan.spec["data"]["seq_len"]))
    t = plan.trainer
    return {
        "bench": "checkpoint_speed", "config": cfg.name, "description": cfg.description,
        "mode": "gpu" if base.gpu else "cpu-smoke",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": tp.device_name(), **tp.versions(),
        "model_type": facts["model_type"], "n_params": facts["n_params"],
        "strategy": plan.parallelism.strategy, "zero_stage": plan.parallelism.zero_stage,
        "precision": t.precision, "compile": bool(plan.spec["model"].get("compile")),
        "micro_batch_size": plan.topology.micro_batch_size, "seq_len": int(plan.spec["data"]["seq_len"]),
        "stop_signal": "SIGTERM", "plan_env_applied": env_applied, **stop, **dd, **resumed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help=f"one of {', '.join(CONFIGS)}, or 'all' (the GPU ones)")
    p.add_argument("--smoke", action="store_true", help="the tiny CPU configuration (same as --config smoke)")
    p.add_argument("--stop-after", type=int, default=None, help="steps before the stop request (default: the config's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--no-resume", action="store_true", help="measure the stop checkpoint only (no resume process)")
    p.add_argument("--resume-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-report", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resume_child:
        return resume_child(args.resume_child, args.child_report)
    name = "smoke" if args.smoke and args.config is None else args.config
    if name is None:
        p.error("give --smoke or --config NAME")
    if name == "all":
        failed = 0
        for n in GPU_CONFIGS:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--config", n]
            cmd += ["--out", str(args.out)] if args.out is not None else []
            print(f"== {' '.join(cmd)}", file=sys.stderr, flush=True)
            if subprocess.call(cmd) != 0:
                failed += 1
                tp.emit({"bench": "checkpoint_speed", "config": n, "error": "failed"}, args.out)
        return 1 if failed else 0
    if name not in CONFIGS:
        p.error(f"unknown --config {name!r}; choose from {', '.join(CONFIGS)}, all")
    cfg = CONFIGS[name]
    stop_after = args.stop_after if args.stop_after is not None else cfg.stop_after
    if stop_after < 1:
        p.error("--stop-after must be >= 1")
    work = Path(tempfile.mkdtemp(prefix=f"lmbench-ckpt-{name}-"))
    try:
        line = run_config(cfg, work=work, threads=args.threads, stop_after=stop_after, resume=not args.no_resume)
    finally:
        if args.keep:
            print(f"run directories kept under {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    tp.emit(line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
