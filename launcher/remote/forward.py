"""Commands from a workstation: `lmlaunch --remote NAME COMMAND ...` (or ``LMLAUNCH_REMOTE=NAME``)
runs COMMAND on the login node of the cluster profile NAME names (its ``login`` section), over the
user's OpenSSH master connection, with the same output and exit status it has there.

Every command keeps its one code path: the login node's lmlaunch runs it, against the cluster's
SLURM, run directories and registry; this side only carries the command line, the files it names
and the output. One ssh round trip per command (a status refresh is one ``status`` there).

- Files a command reads from this machine (the spec of ``submit``/``validate``/``doctor``/
  ``notify-test``, a sweep file, a pipeline with its stages' specs) travel first, in one archive,
  to a fresh directory under the profile's ``login.staging``; ``submit``, ``sweep`` and
  ``pipeline`` also ship this machine's code (the launcher and lmtrain packages, with what git says
  of them), which the run's code snapshot is then taken from. The sizes and time are reported.
- The login node's side runs detached from the connection, its output going to files that are
  followed over it: a connection that drops during a submission leaves the submission to finish
  there (a complete run), and one that drops while the archive travels leaves no run at all.
- Without an open master connection lmlaunch never prompts when the profile says
  ``require_master`` or nothing here is a terminal: it stops at once with the command that opens
  one. At a terminal otherwise it opens the master itself (the login's prompts, once).

Commands about this machine stay here: ``run`` (local), ``cluster``, ``data``, ``profiles``,
``schema``, ``completion``.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import tarfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from launcher.context import Context
from launcher.remote import read as remote_read
from launcher.remote.read import FORWARDED_ENV, check_control_path, ensure_master
from launcher.runs import snapshot
from launcher.spec.jobfile import SPEC_BASE_ENV
from launcher.spec.profiles import Login, load_profile
from launcher.spec.yamlio import load_yaml_file
from lmcore.errors import UserError
from lmcore.slurm.ssh import Connection, remote_path

LOCAL_ONLY = frozenset({"run", "cluster", "data", "profiles", "schema", "completion"})
SHIPS_FILES = frozenset({"validate", "doctor", "submit", "sweep", "pipeline", "notify-test"})
SHIPS_CODE = frozenset({"submit", "sweep", "pipeline"})
STAGING_MAX_AGE_MIN = 24 * 60  # an arrival left behind by a dropped connection is removed after a day
FOLLOW_INTERVAL_S = 0.1


def forward(profile_name: str, argv: list[str], ctx: Context) -> int | None:
    """Run ``argv`` on the profile's login node; None when the command runs here instead."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None or command in LOCAL_ONLY:
        return None
    profile = load_profile(profile_name, ctx.environ)
    if profile.login is None:
        raise UserError(f"cluster profile {profile_name} has no login section: add one "
                        "(login: {ssh: user@host, lmlaunch: PATH}) to reach it over ssh, or drop --remote")
    login = profile.login
    facts = remote_read.LoginFacts(**login.model_dump())
    named, files = shipped_files(command, argv) if command in SHIPS_FILES else ({}, {})
    if not files and command not in SHIPS_CODE:  # nothing travels: the lean path, its login kept for next time
        remote_read.remember_login(ctx.environ, profile_name, login.model_dump())
        return remote_read.run_there(facts, profile_name, argv, ctx)
    check_control_path(login.control_path, profile_name)
    conn = Connection(login.ssh, login.control_path, tuple(os.path.expanduser(o) for o in login.options))
    ensure_master(conn, facts, profile_name, ctx)
    shipped = ship(conn, login, command, files, ctx)
    args = [f'"$S"/{shlex.quote(named[a])}' if a in named else shlex.quote(a) for a in argv]
    env = [f"{FORWARDED_ENV}=1", f"{SPEC_BASE_ENV}={remote_path(login.workdir)}"]  # specs' relative paths: from there
    if command in SHIPS_CODE:
        env.append(f'{snapshot.SHIPPED_ENV}="$S"/code')
    run = f"env {' '.join(env)} {remote_path(login.lmlaunch)} {' '.join(args)}"
    code = conn.stream(detached(shipped, run), ctx.stdout, ctx.stderr, shown=as_named_here(shipped, named))
    return remote_read.said(code, facts, profile_name, ctx, submitting=command in SHIPS_CODE)


def shipped_files(command: str, argv: list[str]) -> tuple[dict[str, str], dict[str, Path]]:
    """The files of this machine a command reads: {argument: archive name} for the arguments
    that name a file (not options, not overrides, which hold '='), and {archive name: path}. A
    pipeline travels with its stages' specs, in the same places relative to one another."""
    named: dict[str, str] = {}
    files: dict[str, Path] = {}
    for arg in argv[argv.index(command) + 1:]:
        if arg.startswith("-") or "=" in arg or arg in named or not os.path.isfile(arg):
            continue
        top = f"files/{len(named)}"
        path = Path(arg).absolute()
        together = [path, *(_pipeline_specs(path) if command == "pipeline" else [])]
        base = Path(os.path.commonpath([p.parent for p in together]))
        for p in together:
            files[f"{top}/{p.relative_to(base).as_posix()}"] = p
        named[arg] = f"{top}/{path.relative_to(base).as_posix()}"
    return named, files


def _pipeline_specs(path: Path) -> list[Path]:
    """The stage specs a pipeline file names (relative to it), as absolute paths."""
    loaded = load_yaml_file(path, "pipeline").data
    stages = loaded.get("stages") if isinstance(loaded, dict) else None
    out: list[Path] = []
    for stage in stages if isinstance(stages, list) else []:
        spec = stage.get("spec") if isinstance(stage, dict) else None
        if not isinstance(spec, str) or not (path.parent / spec).is_file():
            continue  # the login node's lmlaunch names what is missing
        if Path(spec).expanduser().is_absolute():
            raise UserError(f"{path}: stage spec {spec!r} is an absolute path of this machine; over ssh a "
                            "pipeline's specs travel with it: name them relative to the pipeline file")
        out.append(Path(os.path.normpath(path.parent / spec)))
    return out


def archive(files: dict[str, Path], with_code: bool) -> tuple[bytes, int, int]:
    """gzip'd tar of the files (and the code); returns it, the number of files and their bytes."""
    buf = io.BytesIO()
    count = size = 0
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        entries = dict(files)
        git = None
        if with_code:
            snap, code = snapshot.current(snapshot.PACKAGES)
            entries.update({f"code/{rel}": p for rel, p in code.items()})
            git = snap.git
        for name, path in entries.items():
            tar.add(str(path), arcname=name, recursive=False)
            count += 1
            size += path.stat().st_size
        if with_code:
            data = json.dumps(git).encode()
            info = tarfile.TarInfo(f"code/{snapshot.SHIPPED_GIT}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), count, size


def ship(conn: Connection, login: Login, command: str, files: dict[str, Path], ctx: Context) -> str:
    """Send the archive to a fresh directory under ``login.staging``; returns that directory."""
    stage = f"{login.staging.rstrip('/')}/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    data, count, size = archive(files, command in SHIPS_CODE)
    staging = remote_path(login.staging)
    script = (f"S={remote_path(stage)}; mkdir -p {staging} && "
              f"find {staging} -mindepth 1 -maxdepth 1 -mmin +{STAGING_MAX_AGE_MIN} -exec rm -rf {{}} + ; "
              f'mkdir "$S" && tar -xzf - -C "$S"')
    start = time.monotonic()
    proc = conn.run(script, stdin=data, timeout=600)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise UserError(f"could not send the {command}'s files to {login.ssh}:{stage} (exit {proc.returncode}): "
                        f"{proc.stderr.decode(errors='replace').strip()[-500:]}; nothing was submitted")
    what = f"{len(files)} file(s)" + (" and this machine's code" if command in SHIPS_CODE else "")
    ctx.err(f"sent {what} to {login.ssh}:{stage}: {count} files, {size / 1e6:.2f} MB "
            f"({len(data) / 1e6:.2f} MB compressed) in {took:.2f} s")
    return stage


def as_named_here(stage: str, named: dict[str, str]) -> Callable[[str], str]:
    """Output lines with each shipped file's path on the login node as the user named it here."""
    here = {name: arg for arg, name in named.items()}
    pattern = re.compile(r"[^\s'\"]*" + re.escape(stage.rsplit("/", 1)[-1]) + r"/(files/\d+/[^\s'\":]+)")
    return lambda line: pattern.sub(lambda m: here.get(m.group(1), m.group(0)), line)


def detached(stage: str, run: str) -> str:
    """The login shell's side of a shipped command: the command runs detached from the connection
    (hang-ups ignored, output to files in the stage directory), which is followed until it ends;
    the stage directory goes with it."""
    # the files exist before their followers open them; a follower reads once more after the
    # command ended (GNU tail --pid)
    return (f"S={remote_path(stage)}; "
            ': > "$S/.out"; : > "$S/.err"; '
            f'( trap "" HUP PIPE; {run} >> "$S/.out" 2>> "$S/.err" < /dev/null; echo $? > "$S/.rc" ) & '
            "pid=$!; "
            f'tail -q -s {FOLLOW_INTERVAL_S} -n +1 --pid=$pid -f "$S/.out" & a=$!; '
            f'tail -q -s {FOLLOW_INTERVAL_S} -n +1 --pid=$pid -f "$S/.err" >&2 & b=$!; '
            'wait $pid; wait $a $b; rc=$(cat "$S/.rc" 2>/dev/null || echo 1); rm -rf "$S"; exit "$rc"')
