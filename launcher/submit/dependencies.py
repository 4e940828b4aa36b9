"""`submit --after RUN[:ok|:any]`: start a run only after others (SLURM job dependencies).

``RUN:ok`` (the default) waits for RUN's job to complete successfully (``afterok``); ``RUN:any``
for it to end however it ends (``afterany``). An upstream job that already ended (squeue's
recent memory, else accounting) is judged before anything is submitted: completed satisfies
both, anything else makes ``:ok`` impossible, said at once rather than left pending forever.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.runs import registry as runs
from lmcore.errors import UserError
from lmcore.slurm import client as slurm

KINDS = {"ok": "afterok", "any": "afterany"}
SINGLETON = "singleton"


@dataclass(frozen=True)
class After:
    run: str
    kind: str  # ok | any
    job_id: str

    def label(self) -> str:
        return SINGLETON if self.kind == SINGLETON else f"{self.run}:{self.kind} (job {self.job_id})"


def parse(refs: Sequence[str], environ: Mapping[str, str] | None = None) -> list[After]:
    """``RUN[:ok|:any]`` (the run's newest job) or ``singleton`` (sbatch's: at most one job of
    this name and user runs at a time, the others wait)."""
    out = []
    for ref in refs:
        if ref == SINGLETON:
            out.append(After(SINGLETON, SINGLETON, ""))
            continue
        name, _, kind = ref.rpartition(":") if ref.rpartition(":")[2] in KINDS else (ref, "", "ok")
        rec = runs.find_run(name, environ)
        if not rec.last_job_id:
            raise UserError(f"--after {ref}: run '{rec.name}' has no job to wait for")
        out.append(After(rec.name, kind, rec.last_job_id))
    return out


def planned(after: Sequence[After]) -> str | None:
    """The --dependency value as asked for, SLURM not asked (the dry run's)."""
    return ",".join(SINGLETON if a.kind == SINGLETON else f"{KINDS[a.kind]}:{a.job_id}" for a in after) or None


def dependency(after: Sequence[After]) -> tuple[str | None, list[str]]:
    """The sbatch --dependency value (None: nothing left to wait for) and notes. Raises when an
    upstream run can no longer satisfy ``:ok``."""
    if not after:
        return None, []
    singleton = any(a.kind == SINGLETON for a in after)
    after = [a for a in after if a.kind != SINGLETON]
    ids = [a.job_id for a in after]
    known = {j.job_id: j for j in slurm.squeue(ids)}  # ended jobs too, for MinJobAge
    live = {jid: j for jid, j in known.items() if slurm.is_active(j.state)}
    ended = {jid: slurm.state_word(j.state) for jid, j in known.items() if jid not in live}
    forgotten = [a for a in after if a.job_id not in known]
    if forgotten:
        for row in slurm.sacct([a.job_id for a in forgotten], duplicates=False):
            ended[row.job_id] = slurm.state_word(row.state)
    parts, notes = [], []
    for a in after:
        if a.job_id in live:
            parts.append(f"{KINDS[a.kind]}:{a.job_id}")
            continue
        state = ended.get(a.job_id, "UNKNOWN")
        if state == "COMPLETED" or a.kind == "any":
            notes.append(f"--after {a.label()}: it already ended {state}; nothing to wait for")
        else:
            raise UserError(f"--after {a.label()}: that job ended {state}, so it can never complete successfully; "
                            f"resubmit it, or wait for it with --after {a.run}:any")
    if singleton:
        parts.append(SINGLETON)
        notes.append("singleton: starts only when no other job of this name is running")
    return (",".join(parts) or None), notes
