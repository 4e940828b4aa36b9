"""The eval task: a job spec with an ``eval`` section evaluates a checkpoint instead of training.

Rank 0 picks the checkpoint when the attempt starts (``eval.checkpoint``: a step directory, or a
run directory and then its newest complete checkpoint, so a pipeline's eval stage takes what its
train stage left), rebuilds the full weights whatever strategy wrote them (lmtrain.checkpoint.weights), and
computes the mean loss over the first ``eval.max_batches`` micro batches of the data's
validation split, the way the Trainer's validation does (the mean of the batches' mean token
losses; the validation loader is not shuffled), and the perplexity ``exp(loss)``. The result is
the ledger line ``eval`` and the attempt's ``end`` (``completed``, with the figures in its
detail), which ``status`` and ``history`` show. Other ranks have nothing to do and exit.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from lmcore.job.spec import JobSpec
from lmcore.run.checkpoint_index import (
    STEP_RE,
    CompleteCheckpoint,
    complete_checkpoints,
    is_complete,
    newest_intact,
    verify,
)
from lmcore.run.rundir import LedgerNote, RunLayout, checkpoint_dir_of

log = logging.getLogger(__name__)


class EvalError(RuntimeError):
    """The checkpoint to evaluate is not there (the message says what was looked for)."""


def pick_checkpoint(ref: str | Path) -> CompleteCheckpoint:
    """``ref``: a complete step directory, a checkpoint directory, or a run directory."""
    path = Path(ref)
    m = STEP_RE.fullmatch(path.name)
    if m and is_complete(path):
        named = next(c for c in complete_checkpoints(path.parent) if c.path.name == path.name)
        problems = verify(named.path)  # its files are the ones written (COMPLETE's checksums)
        if problems:
            raise EvalError(f"eval.checkpoint {ref} does not hold what was written: {'; '.join(problems)}")
        return named
    layout = RunLayout.of(path)
    ckpt_dir = checkpoint_dir_of(path) if layout.plan.is_file() else layout.default_checkpoints \
        if layout.default_checkpoints.is_dir() else path
    found = complete_checkpoints(ckpt_dir)
    if not found:
        raise EvalError(f"eval.checkpoint {ref}: no complete checkpoint in {ckpt_dir}")
    ckpt = newest_intact(found, lambda c, problems: log.warning(
        "%s does not hold what was written, not evaluated: %s", c.path, "; ".join(problems)))
    if ckpt is None:
        raise EvalError(f"eval.checkpoint {ref}: every complete checkpoint in {ckpt_dir} failed its checksums")
    return ckpt


def evaluate(job: JobSpec, seed: int) -> dict[str, Any]:
    """Rank 0: the figures of evaluating the checkpoint the job's ``eval.checkpoint`` names."""
    eval_spec, data_spec = job.eval, job.data
    assert eval_spec is not None and eval_spec.checkpoint is not None  # an eval job (lmtrain.task.entry)
    import torch
    from transformers import AutoModelForCausalLM

    from lmtrain.checkpoint.weights import model_state_dict
    from lmtrain.data.loader import make_dataloaders
    from lmtrain.model.causal_lm import build_config
    from lmtrain.model.module import unpack_batch

    ckpt = pick_checkpoint(eval_spec.checkpoint)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(build_config(job.model))
    missing, unexpected = model.load_state_dict(model_state_dict(ckpt.path), strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise EvalError(f"{ckpt.path} does not fit the spec's model: missing {sorted(set(missing) - tied)[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}")
    model.eval()
    _, val_loader, _ = make_dataloaders(data_spec, world_size=1, rank=0, seed=seed)
    if val_loader is None:
        raise EvalError(f"data {data_spec.path} has no validation split (data.val_fraction is 0 or too small)")
    losses: list[float] = []
    tokens = 0
    with torch.no_grad():
        for batch in val_loader:
            if len(losses) >= eval_spec.max_batches:
                break
            input_ids, labels = unpack_batch(batch)
            losses.append(float(model(input_ids, labels=labels).loss))
            tokens += int(input_ids.numel())
    loss = sum(losses) / len(losses)
    return {"checkpoint": str(ckpt.path), "step": ckpt.step, "val_loss": loss, "perplexity": math.exp(loss),
            "batches": len(losses), "tokens": tokens, "seconds": round(time.perf_counter() - t0, 3)}


def run_eval(plan: Any, env: Any, attempt: int) -> int:
    """Every rank of an eval job: rank 0 evaluates and writes the ledger; the others exit."""
    if env.rank != 0:
        return 0
    from lmtrain.observe.attempt import AttemptRecords, Outcome

    job = plan.job_spec()
    records = AttemptRecords(plan, env, attempt)
    records.start_line(0, world_size=1)
    try:
        result = evaluate(job, plan.training.seed)
    except Exception as exc:
        log.error("eval failed: %s", exc)
        records.end_line(Outcome(reason="crashed", end_step=0, detail=f"eval: {type(exc).__name__}: {exc}"[:2000]))
        return 1
    log.info("eval of %s: val_loss %.4f, perplexity %.2f over %d batches", result["checkpoint"], result["val_loss"],
             result["perplexity"], result["batches"])
    records.ledger.write(LedgerNote(event="eval", time=time.time(), fields={"attempt": attempt, **result}))
    records.end_line(Outcome(
        reason="completed", end_step=0,
        detail=f"eval of step-{result['step']}: val_loss {result['val_loss']:.4f}, perplexity "
               f"{result['perplexity']:.2f} ({result['batches']} batches, {result['checkpoint']})"))
    records.done(0)
    return 0
