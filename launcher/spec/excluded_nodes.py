"""The nodes a user excludes from their submissions to one cluster profile, each with the reason
`lmlaunch doctor --on-nodes --exclude-bad` found (docs/doctor.md).

The record is the user's own state, beside the run registry: ``$LMLAUNCH_HOME/excluded-nodes/
<profile>.json`` (default ``~/.lmlaunch``). ``launcher.planning.resolve`` reads it and hands it to the
planner, which is pure: the plan's ``slurm.exclude`` is sbatch ``--exclude`` and each node's
reason is a plan note, so ``submit --dry-run`` shows both. A node leaves the record when a later
``doctor --on-nodes`` probes it and it passes, or when the file is deleted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from lmcore.atomic import write_private
from lmcore.errors import UserError

FILE_VERSION = 1


@dataclass(frozen=True)
class Exclusion:
    node: str
    reason: str  # what failed, with the figures: "GEMM 2.1 GFLOP/s < 0.5 x median 9.8 GFLOP/s"
    since: float  # epoch seconds of the doctor run that found it
    job_id: str = ""  # the probe job

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.since))
        job = f" job {self.job_id}," if self.job_id else ""
        return f"{self.reason} (lmlaunch doctor --on-nodes --exclude-bad,{job} {when})"


@dataclass(frozen=True)
class Merged:
    record: dict[str, Exclusion]
    added: tuple[str, ...]  # newly excluded
    kept: tuple[str, ...]  # excluded before and failed again (reason updated) or not probed
    cleared: tuple[str, ...]  # excluded before, passed now


def merge(current: Mapping[str, Exclusion], failed: Mapping[str, str], passed: Iterable[str], *,
          now: float, job_id: str = "", add: bool = True) -> Merged:
    """The record after a probe: nodes that passed leave it; failed ones join it (``add``: with
    --exclude-bad; without it a failure only refreshes the reason of a node already excluded);
    nodes the probe did not reach stay as they were. Pure."""
    record = dict(current)
    passed = set(passed) - set(failed)
    cleared = tuple(sorted(n for n in passed if n in record))
    for n in cleared:
        del record[n]
    added = []
    for node, reason in sorted(failed.items()):
        if node in record or add:
            if node not in record:
                added.append(node)
            record[node] = Exclusion(node=node, reason=reason, since=now, job_id=job_id)
    kept = tuple(sorted(n for n in record if n not in added))
    return Merged(record=dict(sorted(record.items())), added=tuple(added), kept=kept, cleared=cleared)


def load(path: Path) -> dict[str, Exclusion]:
    """The record at ``path`` (none: empty). A damaged file is a UserError naming it."""
    try:
        d = json.loads(path.read_text())
        if d.get("version") != FILE_VERSION:
            raise ValueError(f"version {d.get('version')!r}, expected {FILE_VERSION}")
        return {n: Exclusion(**e) for n, e in d["nodes"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UserError(f"{path}: not a record of excluded nodes ({exc}); delete it to exclude no node, "
                        f"then run `lmlaunch doctor SPEC --on-nodes --exclude-bad` again") from None


def save(path: Path, record: Mapping[str, Exclusion]) -> None:
    """Write the record (private, atomic); an empty one removes the file."""
    if not record:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = {"version": FILE_VERSION, "nodes": {n: asdict(e) for n, e in sorted(record.items())}}
    write_private(path, json.dumps(body, indent=2) + "\n")


def reasons(record: Mapping[str, Exclusion]) -> dict[str, str]:
    """node -> the reason the plan shows."""
    return {n: e.describe() for n, e in sorted(record.items())}
