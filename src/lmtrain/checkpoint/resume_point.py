"""The checkpoint an attempt resumes from: rank 0's choice, as every rank sees it
(:func:`agreed_checkpoint`), and the one that was written: every rank checks its share of the
files against COMPLETE's checksums before anything is loaded (:func:`resume_point`).

Rank 0 chose the checkpoint before the rendezvous (every rank resumes from its choice). Then, in
rounds, with no process group yet (files in the run's ``rendezvous/`` directory, as the
rendezvous itself; ``<key>`` is the rendezvous key and the attempt):

1. every rank hashes its share of the candidate's files (lmcore.run.checkpoint_index.shares:
   split by bytes, so the ranks read in parallel) and publishes what it found: one file per node
   where the node's ranks share node memory, else per rank (lmtrain.checkpoint.verify_exchange);
2. rank 0 reads them all, and publishes the verdict, ``<key>.verify-<round>.json``. Any file
   unlike its checksum makes the candidate incomplete for good (a ``CORRUPT`` marker naming the
   files), a ``checkpoint_rejected`` ledger line says so, and the next round checks the newest
   older complete checkpoint (given its universal form first when the world size needs one);
3. every rank follows the verdict: resume from the candidate, check the next one, or stop when
   none is left (:class:`CheckpointError`: no usable checkpoint; the attempt is not retried).

A checkpoint written before checksums (a COMPLETE without them) passes as it did.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

from lmcore.run.checkpoint_index import (
    STEP_RE,
    CompleteCheckpoint,
    complete_checkpoints,
    is_complete,
    mark_corrupt,
    shares,
    verify,
)
from lmcore.run.rundir import Ledger, LedgerNote, RunLayout
from lmtrain.checkpoint.completion import CheckpointError
from lmtrain.checkpoint.verify_exchange import exchange_for

log = logging.getLogger(__name__)

WAIT_S = 600.0  # for the other ranks' checks (each reads 1/world of the checkpoint)


def resume_point(plan: Any, env: Any, attempt: int, ckpt: CompleteCheckpoint, *, wait_s: float = WAIT_S,
                 node: tuple[Path, int] | None = None) -> CompleteCheckpoint:
    """Every rank, the same answer: ``ckpt`` if every file of it is the one written, else the
    newest older checkpoint that is. CheckpointError when none is. ``node``: this rank's node share
    and its node's number of tasks, where the ranks' checks go per node."""
    # the attempt in the name too: a local launch's key can come back (a reused pid), its attempt cannot
    base = RunLayout.of_plan(plan).verify_file(env.rendezvous_key, attempt)
    exchange = exchange_for(base, env, wait_s, node)
    rejected: list[str] = []
    for round_ in itertools.count():
        t0 = time.perf_counter()
        problems = verify(ckpt.path, shares(ckpt.path, env.world_size)[env.rank])
        exchange.publish(round_, {"step": ckpt.step, "problems": problems})
        if env.rank == 0:
            verdict = _judge(plan, env, attempt, ckpt, exchange.gather(round_))
            exchange.announce(round_, verdict)
        else:
            verdict = exchange.verdict(round_)
        if verdict["ok"]:
            log.info("checkpoint %s: every file matches its checksum (this rank's share in %.2fs)",
                     ckpt.path.name, time.perf_counter() - t0)
            return ckpt
        rejected.append(f"{ckpt.path.name}: {verdict['reason']}")
        if verdict["next"] is None:
            raise CheckpointError("no usable checkpoint: every one failed its checksums (" + "; ".join(rejected) + ")")
        following = agreed_checkpoint(plan.paths.checkpoint_dir, verdict["next"], rank=env.rank)  # rank 0 marked the bad one
        assert following is not None
        ckpt = following
    raise AssertionError("unreachable")


def _judge(plan: Any, env: Any, attempt: int, ckpt: CompleteCheckpoint, problems: list[str]) -> dict[str, Any]:
    """Rank 0: the round's verdict; a failed candidate is marked, noted, and its successor chosen."""
    if not problems:
        return {"ok": True}
    reason = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    mark_corrupt(ckpt.path, problems)
    older = [c for c in complete_checkpoints(plan.paths.checkpoint_dir) if c.step < ckpt.step]
    nxt = older[-1] if older else None
    log.error("checkpoint %s does not hold what was written (%s): %s", ckpt.path, reason,
              f"resuming from {nxt.path.name} instead" if nxt else "no older complete checkpoint is left")
    Ledger(plan.paths.ledger).write(LedgerNote(event="checkpoint_rejected", time=time.time(), fields={
        "attempt": attempt, "job_id": env.job_id, "step": ckpt.step, "path": str(ckpt.path),
        "detail": reason, "problems": problems[:20], "fallback": nxt.path.name if nxt else None}))
    convert_for_world_size(plan, env, nxt)
    return {"ok": False, "reason": reason, "next": nxt.path.name if nxt else None}


def convert_for_world_size(plan: Any, env: Any, ckpt: CompleteCheckpoint | None) -> None:
    """Rank 0 (before the rendezvous, and for a fallback): a ZeRO checkpoint resumed on another
    world size gets its universal form. A failed conversion is recorded beside the checkpoint
    (every rank then refuses to resume with that reason, lmtrain.checkpoint.manager.check_compatible), not
    raised here."""
    from lmtrain.checkpoint.elastic import ensure_universal, needs_universal, record_failure

    if ckpt is not None and needs_universal(ckpt, plan.parallelism.with_world(env.world_size)):
        try:
            ensure_universal(ckpt)
        except Exception as exc:  # the attempt ends with this reason in the ledger
            log.error("converting %s to a universal checkpoint failed: %s", ckpt.path, exc)
            record_failure(ckpt, f"{type(exc).__name__}: {exc}")


def agreed_checkpoint(ckpt_dir: str | Path, name: str | None, *, wait_s: float = 60.0,
                      rank: int | None = None) -> CompleteCheckpoint | None:
    """The checkpoint rank 0 chose to resume from (published in the rendezvous), as this rank
    sees it. Every rank resumes from the same step whatever its own listing of a shared
    filesystem says at this instant (a newer checkpoint that appears, or attribute caches that
    lag). Waits up to ``wait_s`` for it to look complete here (``rank``: the files this rank reads, not
    the other ranks' own); CheckpointError if it never does."""
    if name is None:
        return None
    m = STEP_RE.fullmatch(name)
    if not m:
        raise CheckpointError(f"rank 0 published '{name}' as the checkpoint to resume: not a step-<S> directory name")
    path = Path(ckpt_dir) / name
    deadline = time.monotonic() + wait_s
    while not is_complete(path, rank=rank):
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank 0 resumes from {path}, but this node does not see it complete after {wait_s:.0f} s: "
                f"is {ckpt_dir} on a filesystem every node shares, and in sync?"
            )
        time.sleep(0.5)
    return CompleteCheckpoint(step=int(m.group(1)), path=path)
