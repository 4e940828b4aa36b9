"""Asking each cluster a run names when it would start there: ``sbatch --test-only`` with the
script the run would be submitted with (the controller judges every option and gives its start
estimate; nothing is queued), and the user's pending jobs there. A cluster that does not answer
within a bound is skipped with a note, never waited on. One whose refusal only nodes out of service
now explain (launcher.submit.shape_check.waits_for_nodes) would queue the job: it takes it, with no
start estimate (after every cluster that gives one).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence

from launcher.planning import transport
from launcher.planning.clusters import Answer, choose, plan_each
from launcher.planning.resolve import Resolved
from launcher.submit.script import render_script
from launcher.submit.shape_check import waits_for_nodes
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.slurm import client as slurm, way as slurm_way

ANSWER_VAR = "LMLAUNCH_CLUSTER_ANSWER_S"
DEFAULT_ANSWER_S = 10  # each cluster's controller has this long to answer, per question
_START = re.compile(r"to start at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")


def answer_s(environ: Mapping[str, str] | None = None) -> int:
    """Seconds each cluster has to answer (env LMLAUNCH_CLUSTER_ANSWER_S)."""
    text = (os.environ if environ is None else environ).get(ANSWER_VAR, str(DEFAULT_ANSWER_S))
    if not text.isdigit() or not 1 <= int(text) <= 600:
        raise UserError(f"{ANSWER_VAR}={text!r}: expected a whole number of seconds from 1 to 600", exit_code=2)
    return int(text)


def ask_each(plans: Sequence[Resolved], dependency: str | None, environ: Mapping[str, str] | None = None) -> list[Answer]:
    """Each cluster's answer, in the order named."""
    bound = answer_s(environ)
    return [ask(r, dependency, bound) for r in plans]


def ask(resolved: Resolved, dependency: str | None, bound: float) -> Answer:
    """One cluster's answer: through its own way to SLURM (its profile's SLURM_CONF and commands,
    or its slurmrestd, which gives no estimate)."""
    name = resolved.profile.name
    target = transport.profile_target(resolved.profile)
    try:
        with transport.through(target, exactly=True):
            if not (way := slurm_way.way()).tests_scripts:
                return Answer(name, True, None, f"no start estimate: {way.where} has no sbatch --test-only",
                              _pending(bound))
            ok, message = slurm.test_only("sbatch", [], script=render_script(resolved.plan, dependency), timeout=bound)
            if not ok:
                waiting = waits_for_nodes(resolved.plan.slurm, message)
                if waiting:  # nodes out of service now: queued, it would wait for them (no estimate)
                    return Answer(name, True, None, f"queued, it would wait ({message}): {waiting}", _pending(bound))
                return Answer(name, False, None, message or "refused, without a reason")
            found = _START.search(message)
            start = slurm.parse_time(found.group(1)) if found else None
            return Answer(name, True, start, message, _pending(bound))
    except SlurmUnavailable as exc:
        return Answer(name, False, None, f"skipped: {exc.message}", answered=False)
    except UserError as exc:  # its profile's slurm_conf or slurm_bin missing here, its slurmrestd refusing
        return Answer(name, False, None, f"skipped: {exc.message}", answered=False)


def _pending(bound: float) -> int | None:
    """The user's jobs pending on the cluster asked (None: it did not say in time)."""
    try:
        return sum(1 for j in slurm.squeue(user=slurm.user_name(), timeout=bound) if j.state == "PENDING")
    except (SlurmUnavailable, UserError):
        return None


def describe(answers: Sequence[Answer], chosen: Answer | None, why: str, now: float | None = None) -> list[str]:
    """The answers for people, one line per cluster, and the choice."""
    now = time.time() if now is None else now
    lines = ["clusters asked when the run would start (sbatch --test-only):"]
    for a in answers:
        if not a.answered:
            text = a.message
        elif not a.accepted:
            text = f"would not take the job: {a.message}"
        elif a.start is None:
            text = a.message if "no start estimate" in a.message else f"takes it, no start estimate ({a.message})"
        else:
            wait = max(0.0, a.start - now)
            text = (f"starts {time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(a.start))} "
                    f"({'now' if wait < 60 else _span(wait) + ' from now'})")
        if a.pending is not None:
            text += f"; {a.pending} of your jobs pending there"
        lines.append(f"  {a.cluster}: {text}")
    lines.append(f"chosen: {chosen.cluster} ({why})" if chosen else f"chosen: none ({why})")
    return lines


def _span(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def place(spec: str, overrides: Sequence[str], first: Resolved, environ: Mapping[str, str] | None, python: str | None,
          dependency: str | None = None, *, force: bool = False) -> tuple[Resolved | None, list[Answer], list[str]]:
    """A run naming several clusters: planned on each (each must be able to run it), each asked
    when it would start, and the plan of the one chosen (None: no cluster would take it); with the
    answers and their lines."""
    plans = plan_each(spec, list(overrides), first.spec.clusters or [], environ, python, force=force, done=first)
    answers = ask_each(plans, dependency, environ)
    chosen, why = choose(answers)
    lines = describe(answers, chosen, why)
    return (next(p for p in plans if p.profile.name == chosen.cluster) if chosen else None), answers, lines
