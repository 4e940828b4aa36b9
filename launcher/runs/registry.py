"""Run directories and the local registry of submitted runs (docs/run-directory.md).

A run directory ``<runs_root>/<run name>/`` (mode 0700) holds everything of one run: the
resolved spec, the plan, the DeepSpeed JSON, submitit's folder, logs per attempt and rank,
checkpoints and metrics. The registry (``$LMLAUNCH_HOME/registry/<run name>.json``, default
``~/.lmlaunch``) maps run names to their job ids over time, so status/logs/cancel take a run
name or a job id.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Container, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.runs.home import lmlaunch_home
from lmcore.atomic import write_private
from lmcore.errors import UserError, did_you_mean
from lmcore.run import rundir
from lmcore.run.rundir import RunLayout
from lmcore.text_rules import RUN_NAME, brief

if TYPE_CHECKING:  # `lmlaunch status` reads the registry: no pydantic/yaml import on that path
    from lmcore.job.plan import LaunchPlan

PRIVATE_DIR_MODE = 0o700
# created at submit time; lmtrain creates the rest (checkpoints/, metrics/ ...) under the same 0700 root
SUBDIRS = (rundir.SUBMITIT, rundir.LOGS, rundir.METRICS, rundir.CHECKPOINTS)


# --------------------------------------------------------------------------- registry


def registry_dir(environ: Mapping[str, str] | None = None) -> Path:
    return lmlaunch_home(environ) / "registry"


@dataclass
class RunRecord:
    """One run as the launcher knows it; the live state comes from SLURM and the markers."""

    name: str
    profile: str
    run_dir: str
    spec_path: str | None
    job_ids: list[str] = field(default_factory=list)
    submitted_at: list[float] = field(default_factory=list)
    state: str = "submitted"  # submitted | cancelled
    max_steps: int | None = None
    after: list[str] = field(default_factory=list)  # submit --after: "RUN:ok (job 12)"
    sweep: str | None = None  # the sweep this run is a point of (lmlaunch sweep)
    point: dict[str, Any] = field(default_factory=dict)  # its swept keys and values
    # each job's cluster profile, beside job_ids (a run over several clusters); older records
    # have none: every job on ``profile``
    job_profiles: list[str] = field(default_factory=list)
    # profile -> its way to SLURM when it is a cluster of its own (own SLURM_CONF/commands, or a
    # slurmrestd) as submitted: launcher.planning.transport's JSON; read back without the profile
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunRecord:
        known = {f: d[f] for f in cls.__dataclass_fields__ if f in d}
        return cls(**known)

    @property
    def last_job_id(self) -> str | None:
        return self.job_ids[-1] if self.job_ids else None

    def profile_of(self, job_id: str) -> str:
        """The cluster profile ``job_id`` was submitted with (the newest job of that id)."""
        for i in range(len(self.job_ids) - 1, -1, -1):
            if self.job_ids[i] == job_id:
                return self.job_profiles[i] if i < len(self.job_profiles) and self.job_profiles[i] else self.profile
        return self.profile

    def target_of(self, job_id: str | None) -> dict[str, Any] | None:
        """The way to the cluster ``job_id`` went to, as recorded (None: this machine's default)."""
        return self.targets.get(self.profile_of(job_id) if job_id else self.profile)

    def jobs_by_profile(self) -> dict[str, list[str]]:
        """The run's job ids grouped by the cluster profile each was submitted with, in order."""
        out: dict[str, list[str]] = {}
        for i, job in enumerate(self.job_ids):
            prof = self.job_profiles[i] if i < len(self.job_profiles) and self.job_profiles[i] else self.profile
            out.setdefault(prof, []).append(job)
        return out


def _record_path(name: str, environ: Mapping[str, str] | None = None) -> Path:
    return registry_dir(environ) / f"{name}.json"


def load_record(name: str, environ: Mapping[str, str] | None = None) -> RunRecord | None:
    path = _record_path(name, environ)
    try:
        return RunRecord.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{path}: unreadable registry entry ({exc}); remove it or repair it", exit_code=1) from None


def save_record(rec: RunRecord, environ: Mapping[str, str] | None = None) -> Path:
    """Write atomically (tmp + rename) so a reader never sees half a record."""
    path = _record_path(rec.name, environ)
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    write_private(path, json.dumps(rec.to_dict(), indent=2, sort_keys=True) + "\n")
    return path


def delete_record(name: str, environ: Mapping[str, str] | None = None) -> None:
    _record_path(name, environ).unlink(missing_ok=True)


REGISTRY_INDEX = "cache/registry-index.json"  # under $LMLAUNCH_HOME: a read-through copy of the registry
REGISTRY_HEADS = "cache/registry-heads.json"  # beside it: each entry's identity, last submission and job


def list_records(environ: Mapping[str, str] | None = None) -> list[RunRecord]:
    """Every registry entry, by name. The per-run files are the truth; a single index file
    (``$LMLAUNCH_HOME/cache/registry-index.json``) holds a copy of each record with the identity of
    the file it came from (inode, mtime, size). One directory listing and one stat per entry then
    tell which copies are current; only new or changed entries are read and parsed, and the index
    is rewritten (atomically) when any was. Nothing else needs to keep it up to date."""
    d = registry_dir(environ)
    try:
        with os.scandir(d) as it:
            names = sorted(e.name for e in it if e.name.endswith(".json") and not e.name.startswith("."))
    except OSError:  # no registry yet (or not a directory)
        return []
    index_path = lmlaunch_home(environ) / REGISTRY_INDEX
    index = _load_index(index_path)
    fresh: dict[str, list[Any]] = {}
    out = []
    base = str(d)
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.stat(path)
        except OSError:
            continue  # removed meanwhile
        ident = [st.st_ino, st.st_mtime_ns, st.st_size]
        known = index.get(name)
        data = known[1] if known is not None and known[0] == ident else None
        if data is None:
            try:
                with open(path) as f:
                    data = json.load(f)
                rec = RunRecord.from_dict(data)
            except (OSError, ValueError, TypeError):
                continue  # a broken entry must not hide the others; `find_run` names it
            if not _racy(st.st_mtime_ns):
                fresh[name] = [ident, data]
        elif known is not None:
            rec = RunRecord.from_dict(data)
            fresh[name] = known
        out.append(rec)
    if fresh != index or not index_path.with_name(Path(REGISTRY_HEADS).name).exists():
        _save_index(index_path, fresh)
    return out


def recent_or_unfinished(final: Container[str], now: float, days: float = 1.0,
                         environ: Mapping[str, str] | None = None) -> tuple[list[RunRecord], int]:
    """The records plain `status` may show (submitted within ``days``, or whose last job is not
    known to have ended for good: ``final``) and how many others there are, without parsing the
    others: the index's heads (``$LMLAUNCH_HOME/cache/registry-heads.json``: name -> identity,
    last submission, last job) decide, ``final`` holding the jobs known to have ended
    (slurm_view.ended_jobs); an entry whose file changed is read as ``list_records`` would. With
    10,000 mostly finished runs this reads a few records instead of all of them. A run whose last
    job went to a cluster of its own (its record's ``targets``: a profile's own SLURM_CONF,
    commands or slurmrestd) is always read: ``final`` holds this cluster's job ids, and another
    cluster's ids are other jobs."""
    d = registry_dir(environ)
    try:
        with os.scandir(d) as it:
            entries = sorted((e.name, e) for e in it if e.name.endswith(".json") and not e.name.startswith("."))
    except OSError:
        return [], 0
    heads_path = lmlaunch_home(environ) / REGISTRY_HEADS
    if not heads_path.exists():
        list_records(environ)  # once: the index and its heads
    heads = _load_heads(heads_path)
    keep: list[RunRecord] = []
    skipped = 0

    def done_long_ago(submitted: float, job: str | None, elsewhere: bool) -> bool:
        return now - submitted >= days * 86400 and job is not None and job in final and not elsewhere

    for name, entry in entries:
        try:
            st = entry.stat()
        except OSError:
            continue
        head = heads.get(name)
        elsewhere = bool(head[3]) if head is not None and len(head) > 3 else False
        if head is not None and head[0] == [st.st_ino, st.st_mtime_ns, st.st_size] and done_long_ago(head[1], head[2], elsewhere):
            skipped += 1
            continue
        rec = load_record(name[:-5], environ)  # shown, or new or changed (the file decides)
        if rec is None:
            continue
        if done_long_ago(rec.submitted_at[-1] if rec.submitted_at else 0.0, rec.last_job_id,
                         rec.target_of(rec.last_job_id) is not None):
            skipped += 1
        else:
            keep.append(rec)
    return keep, skipped


def _elsewhere(data: Mapping[str, Any]) -> bool:
    """Whether a record's (JSON) last job went to a cluster of its own."""
    try:
        return RunRecord.from_dict(data).target_of(RunRecord.from_dict(data).last_job_id) is not None
    except (TypeError, AttributeError):
        return False


def _read_json(path: Path) -> Any:
    """A cache file's JSON; None when it is missing or damaged (the caller reads the truth)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load_heads(path: Path) -> dict[str, list[Any]]:
    data = _read_json(path)
    return data if isinstance(data, dict) else {}


def _racy(mtime_ns: int, window_s: float = 2.0) -> bool:
    """A file changed within the last ``window_s``: it may change again within the file system's
    timestamp granularity without its mtime moving, so its copy is not indexed yet."""
    return time.time() - mtime_ns / 1e9 < window_s


def _load_index(path: Path) -> dict[str, list[Any]]:
    data = _read_json(path)
    entries = data.get("entries") if isinstance(data, dict) and data.get("version") == 1 else None
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items()
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and isinstance(v[1], dict)}


def _save_index(path: Path, entries: dict[str, list[Any]]) -> None:
    """The index, and its heads (what `recent_or_unfinished` needs of each entry) beside it."""
    heads = {name: [ident, (data.get("submitted_at") or [0.0])[-1], (data.get("job_ids") or [None])[-1],
                    _elsewhere(data)]
             for name, (ident, data) in entries.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
        write_private(path, json.dumps({"version": 1, "entries": entries}, separators=(",", ":")))
        write_private(path.with_name(Path(REGISTRY_HEADS).name), json.dumps(heads, separators=(",", ":")))
    except OSError:
        pass  # an index that cannot be written only costs the next call reading every entry


def run_dir_of(ref: str, environ: Mapping[str, str] | None = None) -> Path:
    """A run directory given as a path (one with a plan.json, registered or not), else the directory
    of the registry's run ``ref`` names (:func:`find_run`)."""
    p = Path(ref)
    if p.is_dir() and RunLayout.of(p).plan.is_file():
        return p
    return Path(find_run(ref, environ).run_dir)


def find_run(ref: str, environ: Mapping[str, str] | None = None) -> RunRecord:
    """A run by name, by any of its job ids, or by its run directory (a path with a ``/``: local
    runs are not in the registry). A reference that is not a valid run name names no registry
    file."""
    rec = load_record(ref, environ) if RUN_NAME.ok(ref) else None
    if rec is not None:
        return rec
    if "/" in ref and (rec := record_of_run_dir(Path(ref))) is not None:
        return rec
    records = list_records(environ)
    for r in records:
        if ref in r.job_ids:
            return r

    names = [r.name for r in records]
    local = ""
    root = (environ if environ is not None else os.environ).get("LMLAUNCH_RUNS_ROOT")
    if root and RUN_NAME.ok(ref) and RunLayout.of(Path(root) / ref).plan.is_file():
        local = f"; {Path(root) / ref} is a run directory (a local run): name it by that path"
    raise UserError(
        f"no run named or with job id {brief(ref)} in the registry ({registry_dir(environ)}), "
        f"nor a run directory with a plan.json"
        f"{did_you_mean(ref[:100], names)}; known runs: {', '.join(names) or 'none'}{local}. Local runs "
        f"(`lmlaunch run --local`) are not in the registry: give their run directory, <runs root>/<name>"
    )


def sweep_records(name: str, environ: Mapping[str, str] | None = None) -> list[RunRecord]:
    """The points of sweep ``name`` (``lmlaunch sweep``), in point order."""
    def index(r: RunRecord) -> int:
        tail = r.name.rsplit(".", 1)[-1]
        return int(tail) if tail.isdigit() else 0
    return sorted((r for r in list_records(environ) if r.sweep == name), key=index)


def record_of_run_dir(run_dir: Path) -> RunRecord | None:
    """A run given by its directory (a local run, which SLURM and the registry never saw): its
    plan names it; None when the directory holds no readable plan."""
    try:
        plan = json.loads(RunLayout.of(run_dir).plan.read_text())
        name, profile = str(plan["run_name"]), str(plan.get("profile") or "")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return RunRecord(name=name, profile=profile, run_dir=str(run_dir.resolve()), spec_path=None)


# --------------------------------------------------------------------------- run directory


def check_private(path: Path) -> None:
    """Refuse a run directory others may write into: they could plant a plan or a pickle that
    the job would execute."""
    st = path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UserError(
            f"{_what(path)} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"lmlaunch only uses private run directories: `chmod 700 {path}` if it is yours, or pick another run name"
        )
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise UserError(f"run directory {path} belongs to another user (uid {st.st_uid}); pick another run name")


def _what(path: Path) -> str:
    return f"{path.name} folder of the run directory" if path.name in SUBDIRS else "run directory"


def _mkdir_private(path: Path) -> None:
    if path.exists() and not path.is_symlink() and path.is_dir():
        check_private(path)  # an existing one others could write into may hold planted files: refuse
    elif path.is_symlink():
        raise UserError(f"{path} is a symbolic link; lmlaunch only uses real, private directories in a run directory")
    path.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
    path.chmod(PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask


def prepare_run_dir(run_dir: Path) -> bool:
    """Create the run directory tree (0700); True when this call created the run directory."""
    created = not run_dir.exists()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if created:
        _mkdir_private(run_dir)
    else:
        if not run_dir.is_dir():
            raise UserError(f"{run_dir} exists and is not a directory")
        check_private(run_dir)
    for sub in SUBDIRS:
        _mkdir_private(run_dir / sub)
    return created


def write_launch_files(plan: LaunchPlan) -> list[Path]:
    """spec.yaml, plan.json and deepspeed.json (when planned), written atomically, mode 0600."""
    import yaml

    p = plan.paths
    files = [
        (Path(p.spec_yaml), yaml.safe_dump(plan.spec, sort_keys=False)),
        (Path(p.plan_json), plan.to_json() + "\n"),
    ]
    if plan.deepspeed is not None and p.deepspeed_json:
        files.append((Path(p.deepspeed_json), json.dumps(plan.deepspeed, indent=2, sort_keys=True) + "\n"))
    for path, text in files:
        write_private(path, text)
    return [f for f, _ in files]


def archive_run_dir(run_dir: Path) -> Path:
    """Rename an old run directory out of the way (``--new``): ``<name>.archived-<time>``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.archived-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.archived-{stamp}-{n}")
    os.rename(run_dir, target)
    return target


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
