"""The evaluator's process: ``python -u -m lmtrain.evaluator.main RUN_DIR``.

Alongside the training (the heterogeneous job's second component, launcher.submit.hetjob), it
loops: the run's complete checkpoints (a COMPLETE marker: lmcore.run.checkpoint_index), less those
``eval/scores.jsonl`` has, give the next to score (lmcore.run.eval_alongside.next_step: every one or
every Nth, in step order or the newest when behind); its files are checked against the checksums
it was written with, then it is exported and scored (:mod:`.harness`) and its line appended. When
the batch script has written ``eval/training-ended`` (the trainer's srun ended), the newest
checkpoint counts as the run's last, whatever its step; once nothing is left the evaluator ends.
``--once`` (``lmlaunch eval RUN``: an ordinary job on a finished run) scores what is there and ends.

What it does now is in ``eval/state.json`` (starting, waiting, scoring step N, done, failed: why),
which ``status`` shows; it never touches the training. The job's warning signal (``--signal`` is
propagated to every component) is ignored: the trainer acts on it; a preemption's SIGTERM ends
the evaluator, and the checkpoint it was scoring is not in the records, so the next attempt
scores it (once: a checkpoint's tasks are one line, lmcore.run.eval_alongside.append_scores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lmcore.atomic import write_json
from lmcore.run.checkpoint_index import complete_checkpoints, verify
from lmcore.run.eval_alongside import (
    STATE,
    TRAINING_ENDED,
    CheckpointScores,
    EvaluatorPlan,
    append_scores,
    next_step,
    read_scores,
    scored_steps,
)
from lmcore.run.run_layout import RunLayout

log = logging.getLogger("lmtrain.evaluator")
POLL_S = 2.0  # how often it looks for a new complete checkpoint while none is left to score


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lmtrain.evaluator.main")
    p.add_argument("run_dir")
    p.add_argument("--evaluator", help="a JSON file of the evaluator's plan (default: the run's plan.json's)")
    p.add_argument("--steps", help="only these checkpoint steps (comma separated)")
    p.add_argument("--once", action="store_true", help="score what is there, then end (a finished run)")
    return p.parse_args(argv)


class Evaluator:
    def __init__(self, run_dir: Path, plan: dict[str, Any], ev: EvaluatorPlan, *, once: bool,
                 steps: set[int] | None) -> None:
        self.run_dir, self.plan, self.ev, self.once, self.steps = run_dir, plan, ev, once, steps
        self.job_id = os.environ.get("SLURM_JOB_ID", "local")
        self.ckpt_dir = Path(plan["paths"]["checkpoint_dir"])
        self.passed_over: set[int] = set()  # failed their checksums, or removed before they were scored
        self.said: tuple[Any, ...] | None = None

    def state(self, state: str, step: int | None = None, detail: str = "") -> None:
        if (state, step, detail) == self.said:
            return
        self.said = (state, step, detail)
        (self.run_dir / STATE).parent.mkdir(parents=True, exist_ok=True)
        write_json(self.run_dir / STATE, {"state": state, "step": step, "detail": detail, "time": time.time(),
                                          "job_id": self.job_id, "pid": os.getpid()})

    def run(self) -> int:
        from lmtrain.evaluator.shipped import materialize

        self.state("starting", detail=f"tasks {', '.join(self.ev.tasks)}")
        include = [str(materialize(self.run_dir)), *self.ev.task_dirs]
        work = self.run_dir / "eval" / "work"
        if self.once:
            self.from_bucket()
        while True:
            ended = self.once or (self.run_dir / TRAINING_ENDED).exists()
            found = {c.step: c for c in complete_checkpoints(self.ckpt_dir)
                     if self.steps is None or c.step in self.steps}
            done = sorted(scored_steps(read_scores(self.run_dir), self.ev.tasks))
            step = next_step(found, [*done, *self.passed_over], self.ev, ended=ended)
            if step is None:
                if ended:
                    self.state("done", max(done, default=None), f"{len(done)} checkpoint(s) scored")
                    log.info("evaluator: done, %d checkpoint(s) scored", len(done))
                    return 0
                self.state("waiting", max(done, default=None), "for the next complete checkpoint")
                time.sleep(POLL_S)
                continue
            self.score(found[step], include, work)

    def from_bucket(self) -> None:
        """A finished run whose checkpoints are in a bucket (checkpoint.dir s3://): each asked step (every
        complete one there, without --steps) that the disk lacks downloaded into the run's checkpoint
        directory, verified (lmcore.run.bucket_fetch); one that cannot be is said and left unscored."""
        paths = self.plan.get("paths") or {}
        if not paths.get("checkpoint_store"):
            return
        from lmcore.errors import UserError
        from lmcore.objects.checkpoints import ObjectStoreError
        from lmcore.run.bucket_fetch import complete_steps, fetch

        try:
            there = complete_steps(paths["checkpoint_store"], paths.get("checkpoint_store_credentials") or "")
        except (ObjectStoreError, UserError, OSError) as exc:  # a credentials file refused: UserError
            log.error("evaluator: cannot list %s (%s): only this disk's checkpoints are scored",
                      paths["checkpoint_store"], exc)
            return
        local = {c.step for c in complete_checkpoints(self.ckpt_dir)}
        for step in sorted(s for s in there if s not in local and (self.steps is None or s in self.steps)):
            self.state("downloading", step, str(paths["checkpoint_store"]))
            got = fetch(paths["checkpoint_store"], paths.get("checkpoint_store_credentials") or "", self.ckpt_dir, step=step)
            (log.error if got.problem else log.info)("evaluator: %s", got.said)

    def score(self, ckpt: Any, include: list[str], work: Path) -> None:
        from lmtrain.evaluator.harness import score

        problems = verify(ckpt.path)
        if problems:
            log.error("evaluator: %s does not hold what was written, not scored: %s", ckpt.path, "; ".join(problems))
            self.passed_over.add(ckpt.step)
            return
        self.state("scoring", ckpt.step, str(ckpt.path))
        log.info("evaluator: scoring %s", ckpt.path)
        try:
            scored = score(self.plan, ckpt, self.ev, include, work)
        except Exception:
            if not ckpt.path.is_dir():  # retention removed it meanwhile (behind: newest): a newer one is there
                log.warning("evaluator: %s was removed before it was scored", ckpt.path)
                self.passed_over.add(ckpt.step)
                return
            raise
        append_scores(self.run_dir, CheckpointScores(
            step=ckpt.step, checkpoint=str(ckpt.path), time=time.time(), job_id=self.job_id, lm_eval=scored.lm_eval,
            seconds=scored.seconds, scores=tuple(scored.scores), tasks=tuple(self.ev.tasks)))
        self.state("scored", ckpt.step, str(ckpt.path))  # a rename: status's cache sees eval/ change
        log.info("evaluator: step %d scored in %.1f s: %s", ckpt.step, scored.seconds,
                 ", ".join(f"{s['task']}/{s['metric']} {s['value']:.4g}" for s in scored.scores))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    run_dir = Path(args.run_dir)
    plan = json.loads(RunLayout.of(run_dir).plan.read_text())
    source = json.loads(Path(args.evaluator).read_text()) if args.evaluator else plan.get("evaluator")
    if not source:
        print(f"evaluator: {run_dir} plans no evaluator (eval.alongside) and none was given", file=sys.stderr)
        return 2
    ev = EvaluatorPlan.from_json(source)
    warning = plan.get("preemption", {}).get("signal")
    if warning:  # the trainer's to act on; its default action would end this process
        signal.signal(getattr(signal, f"SIG{warning}"), signal.SIG_IGN)
    steps = {int(s) for s in args.steps.split(",")} if args.steps else None
    evaluator = Evaluator(run_dir, plan, ev, once=args.once, steps=steps)
    try:
        return evaluator.run()
    except Exception as exc:
        log.exception("evaluator: failed")
        evaluator.state("failed", evaluator.said[1] if evaluator.said else None, f"{type(exc).__name__}: {exc}"[:2000])
        return 1


if __name__ == "__main__":
    sys.exit(main())
