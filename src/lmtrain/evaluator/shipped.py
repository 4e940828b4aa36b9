"""The shipped lm-eval tasks (``tasks/``: lmlaunch_pydoc_choice, lmlaunch_pydoc_perplexity), put
where lm-eval can read them: lm-eval resolves a task's ``data_files`` against the process's working
directory, not the YAML's folder, so each YAML is copied into the run's ``eval/tasks`` with its data
files named by absolute path (the data files are copied beside them). ``lm_eval --include_path
RUN/eval/tasks`` then scores by hand exactly what the evaluator scored."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from lmcore.run.eval_alongside import TASKS_DIR
from lmcore.run.rundir import unzipped

SHIPPED = unzipped(Path(__file__).resolve()).with_name("tasks")  # on disk, also when imported from the snapshot's zip
_DATA_FILE = re.compile(r"^(\s+\w+:\s*)(\S+\.jsonl)\s*$")


def materialize(run_dir: str | Path) -> Path:
    """Write the shipped tasks into ``RUN/eval/tasks`` (data files absolute); the folder."""
    out = Path(run_dir) / TASKS_DIR
    out.mkdir(parents=True, exist_ok=True)
    for data in sorted(SHIPPED.glob("*.jsonl")):
        shutil.copyfile(data, out / data.name)
    for yaml in sorted(SHIPPED.glob("*.yaml")):
        lines = [_absolute(line, out) for line in yaml.read_text().splitlines()]
        (out / yaml.name).write_text("\n".join(lines) + "\n")
    return out


def _absolute(line: str, folder: Path) -> str:
    m = _DATA_FILE.match(line)
    return f"{m.group(1)}{folder / m.group(2)}" if m else line
