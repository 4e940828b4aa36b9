"""The SLURM releases lmlaunch is tested on: one table of what differs between them, and what to say
about another release.

Each entry of ``RELEASES`` holds what lmlaunch reads of that release: the Debian suite whose packages
give it (the local cluster builds it from there), the REST API versions its slurmrestd serves, the
topology plugins the local cluster may configure, the job states and ``sacctmgr`` words it adds, and
the behaviours the code handles for it (each naming where). The code that differs by release reads
it from here (the local cluster, the REST client, sacctmgr's answers, the job states); adding a
release is an entry here plus its cluster in the tests (scripts/test.sh runs the ``both_versions``
tests on each). docs/architecture.md shows the table (``python -m lmcore.slurm.versions --write
docs/architecture.md`` regenerates it).

A cluster on another release is not refused: doctor and `profile init` say which tested release is
nearest, so a user knows what the behaviour was checked against.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Quirk:
    """A behaviour of a release that lmlaunch handles whatever the release (never by a version test)."""

    what: str
    where: str  # the module that handles it


@dataclass(frozen=True)
class Release:
    """What lmlaunch knows of one tested SLURM release (verified on its local cluster)."""

    name: str  # "24.11"
    debian: str  # the Debian suite whose packages give it (the local cluster's root)
    rest_apis: tuple[str, ...] = ()  # slurmrestd's data_parser versions, newest first (none: no REST)
    topologies: tuple[str, ...] = ("tree",)  # topology plugins of the kinds the local cluster makes
    job_states: dict[str, str] = field(default_factory=dict)  # states it adds -> lmlaunch's group
    sacctmgr_exists: tuple[str, ...] = ()  # what `sacctmgr add` says of what exists already
    quirks: tuple[Quirk, ...] = ()


RELEASES: tuple[Release, ...] = (
    Release(
        "22.05",
        "bookworm",
        sacctmgr_exists=("Nothing new added",),
        quirks=(
            Quirk("a preempted job whose tasks exit within GraceTime ends COMPLETED, never requeued: the job "
                  "requeues itself", "lmtrain.preemption.policy"),
            Quirk("step creation is refused for a while after a node returns to service", "launcher.submit.script"),
            Quirk("a preemption moves EndTime to now + GraceTime (read as the time limit otherwise)",
                  "lmtrain.preemption.slurm_facts"),
            Quirk("JobState=COMPLETING for a job being cancelled, timed out, failed or requeued: accounting "
                  "says which", "lmtrain.preemption.slurm_facts"),
            Quirk("`scontrol show topology` fails with topology/none", "lmcore.slurm.client"),
            Quirk("sacct has no Restarts field: restarts read from `scontrol show job`", "lmcore.slurm.client"),
        ),
    ),
    Release(
        "24.11",
        "trixie",
        rest_apis=("v0.0.42", "v0.0.41", "v0.0.40"),
        topologies=("tree", "block"),
        sacctmgr_exists=("Already existing", "already exists", "Request didn't affect anything"),
        quirks=(
            Quirk("a job requeued by a preemption is requeued once more when its next run ends: that attempt "
                  "finds the DONE marker and ends at once", "launcher.monitor.status_rows"),
            Quirk("slurmrestd's ping says only DOWN for a refused token: its statistics call says why",
                  "lmcore.slurm.rest"),
        ),
    ),
    Release(
        "26.05",
        "sid",
        rest_apis=("v0.0.45", "v0.0.44", "v0.0.43", "v0.0.42"),
        topologies=("tree", "block"),
        job_states={"EXPEDITING": "queued"},  # a job whose requeue is expedited, between its end and next start
        sacctmgr_exists=("Already existing", "already exists", "Request didn't affect anything"),
        quirks=(
            Quirk("the expedited requeue (sbatch --requeue=expedite, ExpeditedRequeue=Yes)",
                  "lmtrain.preemption.controller"),
            Quirk("the time-limit warning may reach a task after its run completed (under load): ignored "
                  "then, or SLURM records the run FAILED", "lmtrain.task.agent"),
            Quirk("slurmctld serves its own metrics (metrics/openmetrics)", "launcher.serve.grafana"),
        ),
    ),
)
TESTED = tuple(r.name for r in RELEASES)


def release(version: str | None) -> tuple[int, int] | None:
    """``26.05.5`` -> (26, 5); None for text that is not a SLURM version."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def facts(version: str | None) -> Release | None:
    """The table's entry for ``version``'s release (``24.11.5`` -> 24.11's); None for an untested one."""
    r = release(version)
    return next((x for x in RELEASES if release(x.name) == r), None) if r else None


def rest_apis() -> tuple[str, ...]:
    """Every REST API version some tested release serves, newest first: the ones the client speaks."""
    found = {api for r in RELEASES for api in r.rest_apis}
    return tuple(sorted(found, key=lambda a: tuple(int(p) for p in a[1:].split(".")), reverse=True))


def job_states() -> dict[str, str]:
    """The job states tested releases added, each with lmlaunch's group for it."""
    return {state: group for r in RELEASES for state, group in r.job_states.items()}


def sacctmgr_exists() -> tuple[str, ...]:
    """What `sacctmgr add` says, on any tested release, of what exists already."""
    return tuple(dict.fromkeys(words for r in RELEASES for words in r.sacctmgr_exists))


def with_topology(kind: str) -> tuple[str, ...]:
    """The tested releases that run topology plugin ``kind`` (``block``)."""
    return tuple(r.name for r in RELEASES if kind in r.topologies)


def _months(r: tuple[int, int]) -> int:
    return r[0] * 12 + r[1]  # releases are named year.month


def nearest_tested(version: str | None) -> str | None:
    """The tested release closest in time to ``version`` (the newer one on a tie)."""
    r = release(version)
    if r is None:
        return None
    return min(reversed(TESTED), key=lambda t: abs(_months(release(t) or (0, 0)) - _months(r)))


def is_tested(version: str | None) -> bool:
    return facts(version) is not None


def untested_note(version: str | None) -> str | None:
    """What to tell a user of a cluster on ``version`` when lmlaunch was never tested on its release."""
    if is_tested(version):
        return None
    tested = ", ".join(TESTED)
    if release(version) is None:
        return f"the cluster's SLURM version {version or '(none given)'!r} could not be read; lmlaunch is tested on {tested}"
    return (f"SLURM {version} is not a release lmlaunch was tested on ({tested}); the nearest tested is "
            f"{nearest_tested(version)}: what its commands print or default to may differ (docs/architecture.md)")


# --------------------------------------------------------------------------- the table in the docs

BEGIN = "<!-- releases: python -m lmcore.slurm.versions --write docs/architecture.md -->"
END = "<!-- end of releases -->"


def markdown_table() -> str:
    """The table as docs/architecture.md shows it."""
    lines = ["| release | Debian suite | REST API (slurmrestd) | topology plugins | job states added | "
             "handled where it differs |", "| --- | --- | --- | --- | --- | --- |"]
    for r in RELEASES:
        quirks = "; ".join(f"{q.what} (`{q.where}`)" for q in r.quirks) or "-"
        states = ", ".join(f"{s} ({g})" for s, g in r.job_states.items()) or "-"
        apis = f"{r.rest_apis[-1]} to {r.rest_apis[0]}" if r.rest_apis else "none the client speaks"
        lines.append(f"| {r.name} | {r.debian} | {apis} | {', '.join(r.topologies)} | {states} | {quirks} |")
    return "\n".join([BEGIN, *lines, END])


def with_table(page: str) -> str:
    """``page`` with its table (between BEGIN and END) replaced by the current one."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + markdown_table() + page[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="print (or --write into a page) the tested SLURM releases' table")
    ap.add_argument("--write", metavar="PAGE")
    args = ap.parse_args(argv)
    if args.write:
        from pathlib import Path

        page = Path(args.write)
        page.write_text(with_table(page.read_text()))
    else:
        print(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
