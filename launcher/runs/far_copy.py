"""A run's copy on a cluster reached over SSH (a run over several clusters that names one whose
profile has a ``login`` section): its run directory there, and the copies between it and this
machine's. The one owner of rsync.

The run's home is this machine's run directory; the cluster over SSH gets a copy of it under the
runs root of its profile, on its own filesystem:

- **push** (before an attempt there): the run directory without its checkpoints, then its newest
  complete checkpoint into a temporary directory there, checked against the checksums its
  COMPLETE manifest records (by that machine's lmlaunch, ``lmlaunch _checkpoint``), and only then
  renamed to its ``step-S`` name. A copy whose checksums differ is removed and the move abandoned.
- **pull** (while and after an attempt there): its files back (logs, metrics, markers: those newer
  there), its ledger merged line by line into this one (append-only on both sides: the lines there
  that this one lacks, in their order), and, when asked, its newest complete checkpoint, checked
  here the same way before it takes its name.

Commands there run in its login shell over the user's master connection (``login``: the ssh
command line up to the destination, lmcore.slurm.ssh). With ``login`` empty the other directory is on
this machine (another filesystem): the same copies, without ssh.
"""

from __future__ import annotations

import fcntl
import json
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.errors import UserError
from lmcore.run import checkpoint_index, run_layout

COPY_TIMEOUT_S = 3600.0  # a checkpoint over a slow link; a hang guard, not a figure
COMMAND_TIMEOUT_S = 120.0
# Never copied either way: this side's watcher; the checkpoints (the newest one travels on its own); what
# the jobs keep by job id (submitit's files, the rendezvous, the task records: the other cluster numbers its
# jobs on its own, and its job 7 is not this one's). submitit's files come back under submitit/on-<cluster>/.
_BY_JOB = ("/" + run_layout.SUBMITIT + "/", "/rendezvous/", f"/{run_layout.LOGS}/tasks/", "/slurm-relay/",
           "/" + run_layout.RESTART_IN_PLACE)
PUSH_EXCLUDES = ("/" + run_layout.MOVER_LOCK, f"/{run_layout.LOGS}/{run_layout.MOVER_LOG}", ".step-*.tmp", *_BY_JOB)
# never copied back: what this side owns (the ledger is merged, the plan and spec are this side's); DONE is
# written here by the watcher once the job there ended and everything is here (launcher.submit.watcher)
PULL_EXCLUDES = (*PUSH_EXCLUDES, "/" + run_layout.LEDGER, "/" + run_layout.CODE_DIR, "/" + run_layout.SPEC_YAML,
                 "/" + run_layout.PLAN, "/" + run_layout.DEEPSPEED_JSON, "/" + run_layout.DONE, "/" + run_layout.COPY_ID)


class CopyFailed(UserError):
    """A copy that did not arrive whole: rsync failed, or the files differ from their checksums."""


@dataclass(frozen=True)
class FarRun:
    """Where a run's copy is on a cluster reached over SSH, and how to reach it."""

    cluster: str  # this machine's profile name of that cluster (messages)
    login: tuple[str, ...]  # ssh ... DESTINATION (never prompting); (): a directory on this machine
    run_dir: str  # the copy's directory there (absolute)
    lmlaunch: str  # the lmlaunch command there
    profile: str  # the profile lmlaunch uses there
    checkpoints: str = run_layout.CHECKPOINTS  # the checkpoint directory, relative to the run directory

    def to_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "login": list(self.login), "run_dir": self.run_dir,
                "lmlaunch": self.lmlaunch, "profile": self.profile, "checkpoints": self.checkpoints}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FarRun:
        return cls(str(d["cluster"]), tuple(str(w) for w in d.get("login") or ()), str(d["run_dir"]),
                   str(d.get("lmlaunch") or "lmlaunch"), str(d.get("profile") or d["cluster"]),
                   str(d.get("checkpoints") or run_layout.CHECKPOINTS))

    @property
    def where(self) -> str:
        return f"{self.login[-1]}:{self.run_dir}" if self.login else self.run_dir

    @property
    def runs_root(self) -> str:
        return str(Path(self.run_dir).parent)

    def shell(self, command: str, *, timeout: float = COMMAND_TIMEOUT_S,
              input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``command`` in the shell there (here: ``bash -c``), ``input`` on its stdin."""
        argv = [*self.login, command] if self.login else ["bash", "-c", command]
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input,
                                  stdin=subprocess.DEVNULL if input is None else None)
        except subprocess.TimeoutExpired:
            raise CopyFailed(f"{self.cluster}: `{command[:200]}` did not answer within {timeout:.0f} s") from None
        except OSError as exc:
            raise CopyFailed(f"{self.cluster}: `{argv[0]}` could not be started: {exc}") from None

    def lmlaunch_argv(self, *words: str) -> str:
        """A command line of lmlaunch there, with this run's runs root; it is on that cluster's login node
        (LMLAUNCH_FORWARDED, as `--remote` marks it): its SLURM commands run where it is."""
        return (f"LMLAUNCH_FORWARDED=1 LMLAUNCH_RUNS_ROOT={shlex.quote(self.runs_root)} {self.lmlaunch} "
                f"{shlex.join(words)}")

    def _side(self, path: str) -> str:
        """An rsync operand of ``path`` there."""
        return f"{self.login[-1]}:{path}" if self.login else path

    def _rsync(self, *args: str) -> None:
        argv = ["rsync", "-a", *(["-e", shlex.join(self.login[:-1])] if self.login else []), *args]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=COPY_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise CopyFailed("rsync is not installed on this machine (Debian: apt-get install rsync)") from None
        except subprocess.TimeoutExpired:
            raise CopyFailed(f"rsync to or from {self.cluster} did not end within {COPY_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            raise CopyFailed(f"copying to or from {self.cluster} failed (rsync exit {proc.returncode}): "
                             f"{(proc.stderr or proc.stdout).strip()[-600:]}")


def resolve_root(login: Sequence[str], runs_root: str, cluster: str) -> str:
    """The runs root of a profile reached over ssh as an absolute path there (``~`` and ``$VARS``
    expanded by its login shell); made when missing."""
    if runs_root == "~":
        quoted = '"$HOME"'
    elif runs_root.startswith("~/"):
        quoted = '"$HOME"/' + _double_quoted(runs_root[2:])
    else:
        quoted = _double_quoted(runs_root)
    probe = FarRun(cluster, tuple(login), "/", "lmlaunch", cluster)
    proc = probe.shell(f"mkdir -p {quoted} && cd {quoted} && pwd -P")
    if proc.returncode != 0 or not proc.stdout.strip().startswith("/"):
        raise CopyFailed(f"{cluster}: its runs root {runs_root} could not be made or read there: "
                         f"{(proc.stderr or proc.stdout).strip()[-400:] or f'exit {proc.returncode}'}")
    return proc.stdout.strip().splitlines()[-1]


def set_aside(far: FarRun) -> str | None:
    """An earlier run's copy of this name there renamed out of the way, as `submit --new` keeps the
    old run directory here; its new name, None when there was none."""
    kept = f"{far.run_dir}.archived-{int(time.time())}"
    proc = far.shell(f"if [ -e {shlex.quote(far.run_dir)} ]; then mv {shlex.quote(far.run_dir)} {shlex.quote(kept)} "
                     "&& echo moved; fi")
    if proc.returncode != 0:
        raise CopyFailed(f"{far.cluster}: an earlier copy {far.run_dir} could not be set aside: "
                         f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    return kept if proc.stdout.strip() == "moved" else None


def _copy_id(run_dir: Path) -> str:
    """This run directory's own id, made the first time it is asked for."""
    path = run_layout.RunLayout.of(run_dir).copy_id
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        ident = uuid.uuid4().hex
        path.write_text(ident + "\n")
        return ident


def _double_quoted(text: str) -> str:
    """``text`` in double quotes for a POSIX shell: ``$VARS`` expand, nothing else does."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'


def push(local_run_dir: Path, far: FarRun, checkpoint: Path | None) -> None:
    """The run directory to ``far`` (its checkpoints left out), then ``checkpoint`` (a complete step
    directory of it), checked there against its manifest before it takes its name. A directory of
    that name there that is not this run's copy (another run of the name, or a --new since) is set
    aside first: its checkpoints and ledger lines are not this run's."""
    ident = _copy_id(local_run_dir)
    if _far_text(far, run_layout.COPY_ID).strip() != ident:
        set_aside(far)
    made = far.shell(f"mkdir -p {shlex.quote(far.run_dir)}/{shlex.quote(far.checkpoints)} "
                     f"{shlex.quote(far.run_dir)}/{run_layout.SUBMITIT}")
    if made.returncode != 0:
        raise CopyFailed(f"{far.cluster}: could not make {far.run_dir}: {(made.stderr or made.stdout).strip()[-400:]}")
    excludes = [f"--exclude={e}" for e in (*PUSH_EXCLUDES, f"/{far.checkpoints}/")]
    far._rsync(*excludes, f"{local_run_dir}/", far._side(f"{far.run_dir}/"))
    if checkpoint is None:
        return
    name = checkpoint.name
    marker = f"{far.run_dir}/{far.checkpoints}/{name}/{checkpoint_index.COMPLETE_NAME}"
    if far.shell(f"test -e {shlex.quote(marker)}").returncode == 0:
        return  # there already, checked when it came
    temporary = f"{far.run_dir}/{far.checkpoints}/{checkpoint_index.temporary_dir_name(checkpoint_index.step_of(checkpoint))}"
    far._rsync("--delete", f"{checkpoint}/", far._side(f"{temporary}/"))
    answer = far.shell(far.lmlaunch_argv("_checkpoint", "accept", temporary, name))
    _accepted(answer, far, name)


def _accepted(answer: subprocess.CompletedProcess[str], far: FarRun, name: str) -> None:
    said = _last_json(answer.stdout)
    if said is None:
        raise CopyFailed(f"{far.cluster}: checking the copy of {name} there failed: "
                         f"{(answer.stderr or answer.stdout).strip()[-600:] or f'exit {answer.returncode}'}")
    if said.get("problems"):
        raise CopyFailed(f"the copy of checkpoint {name} on {far.cluster} does not match its checksums "
                         f"({'; '.join(said['problems'][:3])}): removed there")


def pull(local_run_dir: Path, far: FarRun, *, checkpoint: bool = False) -> str | None:
    """Its files back from ``far`` (those newer there), its ledger merged into this one; with
    ``checkpoint`` its newest complete checkpoint too, checked here: that one's name (None: none)."""
    excludes = [f"--exclude={e}" for e in (*PULL_EXCLUDES, f"/{far.checkpoints}/")]
    local_run_dir.mkdir(parents=True, exist_ok=True)
    far._rsync("--update", *excludes, far._side(f"{far.run_dir}/"), f"{local_run_dir}/")
    far._rsync("--update", far._side(f"{far.run_dir}/{run_layout.SUBMITIT}/"),
               f"{local_run_dir}/{run_layout.SUBMITIT}/on-{far.cluster}/")
    merge_ledger(run_layout.RunLayout.of(local_run_dir).ledger, _far_text(far, run_layout.LEDGER))
    if not checkpoint:
        return None
    name = newest_there(far)
    if name is None:
        return None
    into = local_run_dir / far.checkpoints
    here = into / name
    if (here / checkpoint_index.COMPLETE_NAME).exists() and checkpoint_index.incomplete_reason(here) is None \
            and not checkpoint_index.verify(here):
        return name  # here already, and whole
    temporary = into / checkpoint_index.temporary_dir_name(checkpoint_index.step_of(Path(name)))
    temporary.parent.mkdir(parents=True, exist_ok=True)
    far._rsync("--delete", far._side(f"{far.run_dir}/{far.checkpoints}/{name}/"), f"{temporary}/")
    problems = accept(temporary, str(name))
    if problems:
        raise CopyFailed(f"the copy of checkpoint {name} from {far.cluster} does not match its checksums "
                         f"({'; '.join(problems[:3])}): removed here")
    return str(name)


def newest_there(far: FarRun) -> str | None:
    """The name of the newest complete checkpoint of the run's copy on ``far`` (None: none), asked
    there (``lmlaunch _checkpoint newest``); :class:`CopyFailed` when it cannot be asked."""
    answer = far.shell(far.lmlaunch_argv("_checkpoint", "newest", f"{far.run_dir}/{far.checkpoints}"))
    said = _last_json(answer.stdout)
    if said is None:
        raise CopyFailed(f"{far.cluster}: could not list its checkpoints: "
                         f"{(answer.stderr or answer.stdout).strip()[-600:]}")
    name = said.get("newest")
    return name if isinstance(name, str) and checkpoint_index.STEP_RE.fullmatch(name) else None


def _last_json(text: str) -> dict[str, Any] | None:
    """The JSON object on the last line of an answer, None when there is none."""
    try:
        said = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return said if isinstance(said, dict) else None


def done_there(far: FarRun) -> str | None:
    """The DONE marker of the copy (its text), None while it has none."""
    proc = far.shell(f"cat {shlex.quote(far.run_dir)}/{run_layout.DONE}")
    return proc.stdout if proc.returncode == 0 else None


def _far_text(far: FarRun, rel: str) -> str:
    proc = far.shell(f"cat {shlex.quote(far.run_dir)}/{shlex.quote(rel)} 2>/dev/null || true")
    if proc.returncode != 0:
        raise CopyFailed(f"{far.cluster}: could not read {rel} there: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def merge_ledger(path: Path, other: str) -> int:
    """The lines of ``other`` (the copy's ledger) that ``path`` lacks, appended in their order (a
    torn last line left out); how many."""
    lines = other.splitlines()
    if other and not other.endswith("\n"):
        lines = lines[:-1]  # being written there
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:  # one merge at a time (the watcher, history, logs, a search's driver)
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        have = set(f.read().splitlines())
        new = [line for line in lines if line.strip() and line not in have]
        if new:
            f.write("".join(line + "\n" for line in new))
    return len(new)


def accept(temporary: Path, name: str) -> list[str]:
    """A copied step directory checked against its COMPLETE manifest: renamed to ``name`` beside it
    when whole (an older copy of that name replaced), removed otherwise; what is wrong."""
    if not (temporary / checkpoint_index.COMPLETE_NAME).exists():
        problems = [f"{checkpoint_index.COMPLETE_NAME}: missing (not a complete checkpoint)"]
    else:
        problems = checkpoint_index.verify(temporary)
    if problems:
        shutil.rmtree(temporary, ignore_errors=True)
        return problems
    final = temporary.parent / name
    if final.exists():
        shutil.rmtree(final)
    temporary.rename(final)
    if newest(final.parent) == name:  # the hint lmtrain keeps beside its checkpoints
        (final.parent / checkpoint_index.LATEST_NAME).write_text(f"{name}\n")
    return []


def newest(checkpoint_dir: Path) -> str | None:
    """The name of the newest complete checkpoint in ``checkpoint_dir`` (None: none)."""
    found, _ = checkpoint_index.scan(checkpoint_dir)
    return found[-1].path.name if found else None


def of_record(rec: Any, job_id: str | None) -> FarRun | None:
    """Where the copy of a run's job ``job_id`` is (a registry record's), None: the job went to a
    cluster reached from here."""
    if not job_id:
        return None
    data = (rec.targets.get(rec.profile_of(job_id)) or {}).get("far")
    try:
        return FarRun.from_json(data) if isinstance(data, dict) else None
    except (KeyError, TypeError, ValueError):
        return None


def refresh(rec: Any, *, checkpoint: bool = False) -> str | None:
    """Before reading a run whose last job went to a cluster over SSH: its files brought back (the
    ledger merged; with ``checkpoint`` its newest checkpoint too). What went wrong, or None (also
    for a run on a cluster reached from here)."""
    far = of_record(rec, rec.last_job_id)
    if far is None:
        return None
    try:
        pull(Path(rec.run_dir), far, checkpoint=checkpoint)
    except CopyFailed as exc:
        return f"its copy on {far.where} could not be read ({exc.message})"
    return None


def put_marker(rec: Any, job_id: str, name: str) -> None:
    """A marker file of this run directory (CANCELLED) written into the copy of ``job_id``'s cluster
    over SSH too, before its job is signalled (its ranks read it there)."""
    far = of_record(rec, job_id)
    if far is None:
        return
    data = (Path(rec.run_dir) / name).read_text()
    proc = far.shell(f"cat > {shlex.quote(f'{far.run_dir}/{name}')}", input=data)
    if proc.returncode != 0:
        raise CopyFailed(f"{far.cluster}: could not write {name} into {far.where}: {proc.stderr.strip()[-400:]}")
