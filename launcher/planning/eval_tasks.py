"""Which lm-evaluation-harness task names exist, without importing lm-eval (it imports torch and
datasets): the names its task YAML files declare (``task:``, ``group:``, ``tag:``, one value or a
list), in lm-eval's installed ``tasks`` folder and in the spec's ``eval.alongside.task_dirs``, with
the shipped local tasks (lmcore.job.spec.SHIPPED_EVAL_TASKS). The planner refuses a name none declares.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
from collections.abc import Iterable
from pathlib import Path

from lmcore.job.spec import SHIPPED_EVAL_TASKS

_KEY = re.compile(r"^(task|group|tag):\s*(.*?)\s*$")
_ITEM = re.compile(r"^\s+-\s+(\S.*?)\s*$")


def names_in(path: Path) -> set[str]:
    """The task, group and tag names one YAML file declares (top-level keys only)."""
    out: set[str] = set()
    listing = False
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        m = _KEY.match(line)
        if m:
            value = m.group(2).strip("\"'")
            listing = not value
            if value and not value.startswith(("[", "!", "{")):
                out.add(value)
            elif value.startswith("["):
                out.update(v.strip().strip("\"'") for v in value.strip("[]").split(",") if v.strip())
            continue
        item = _ITEM.match(line) if listing else None
        if item:
            out.add(item.group(1).strip("\"'"))
        elif line and not line[0].isspace():
            listing = False
    return out


def names_under(folder: Path) -> set[str]:
    out: set[str] = set()
    for path in sorted(folder.rglob("*.yaml")):
        out |= names_in(path)
    return out


FIND = "import importlib.util as u; s = u.find_spec('lm_eval'); print(s.origin if s and s.origin else '')"


@functools.lru_cache(maxsize=4)
def lm_eval_tasks(python: str | None = None) -> frozenset[str] | None:
    """lm-eval's own task names, where ``python`` (an interpreter command: the evaluator's
    environment; None: this process's) finds lm-eval (found, not imported); None where it does not."""
    if python is None:
        spec = importlib.util.find_spec("lm_eval")
        origin = spec.origin if spec is not None else None
    else:
        try:
            proc = subprocess.run([*shlex.split(python), "-c", FIND], capture_output=True, text=True, timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None
        origin = proc.stdout.strip() if proc.returncode == 0 else None
    if not origin:
        return None
    return frozenset(names_under(Path(origin).with_name("tasks")))


def unknown_tasks(tasks: Iterable[str], task_dirs: Iterable[str], python: str | None = None) -> tuple[list[str], bool]:
    """The names no task file declares, and whether lm-eval's own tasks were looked at (False: the
    evaluator's interpreter ``python`` has no lm-eval here, so its names could not be checked)."""
    known = set(SHIPPED_EVAL_TASKS)
    for d in task_dirs:
        if Path(d).is_dir():
            known |= names_under(Path(d))
    installed = lm_eval_tasks(python)
    if installed is not None:
        known |= installed
    return [t for t in tasks if t not in known], installed is not None
