"""The run's code snapshot (``<run dir>/code/``): the launcher, lmcore and lmtrain packages as they were at
submission, with the git commit and a patch of uncommitted changes when they come from a git
checkout. Every attempt of the run, requeues days later included, imports the snapshot
(``PYTHONPATH`` and ``--chdir`` in the plan), not the live checkout; ``--resume`` after the code
changed says what changed and takes the new code only with ``--new-code``.

Only source goes in (``*.py`` and package data, no ``__pycache__``, no data, no venv). The same files
go into one zip beside them (``code/lmlaunch-code.zip``, :func:`write_zip`), first on the tasks'
``PYTHONPATH``: a process's imports then open one file instead of stat'ing and opening a few hundred
on the shared filesystem (docs/scale.md). The directory stays for people, ``lmlaunch diff``, the data
files read by path, and a run's older code without the zip.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import launcher
from lmcore.run.rundir import RunLayout

MANIFEST = "manifest.json"
PATCH = "uncommitted.patch"



def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # where it lives, without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name} not found")
    return Path(next(iter(spec.submodule_search_locations)))


PACKAGES = {"launcher": Path(launcher.__file__).parent, "lmcore": _package_dir("lmcore"), "lmtrain": _package_dir("lmtrain")}
# A workstation's code shipped over ssh (launcher.remote.forward): <dir>/launcher, <dir>/lmcore, <dir>/lmtrain and what
# git said of them there (<dir>/git.json); a submission on the login node snapshots that instead.
SHIPPED_ENV = "LMLAUNCH_CODE_FROM"
SHIPPED_GIT = "git.json"


def code_packages(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """The packages a snapshot takes: the shipped ones where ``LMLAUNCH_CODE_FROM`` names them,
    else this lmlaunch's own."""
    shipped = (os.environ if environ is None else environ).get(SHIPPED_ENV)
    return {name: Path(shipped) / name for name in PACKAGES} if shipped else PACKAGES
_SKIP_DIRS = {"__pycache__"}
_SUFFIXES = {".py", ".typed", ".json", ".jsonl", ".yaml", ".txt", ".sh"}  # .jsonl: the evaluator's shipped tasks


@dataclass(frozen=True)
class Snapshot:
    files: dict[str, str]  # "lmtrain/model/module.py" -> sha256
    digest: str  # of all of them
    size: int  # bytes
    git: dict[str, object] | None  # commit, dirty, patch file

    def to_json(self) -> str:
        return json.dumps({"files": self.files, "digest": self.digest, "size": self.size, "git": self.git},
                          indent=2, sort_keys=True) + "\n"


def source_files(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name, root in packages.items():
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix in _SUFFIXES and not _SKIP_DIRS & set(path.relative_to(root).parts):
                out[f"{name}/{path.relative_to(root).as_posix()}"] = path
    return out


def current(packages: dict[str, Path] | None = None) -> tuple[Snapshot, dict[str, Path]]:
    """What a snapshot taken now would hold (hashes only; nothing is copied)."""
    shipped = os.environ.get(SHIPPED_ENV) if packages is None else None
    packages = code_packages() if packages is None else packages
    files = source_files(packages)
    hashes = {rel: hashlib.sha256(p.read_bytes()).hexdigest() for rel, p in files.items()}
    digest = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
    size = sum(p.stat().st_size for p in files.values())
    return Snapshot(hashes, digest, size, _shipped_git(Path(shipped)) if shipped else _git(packages)), files


def take(run_dir: Path, packages: dict[str, Path] | None = None) -> Snapshot:
    """Copy the code into ``run_dir/code`` (replacing an older snapshot); returns what it holds."""
    snap, files = current(packages)
    target = RunLayout.of(run_dir).code
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, src in files.items():
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    if snap.git and snap.git.get("patch"):
        (tmp / PATCH).write_text(str(snap.git.pop("patch")))
        snap.git["patch_file"] = PATCH
    write_zip(tmp / RunLayout.of(run_dir).code_zip.name, {rel: tmp / rel for rel in files}, target)
    (tmp / MANIFEST).write_text(snap.to_json())
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return snap


_PYC_UNCHECKED = (0b01).to_bytes(4, "little")  # PEP 552: hash-based, never checked against the source


def write_zip(out: Path, files: Mapping[str, Path], shown_at: Path, *, cache: Path | None = None) -> None:
    """The zip ``out`` of ``files`` (its name for each -> where to read it), and beside each module
    its bytecode for this interpreter (``mod.pyc``, which zipimport tries first), never checked
    against its source (the zip is never changed). The bytecode names each module's file as the
    snapshot's directory ``shown_at`` holds it: tracebacks, debuggers and py-spy show a file that
    exists, with the package path. A task whose Python differs finds the bytecode's magic number
    wrong and compiles the zip's source instead. Modules imported from the zip have ``__file__``
    ``<zip>/pkg/mod.pyc`` (:func:`lmcore.run.rundir.unzipped` maps it to the directory). Each module is
    compiled once per source into ``cache`` (default: the user's, launcher.runs.bytecode_cache)."""
    import importlib.util
    import marshal
    import zipfile

    from launcher.runs.bytecode_cache import default_dir, module_code, prune

    cache = default_dir() if cache is None else cache
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for rel in sorted(files):
            data = files[rel].read_bytes()
            zf.writestr(rel, data)
            if rel.endswith(".py"):
                code = module_code(data, str(shown_at / rel), cache)
                zf.writestr(rel[:-3] + ".pyc", importlib.util.MAGIC_NUMBER + _PYC_UNCHECKED
                            + importlib.util.source_hash(data) + marshal.dumps(code))
    prune(cache)


def add_zip(run_dir: Path) -> bool:
    """Zip a snapshot taken before the zip (its directory's files, as its manifest lists them), for
    the plan's PYTHONPATH; False when it has one already (or no manifest to go by)."""
    layout = RunLayout.of(run_dir)
    snap = read(run_dir)
    if snap is None or layout.code_zip.exists():
        return False
    tmp = layout.code_zip.with_name(f".{layout.code_zip.name}.tmp")
    write_zip(tmp, {rel: layout.code / rel for rel in snap.files}, layout.code)
    os.replace(tmp, layout.code_zip)
    return True


def read(run_dir: Path) -> Snapshot | None:
    try:
        d = json.loads((RunLayout.of(run_dir).code / MANIFEST).read_text())
        return Snapshot(dict(d["files"]), str(d["digest"]), int(d["size"]), d.get("git"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def changes(old: Snapshot, new: Snapshot) -> list[str]:
    """'changed lmtrain/model/module.py', 'added ...', 'removed ...'."""
    out = [f"changed {f}" for f in sorted(set(old.files) & set(new.files)) if old.files[f] != new.files[f]]
    out += [f"added {f}" for f in sorted(set(new.files) - set(old.files))]
    out += [f"removed {f}" for f in sorted(set(old.files) - set(new.files))]
    return out


def _shipped_git(code: Path) -> dict[str, object] | None:
    """What git said of shipped code where it was taken (None: not a git checkout there)."""
    try:
        told = json.loads((code / SHIPPED_GIT).read_text())
    except (OSError, ValueError):
        return None
    return told if isinstance(told, dict) else None


def _git(packages: dict[str, Path]) -> dict[str, object] | None:
    root = next(iter(packages.values()))
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        commit = subprocess.run(["git", "-C", top, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        paths = [str(p) for p in packages.values()]
        patch = subprocess.run(["git", "-C", top, "diff", "HEAD", "--", *paths], capture_output=True, text=True,
                               timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (an installed package): the files are the record
    return {"commit": commit, "dirty": bool(patch), "patch": patch}
