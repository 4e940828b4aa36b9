"""Which lm-evaluation-harness task names exist, without importing lm-eval (it imports torch and
datasets): the names its task YAML files declare (``task:``, ``group:``, ``tag:``, one value or a
list), in lm-eval's installed ``tasks`` folder and in the spec's ``eval.alongside.task_dirs``, with
the shipped local tasks (lmcore.spec.SHIPPED_EVAL_TASKS). The planner refuses a name none declares.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path

from lmcore.spec import SHIPPED_EVAL_TASKS

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


@functools.lru_cache(maxsize=1)
def lm_eval_tasks() -> frozenset[str] | None:
    """lm-eval's own task names; None where lm-eval is not installed here."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.origin:
        return None
    return frozenset(names_under(Path(spec.origin).with_name("tasks")))


def unknown_tasks(tasks: Iterable[str], task_dirs: Iterable[str]) -> tuple[list[str], bool]:
    """The names no task file declares, and whether lm-eval's own tasks were looked at (False: it is
    not installed on this machine, so its names could not be checked)."""
    known = set(SHIPPED_EVAL_TASKS)
    for d in task_dirs:
        if Path(d).is_dir():
            known |= names_under(Path(d))
    installed = lm_eval_tasks()
    if installed is not None:
        known |= installed
    return [t for t in tasks if t not in known], installed is not None
