"""One checkpoint scored by lm-evaluation-harness: exported to a transformers model directory (the
export path of ``lmlaunch export``: any strategy's checkpoint, its weights gathered on one CPU
process, with the run's tokenizer), then ``lm_eval.simple_evaluate`` with lm-eval's ``hf`` model on
that directory: what ``lm_eval --model hf --model_args pretrained=DIR`` does on the command line,
so scoring by hand gives the same figures. Offline: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are
set before lm-eval is imported; a task whose data is not on disk fails instead of downloading."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.run.checkpoint_index import CompleteCheckpoint
from lmcore.run.eval_alongside import EvaluatorPlan

log = logging.getLogger("lmtrain.evaluator")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Scored:
    scores: list[dict[str, Any]]  # {task, metric, value, stderr}
    lm_eval: str
    seconds: float


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def model_args(model_dir: Path, ev: EvaluatorPlan, device: str, precision: str) -> str:
    """lm-eval's ``--model_args`` for the exported model: float32 on CPU, the run's half precision on GPUs."""
    dtype = "float32" if device == "cpu" else "bfloat16" if "bf16" in precision else \
        "float16" if precision.startswith("16") else "float32"
    args = f"pretrained={model_dir},dtype={dtype}"
    return args + (",parallelize=True" if ev.gpus > 1 else "")


def device_of(ev: EvaluatorPlan) -> str:
    if ev.gpus:
        import torch

        if torch.cuda.is_available():
            return "cuda"
        log.warning("eval.alongside has %d GPU(s) planned but torch sees none: scoring on the CPU", ev.gpus)
    return "cpu"


def metric_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """lm-eval's ``results`` ({task: {"acc,none": v, "acc_stderr,none": e, ...}}) as rows; a metric
    under a filter other than ``none`` is named ``metric,filter``."""
    rows = []
    for task in sorted(results):
        metrics = results[task]
        for key in sorted(metrics):
            if "," not in key or "_stderr," in key:
                continue
            name, filt = key.split(",", 1)
            value = metrics[key]
            if not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{name}_stderr,{filt}")
            rows.append({"task": task, "metric": name if filt == "none" else key, "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None})
    return rows


def score(plan: dict[str, Any], ckpt: CompleteCheckpoint, ev: EvaluatorPlan, include: list[str],
          work: Path) -> Scored:
    """Export ``ckpt`` under ``work`` and score it with the plan's tasks; the export is removed after."""
    os.environ.update(OFFLINE)
    from lmtrain.checkpoint.export import export_hf

    t0 = time.perf_counter()
    model_dir = work / f"model-step-{ckpt.step}"
    shutil.rmtree(model_dir, ignore_errors=True)
    try:
        export_hf(plan, ckpt, model_dir)
        import lm_eval
        from lm_eval.tasks import TaskManager

        device = device_of(ev)
        try:
            results = lm_eval.simple_evaluate(
                model="hf", model_args=model_args(model_dir, ev, device, plan["trainer"]["precision"]),
                tasks=list(ev.tasks), task_manager=TaskManager(include_path=include), device=device,
                batch_size=ev.batch_size, limit=ev.limit, log_samples=False)
        except AssertionError as exc:  # lm-eval's own checks say nothing: say what they check
            raise RuntimeError(f"lm-eval's check failed ({str(exc) or 'no message'}): most often an answer longer than the "
                               f"model's context ({_positions(model_dir)} positions), which lm-eval cannot score") from exc
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    if results is None:  # lm-eval returns None on ranks other than its first (one process here)
        raise RuntimeError("lm-eval returned no results")
    return Scored(metric_rows(results["results"]), lm_eval_version(), round(time.perf_counter() - t0, 3))


def _positions(model_dir: Path) -> str:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "?"
    return str(config.get("n_positions") or config.get("max_position_embeddings") or "?")
