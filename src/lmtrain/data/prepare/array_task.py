"""One task of a preparation on the cluster (``lmlaunch data prepare --on-cluster``), or its final step.

usage: python -m lmtrain.data.prepare.array_task RUN_DIR TASK        (TASK: the SLURM array task id)
       python -m lmtrain.data.prepare.array_task RUN_DIR --assemble

``RUN_DIR/preparation.json`` (launcher.submit.data_cluster writes it) holds the preparation
(lmtrain.data.prepare.build.Preparation), the output directory, the staging directory the shards are written
into (``OUT.partial``) and each task's slice of the input files. Task K writes the shards of its
slice; a shard already finished (by an earlier attempt of the task, before a preemption or a
failure) is kept as it is, so a requeued task redoes only what it had not finished. The final
step (after the whole array succeeded) writes the index, removes what killed attempts left behind
(temporary shard files) and renames the staging directory to the output: the same files, byte
for byte, as ``data prepare`` writes locally for the same inputs.

Progress goes to the run's heartbeat (``metrics/heartbeat.jsonl``: shards finished of all,
documents, tokens, tokens/s), which ``lmlaunch status`` shows; each task logs to
``logs/attempt-<N>/rank-<K>.log`` (N: the task's SLURM restart count + 1; the final step is rank
"assemble"), which ``lmlaunch logs RUN --rank K`` shows.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from lmcore.run.rundir import Heartbeat, RunLayout
from lmtrain import faults

log = logging.getLogger("lmtrain.data.prepare.build")


def _logging(run_dir: Path, attempt: int, rank: str) -> None:
    path = RunLayout.of(run_dir).rank_log(attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [task {rank}] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.addHandler(logging.StreamHandler(sys.stderr))
    root.setLevel(logging.INFO)


def _finished_shards(staging: Path) -> tuple[int, int, int]:
    """(shards finished, their documents, their tokens) of every task, from the shards' records."""
    n = docs = tokens = 0
    for p in (staging / "shards").glob("*.json"):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        n, docs, tokens = n + 1, docs + int(r.get("documents", 0)), tokens + int(r.get("tokens", 0))
    return n, docs, tokens


def run_task(run_dir: Path, task: int) -> int:
    from lmtrain.data.prepare.build import DataError, Preparation, write_shards

    cfg = json.loads(RunLayout.of(run_dir).preparation.read_text())
    prep, staging = Preparation.from_json(cfg["preparation"]), Path(cfg["staging"])
    lo, hi = cfg["slices"][task]
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1
    _logging(run_dir, attempt, str(task))
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    beat = Heartbeat(RunLayout.of(run_dir).heartbeat, attempt=attempt, job_id=job, world_size=len(cfg["slices"]))
    jobs = prep.jobs()[lo:hi]
    log.info("task %d, attempt %d: input files %d..%d of %d (%s)", task, attempt, lo, hi - 1, len(prep.files),
             ", ".join(j.source.name for j in jobs[:5]) + (" ..." if len(jobs) > 5 else ""))
    started = float(cfg.get("submitted", time.time()))

    def progress(documents: int, tokens: int) -> None:
        n, docs, total = _finished_shards(staging)
        beat.emit("step", step=n, max_steps=len(prep.files), documents=docs, tokens=total, task=task,
                  tokens_per_s=round(total / max(time.time() - started, 1e-3), 1))
        faults.point("prepare.progress", task=task, attempt=attempt)

    kept_before = _finished_shards(staging)[0]
    t0 = time.perf_counter()
    try:
        records = write_shards(staging, prep, jobs, progress=progress, on_kept=lambda r: log.info(
            "kept %s (finished by an earlier attempt: %d documents, %d tokens)", r["file"], r["documents"],
            r["tokens"]))
    except Exception as exc:  # a bad input (another attempt would meet it again), or what nobody foresaw
        if isinstance(exc, DataError):
            log.error("%s", exc)
        else:
            log.exception("task %d failed", task)
        n, docs, total = _finished_shards(staging)
        beat.emit("end", step=n, max_steps=len(prep.files), documents=docs, tokens=total, task=task,
                  reason="failed", error=(str(exc) if isinstance(exc, DataError)
                                          else f"{type(exc).__name__}: {exc}")[:500])
        _cancel_final_step(run_dir)
        return 1
    mine = sum(r["tokens"] for r in records)
    log.info("task %d done: %d shards (%d tokens) in %.1f s; %d shards of all were finished when it started",
             task, len(records), mine, time.perf_counter() - t0, kept_before)
    progress(0, 0)
    return 0


def _cancel_final_step(run_dir: Path) -> None:
    """The final step waits for every task to succeed, which this one will not: it is cancelled
    (rather than left pending forever). The other tasks go on: their shards are kept for a rerun."""
    from lmcore.slurm import client as slurm

    path, deadline = RunLayout.of(run_dir).preparation_jobs, time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:  # written just after the submission
        time.sleep(0.5)
    try:
        final = str(json.loads(path.read_text())["assemble"])
        slurm.cancel([final])
    except Exception as exc:  # SLURM's or the file's own error, said: the failure above is what matters
        log.warning("could not cancel the final step (%s): %s", path, exc)
        return
    log.error("cancelled the final step (job %s): fix the input and submit the preparation again with the same "
              "--out; the shards finished so far are kept", final)


def assemble(run_dir: Path) -> int:
    from lmtrain.data.prepare.build import Preparation, replace_dir, write_index

    layout = RunLayout.of(run_dir)
    cfg = json.loads(layout.preparation.read_text())
    prep, staging, out = Preparation.from_json(cfg["preparation"]), Path(cfg["staging"]), Path(cfg["out"])
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1
    _logging(run_dir, attempt, "assemble")
    for stray in (staging / "shards").glob(".*.tmp-*"):  # what killed attempts left half-written
        log.info("removing %s (a killed attempt's temporary file)", stray.name)
        stray.unlink()
    meta = write_index(staging, prep)
    os.chmod(staging, 0o755)
    replace_dir(staging, out, keep_existing=False)
    layout.done.write_text(f"{len(prep.files)}\n")
    beat = Heartbeat(layout.heartbeat, attempt=attempt, job_id=os.environ.get("SLURM_JOB_ID"), world_size=1)
    beat.emit("end", step=len(prep.files), max_steps=len(prep.files), documents=meta.num_documents,
              tokens=meta.num_tokens, reason="completed")
    log.info("assembled %s: %d shards, %d documents, %d tokens (%s)", out, len(meta.shards), meta.num_documents,
             meta.num_tokens, meta.dtype)
    return 0


class Stopped(BaseException):
    """SLURM sent SIGTERM (a preemption, the time limit, or a cancel): stop where the task is."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def _requeue_or_end(job_id: str | None, why: str) -> int:
    """After SIGTERM: a cancelled job ends; otherwise (preempted, out of time) it is requeued, and
    its next attempt keeps the shards this one finished. A preemption's GraceTime is the time this
    has: the job would end FAILED, not requeued, if the task just exited."""
    from lmcore.slurm import client as slurm

    if job_id is None:
        log.warning("stopped (%s) outside SLURM: nothing to requeue", why)
        return 143
    try:
        state = (slurm.show_job(job_id) or {}).get("JobState", "UNKNOWN")
        if state == "CANCELLED":
            log.warning("stopped (%s): job %s was cancelled; not requeued", why, job_id)
            return 143
        slurm.requeue(job_id)
    except Exception as exc:  # SLURM's own answer, whatever its type: said, and the task ends
        log.error("stopped (%s): could not requeue job %s: %s", why, job_id, exc)
        return 143
    log.warning("stopped (%s, job %s %s): requeued; the next attempt keeps the finished shards", why, job_id, state)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    run_dir = Path(argv[1])
    faults.load()  # the test harness's rules (LMLAUNCH_FAULTS), as every lmtrain entry reads them
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")
    signal.signal(signal.SIGTERM, _stop)
    try:
        if argv[2] == "--assemble":
            return assemble(run_dir)
        return run_task(run_dir, int(argv[2]))
    except Stopped as stop:
        return _requeue_or_end(job_id, f"SIG{str(stop).removeprefix('SIG')}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
