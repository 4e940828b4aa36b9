"""The one fault-injection seam: named points in the runtime where a test makes the process die,
sleep or hang. Off unless the test harness turns it on; a job spec cannot.

The harness sets ``LMLAUNCH_FAULTS`` in the environment of the process that runs the task (for
a SLURM job: of the process that submits it, as SLURM hands the submitting environment to the
job); the task reads it once, when lmtrain's modules are imported. A job spec cannot set it: ``env.vars`` and ``env.passthrough`` refuse the ``LMLAUNCH_``
prefix (``lmcore.job.spec.RESERVED_ENV_PREFIXES``). The value is a JSON list of rules, or
the path of a file holding one::

    [{"point": "checkpoint.renamed", "file": "COMPLETE", "attempt": 1, "step": 20, "rank": 0,
      "action": "kill"}]

A rule fires at a point whose name matches ``point`` (fnmatch) when every field it gives
matches: ``file`` (fnmatch over the file the point is about), ``rank`` (the global rank),
``step`` (the step being saved or trained), ``attempt`` (the attempt number the ledger
gives), ``nth`` (the n-th time this rule's other fields matched in this process). Actions:
``kill`` (SIGKILL), ``sigterm`` (the process sends itself SIGTERM, as SLURM does at a
preemption: bench/stop_checkpoint.py stops every rank at one step this way), ``sleep`` (``seconds``), ``hang`` (sleep forever),
``gate`` (wait until the process is told to stop, or until the file ``until`` exists where the
rule names one: a test holds a run at a point, reads the state the run would otherwise leave, then
acts on it: a preemption's signal opens every gate of the process, which goes on to the stop it was
told to make; or the test releases it by creating the file), ``enospc`` (raise the
OSError a full disk raises, as if the write at that point had found no room), ``raise`` (a
RuntimeError, as a bug in the training code would), ``count``
(nothing: :func:`seen` tells how many points passed).

Points (docs/run-directory.md has the checkpoint protocol they sit in):

- ``checkpoint.wrote`` / ``checkpoint.fsynced`` / ``checkpoint.renamed`` (file): an atomic
  file write's data written, fsynced, renamed into place;
- ``checkpoint.fsync`` (file): a file or directory fsynced;
- ``checkpoint.tmp_dir_created``, ``checkpoint.rank_saved``, ``checkpoint.dir_renamed``: the
  save's own steps; ``checkpoint.removed`` (file): a checkpoint deleted;
- ``startup.owned``: a SLURM task's process owns its signals (lmtrain.task.main), before submitit's
  runner loads the task; ``startup.<phase>``: a startup phase of the attempt ended (lmtrain.observe.startup:
  entry, imports, gate, rendezvous, data, model, restore, first_step);
- ``train.batch_end`` (step): after every training batch, before the checkpoint decision;
  ``watchdog.beat`` (step, rank): after every batch, once the hang watchdog has been told
  (last in the callback list, so after the step's checkpoint).
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "LMLAUNCH_FAULTS"
ACTIONS = ("kill", "sigterm", "sleep", "hang", "gate", "enospc", "raise", "count")
GATE_POLL_S = 0.05
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    point: str
    action: str
    file: str | None = None
    rank: int | None = None
    step: int | None = None
    attempt: int | None = None
    nth: int | None = None
    seconds: float = 0.0
    until: str | None = None  # the file that opens the gate (action "gate"); without one, a stop only

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Rule:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if (unknown or "point" not in d or d.get("action") not in ACTIONS
                or (d.get("until") is not None and d.get("action") != "gate")):
            raise ValueError(f"{ENV}: bad rule {d!r} (fields: {sorted(cls.__dataclass_fields__)}; "
                             f"action one of {ACTIONS}; 'until' only with 'gate')")
        return cls(**d)


_rules: list[Rule] | None = None  # None: the seam is off (the one check every point makes)
_matched: dict[int, int] = {}  # rule index -> how many times it matched
_passed: Counter[str] = Counter()  # point name -> how many times this process passed it
_local = threading.local()  # per thread: a background checkpoint writer has its own step
_gates_open = False  # set by open_gates(): the process was told to stop


def _context() -> dict[str, Any]:
    ctx = getattr(_local, "context", None)
    if ctx is None:
        ctx = _local.context = {}
    return ctx


def load(value: str | None = None) -> None:
    """(Re)read the rules from ``value`` or ``$LMLAUNCH_FAULTS``; an empty value turns the seam off."""
    global _rules, _gates_open
    value = os.environ.get(ENV, "") if value is None else value
    _gates_open = False
    _matched.clear()
    _passed.clear()
    if not value.strip():
        _rules = None
        return
    text = value if value.lstrip().startswith("[") else Path(value).read_text()
    _rules = [Rule.from_json(d) for d in json.loads(text)]
    log.warning("fault injection is on (%s): %d rule(s)", ENV, len(_rules))


def open_gates() -> None:
    """Open every gate of this process, now and later: it was told to stop (lmtrain.preemption's
    signal handler calls this), and a run held at a point must go on to that stop. Sets a flag
    only, so a signal handler may call it."""
    global _gates_open
    _gates_open = True


def set_context(**fields: Any) -> None:
    """What later points of this thread are about (``step=S`` during a save; ``step=None`` clears it)."""
    ctx = _context()
    for k, v in fields.items():
        if v is None:
            ctx.pop(k, None)
        else:
            ctx[k] = v


def seen(pattern: str = "*") -> int:
    """How many points whose name matches ``pattern`` this process passed while the seam was on."""
    return sum(n for name, n in _passed.items() if fnmatch.fnmatchcase(name, pattern))


def point(name: str, **fields: Any) -> None:
    """A named point: does nothing unless a rule of the harness matches it."""
    if _rules is None:
        return
    _passed[name] += 1
    facts = {**_context(), **fields}
    for i, rule in enumerate(_rules):
        if not fnmatch.fnmatchcase(name, rule.point) or not _fields_match(rule, facts):
            continue
        _matched[i] = _matched.get(i, 0) + 1
        if rule.nth is not None and _matched[i] != rule.nth:
            continue
        _act(rule, name, facts)


def _fields_match(rule: Rule, facts: dict[str, Any]) -> bool:
    if rule.file is not None and not fnmatch.fnmatchcase(str(facts.get("file", "")), rule.file):
        return False
    if rule.rank is not None and rule.rank != facts.get("rank", _rank()):
        return False
    if rule.step is not None and rule.step != facts.get("step"):
        return False
    return rule.attempt is None or rule.attempt == _attempt()


def _act(rule: Rule, name: str, facts: dict[str, Any]) -> None:
    if rule.action == "count":
        return
    log.warning("fault injection: %s at %s %s", rule.action, name, facts)
    for h in logging.getLogger().handlers:
        h.flush()
    if rule.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif rule.action == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif rule.action == "sleep":
        time.sleep(rule.seconds)
    elif rule.action == "hang":
        while True:
            time.sleep(3600)
    elif rule.action == "gate":
        while not _gates_open and not (rule.until and os.path.exists(rule.until)):
            time.sleep(GATE_POLL_S)
    elif rule.action == "raise":
        raise RuntimeError(f"fault injection at {name}")
    elif rule.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (fault injection at {name})")


def _rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _attempt() -> int:
    """The attempt number: the ledger's start lines (this attempt's is written before training)."""
    from lmcore.run.rundir import Ledger, RunLayout

    run_dir = os.environ.get("LMLAUNCH_RUN_DIR", "")
    return Ledger(RunLayout.of(run_dir).ledger).next_attempt() - 1 if run_dir else 0


# Read once, in a task (a process the launcher started: it has LMLAUNCH_RUN_DIR); a process
# that only imports lmtrain (the CLI submitting a job) never turns it on.
if os.environ.get("LMLAUNCH_RUN_DIR"):
    load()
