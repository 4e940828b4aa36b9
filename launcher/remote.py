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
import sys
import tarfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from launcher import snapshot, warm
from launcher.context import Context
from launcher.core.errors import UserError
from launcher.core.profiles import Login, load_profile
from launcher.core.ssh import SSH_FAILED, Connection, remote_path
from launcher.core.yamlio import load_yaml_file
from launcher.jobfile import SPEC_BASE_ENV

REMOTE_ENV = "LMLAUNCH_REMOTE"
FORWARDED_ENV = "LMLAUNCH_FORWARDED"  # set on the login node's side: it never forwards again
LOCAL_ONLY = frozenset({"run", "cluster", "data", "profiles", "schema", "completion"})
SHIPS_FILES = frozenset({"validate", "doctor", "submit", "sweep", "pipeline", "notify-test"})
SHIPS_CODE = frozenset({"submit", "sweep", "pipeline"})
STAGING_MAX_AGE_MIN = 24 * 60  # an arrival left behind by a dropped connection is removed after a day
FOLLOW_INTERVAL_S = 0.1
NOT_FOUND = 127  # the login shell's status for a command it could not find
UNIX_PATH_MAX = 107  # sun_path's 108 bytes, the last a NUL
CONTROL_SUFFIX = 17  # ssh's temporary listener: the ControlPath + "." + 16 random characters


def split_remote(argv: list[str], environ: dict[str, str]) -> tuple[str | None, list[str]]:
    """The profile to forward to (``--remote NAME`` before the command, else LMLAUNCH_REMOTE;
    ``--remote ''`` runs here) and the command line without the option."""
    name = None if environ.get(FORWARDED_ENV) else (environ.get(REMOTE_ENV) or None)
    if argv and argv[0] == "--remote":
        if len(argv) < 2:
            raise UserError("--remote needs a cluster profile name (one with a login section)")
        return argv[1] or None, argv[2:]
    if argv and argv[0].startswith("--remote="):
        return argv[0].split("=", 1)[1] or None, argv[1:]
    return name, argv


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
    check_control_path(login.control_path, profile_name)
    conn = Connection(login.ssh, login.control_path, tuple(os.path.expanduser(o) for o in login.options))
    ensure_master(conn, login, profile_name, ctx)
    shipped = None
    named: dict[str, str] = {}
    args = [shlex.quote(a) for a in argv]
    if command in SHIPS_FILES:
        named, files = shipped_files(command, argv)
        if files or command in SHIPS_CODE:
            shipped = ship(conn, login, command, files, ctx)
            args = [f'"$S"/{shlex.quote(named[a])}' if a in named else shlex.quote(a) for a in argv]
    env = [f"{FORWARDED_ENV}=1"]
    if shipped is not None:  # the specs' relative paths start from login.workdir there
        env.append(f"{SPEC_BASE_ENV}={remote_path(login.workdir)}")
    if command in SHIPS_CODE:
        env.append(f'{snapshot.SHIPPED_ENV}="$S"/code')
    run = f"env {' '.join(env)} {remote_path(login.lmlaunch)} {' '.join(args)}"
    if shipped is None:
        tty = _interactive(ctx)
        line = f"exec {run}" if tty else ended_with_connection(run)
        if warm.answers(argv):  # a warm lmlaunch there (metrics serve, dashboard) answers without a start
            lm = remote_path(login.lmlaunch)
            python = f'"$(d=$(dirname {lm}); [ -x "$d/python" ] && echo "$d/python" || echo python3)"'
            line = warm.remote_command(python, line, argv, [f"{FORWARDED_ENV}=1"])
        code = conn.stream(line, ctx.stdout, ctx.stderr, tty=tty, passthrough=tty)
    else:
        code = conn.stream(detached(shipped, run), ctx.stdout, ctx.stderr, shown=as_named_here(shipped, named))
    if code == NOT_FOUND:
        ctx.err(f"error: no {login.lmlaunch} on {login.ssh} (login.lmlaunch of cluster profile {profile_name}): "
                "install lmlaunch there (pip install 'lmlaunch[runtime]') and name its path")
    elif code == SSH_FAILED:
        ctx.err(f"error: the ssh connection to {login.ssh} failed or dropped (ssh exit {SSH_FAILED}); "
                + ("the submission goes on there if it had started: `lmlaunch --remote "
                   f"{profile_name} status` shows it" if command in SHIPS_CODE else "run the command again"))
    return code


def check_control_path(control_path: str, profile_name: str) -> None:
    """A Unix socket's path holds at most 107 bytes, and ssh adds a '.' and 16 characters to it
    while the master starts; %C is 40 hex digits (ssh's other tokens: counted as written)."""
    path = os.path.expanduser(control_path).replace("%C", "x" * 40)
    if len(path.encode()) + CONTROL_SUFFIX > UNIX_PATH_MAX:
        raise UserError(f"login.control_path of cluster profile {profile_name} ({control_path}) is too long for a "
                        f"Unix socket: {len(path.encode())} bytes once expanded, at most {UNIX_PATH_MAX - CONTROL_SUFFIX}; "
                        "name a shorter directory (the default ~/.ssh/lmlaunch-%C fits most homes)")


def ensure_master(conn: Connection, login: Login, profile_name: str, ctx: Context) -> None:
    if conn.master_alive():
        return
    opener = shlex.join(conn.open_command())
    if login.require_master or not _interactive(ctx):
        why = "the profile requires one (login.require_master)" if login.require_master else "no terminal to log in at"
        raise UserError(f"no ssh master connection to {login.ssh} is open ({why}): open it with\n  {opener}\n"
                        f"then run the command again (cluster profile {profile_name})")
    ctx.err(f"opening the ssh master connection to {login.ssh} (`{opener}`): log in once")
    conn.open_master()


def _interactive(ctx: Context) -> bool:
    return ctx.stdout is sys.stdout and sys.stdin.isatty() and sys.stdout.isatty()


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


def ended_with_connection(run: str) -> str:
    """The login shell's side of a command that is not detached: it ends when the connection does
    (its stdin, held open by this side, closes), not only when it writes to a closed channel: a
    dropped `status --watch` or `logs -f` leaves no process behind on the login node."""
    # fd 3: the shell's stdin, which a background list would otherwise get as /dev/null
    return (f"exec 3<&0; {run} < /dev/null 3<&- & pid=$!; "
            "{ cat <&3 > /dev/null; kill -TERM $pid; } > /dev/null 2>&1 & w=$!; exec 3<&-; "
            "wait $pid; rc=$?; kill $w 2>/dev/null; exit $rc")


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
