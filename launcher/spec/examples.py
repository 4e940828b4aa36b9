"""The example job specs (jobs/ of a checkout; ``launcher/examples`` in an installed wheel), written
into a directory of the user's choice by `lmlaunch examples DIR`: what a user of the wheel starts
from. The demo's specs read ``../data/prepared/tiny``, which `lmlaunch data prepare --shipped-corpus`
makes beside them."""

from __future__ import annotations

from pathlib import Path

from lmcore.errors import UserError

REPO_EXAMPLES = Path(__file__).resolve().parents[2] / "jobs"  # a checkout (editable install)
SHIPPED_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # the same files in an installed wheel
DEMO_DATA = Path("data") / "prepared" / "tiny"  # where the demo's specs look, from DIR


def examples_dir() -> Path:
    return REPO_EXAMPLES if REPO_EXAMPLES.is_dir() else SHIPPED_EXAMPLES


def example_files() -> list[Path]:
    """Every example spec, pipeline and sweep, relative to :func:`examples_dir`."""
    root = examples_dir()
    files = sorted(p.relative_to(root) for p in root.rglob("*.yaml"))
    if not files:
        raise UserError(f"no example specs in {root}: this install of lmlaunch lacks them (reinstall it)", exit_code=1)
    return files


def write_examples(target: Path, *, force: bool = False) -> list[Path]:
    """Write every example under ``target``/jobs; nothing is written when one would overwrite a
    file that differs, unless ``force``. The files written (or already the same)."""
    root, jobs = examples_dir(), target / "jobs"
    files = example_files()
    clash = [jobs / f for f in files if (jobs / f).exists() and (jobs / f).read_bytes() != (root / f).read_bytes()]
    if clash and not force:
        raise UserError(f"{len(clash)} file(s) under {jobs} differ from the examples (first: {clash[0]}); "
                        "nothing was written: choose another directory, or --force to overwrite them")
    for f in files:
        (jobs / f).parent.mkdir(parents=True, exist_ok=True)
        (jobs / f).write_bytes((root / f).read_bytes())
    return [jobs / f for f in files]
