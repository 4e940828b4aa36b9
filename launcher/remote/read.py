"""The lean half of `lmlaunch --remote NAME COMMAND` (launcher.remote.forward holds the rest): which
profile a command line goes to, the ssh master, and a command that ships no file (status, logs,
history, cancel, ...) run on the login node. A workstation that forwards ``status`` pays for this
module and OpenSSH only: the profile's login section is kept in ``$LMLAUNCH_HOME/cache/`` after
the first full load (launcher.spec.profiles, which builds every spec model) and used while the
profile's file is unchanged and no other file of that name came before it. On the login node a
warm lmlaunch answers the read-only ones (launcher.remote.warm)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.context import Context
from launcher.remote import warm
from launcher.runs.home import lmlaunch_home
from lmcore.errors import UserError
from lmcore.slurm.ssh import SSH_FAILED, Connection, remote_path

REMOTE_ENV = "LMLAUNCH_REMOTE"
FORWARDED_ENV = "LMLAUNCH_FORWARDED"  # set on the login node's side: it never forwards again
NOT_FOUND = 127  # the login shell's status for a command it could not find
UNIX_PATH_MAX = 107  # sun_path's 108 bytes, the last a NUL
CONTROL_SUFFIX = 17  # ssh's temporary listener: the ControlPath + "." + 16 random characters
CACHE_VERSION = 1


@dataclass(frozen=True)
class LoginFacts:
    """A profile's validated ``login`` section (launcher.spec.profiles.Login, which owns the
    defaults and the rules), as plain data: always made from one (``Login.model_dump()``)."""

    ssh: str
    lmlaunch: str
    require_master: bool
    control_path: str
    staging: str
    workdir: str
    options: list[str]
    profile: str | None = None  # the cluster's profile for the lmlaunch there (a run over several clusters)


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


def check_control_path(control_path: str, profile_name: str) -> None:
    """A Unix socket's path holds at most 107 bytes, and ssh adds a '.' and 16 characters to it
    while the master starts; %C is 40 hex digits (ssh's other tokens: counted as written)."""
    path = os.path.expanduser(control_path).replace("%C", "x" * 40)
    if len(path.encode()) + CONTROL_SUFFIX > UNIX_PATH_MAX:
        raise UserError(f"login.control_path of cluster profile {profile_name} ({control_path}) is too long for a "
                        f"Unix socket: {len(path.encode())} bytes once expanded, at most {UNIX_PATH_MAX - CONTROL_SUFFIX}; "
                        "name a shorter directory (the default ~/.ssh/lmlaunch-%C fits most homes)")


def ensure_master(conn: Connection, login: LoginFacts, profile_name: str, ctx: Context) -> None:
    if conn.master_alive():
        return
    opener = shlex.join(conn.open_command())
    if login.require_master or not interactive(ctx):
        why = "the profile requires one (login.require_master)" if login.require_master else "no terminal to log in at"
        raise UserError(f"no ssh master connection to {login.ssh} is open ({why}): open it with\n  {opener}\n"
                        f"then run the command again (cluster profile {profile_name})")
    ctx.err(f"opening the ssh master connection to {login.ssh} (`{opener}`): log in once")
    conn.open_master()


def interactive(ctx: Context) -> bool:
    return ctx.stdout is sys.stdout and sys.stdin.isatty() and sys.stdout.isatty()


def ended_with_connection(run: str) -> str:
    """The login shell's side of a command that is not detached: it ends when the connection does
    (its stdin, held open by this side, closes), not only when it writes to a closed channel: a
    dropped `status --watch` or `logs -f` leaves no process behind on the login node."""
    # fd 3: the shell's stdin, which a background list would otherwise get as /dev/null
    return (f"exec 3<&0; {run} < /dev/null 3<&- & pid=$!; "
            "{ cat <&3 > /dev/null; kill -TERM $pid; } > /dev/null 2>&1 & w=$!; exec 3<&-; "
            "wait $pid; rc=$?; kill $w 2>/dev/null; exit $rc")


def run_there(login: LoginFacts, profile_name: str, argv: list[str], ctx: Context) -> int:
    """A command that ships nothing, run on the login node with this side's terminal (or the
    connection's end ending it); a read-only one answered by a warm lmlaunch there when one runs."""
    check_control_path(login.control_path, profile_name)
    conn = Connection(login.ssh, login.control_path, tuple(os.path.expanduser(o) for o in login.options))
    ensure_master(conn, login, profile_name, ctx)
    lm = remote_path(login.lmlaunch)
    run = f"env {FORWARDED_ENV}=1 {lm} {' '.join(shlex.quote(a) for a in argv)}"
    tty = interactive(ctx)
    line = f"exec {run}" if tty else ended_with_connection(run)
    if warm.answers(argv):
        python = f'"$(d=$(dirname {lm}); [ -x "$d/python" ] && echo "$d/python" || echo python3)"'
        line = warm.remote_command(python, line, argv, [f"{FORWARDED_ENV}=1"])
    code = conn.stream(line, ctx.stdout, ctx.stderr, tty=tty, passthrough=tty)
    return said(code, login, profile_name, ctx, submitting=False)


def said(code: int, login: LoginFacts, profile_name: str, ctx: Context, *, submitting: bool) -> int:
    """The login node's exit status, with what lmlaunch can say of ssh's and the shell's own."""
    if code == NOT_FOUND:
        ctx.err(f"error: no {login.lmlaunch} on {login.ssh} (login.lmlaunch of cluster profile {profile_name}): "
                "install lmlaunch there (pip install 'lmlaunch[runtime]') and name its path")
    elif code == SSH_FAILED:
        ctx.err(f"error: the ssh connection to {login.ssh} failed or dropped (ssh exit {SSH_FAILED}); "
                + ("the submission goes on there if it had started: `lmlaunch --remote "
                   f"{profile_name} status` shows it" if submitting else "run the command again"))
    return code


# --------------------------------------------------------------------------- the login section, kept
def _cache_file(environ: dict[str, str], name: str) -> Path:
    return lmlaunch_home(environ) / "cache" / f"login-{name}.json"


def remember_login(environ: dict[str, str], name: str, login: dict[str, object]) -> None:
    """After a full load: the login section and the files it came from, for the lean path."""
    from launcher.spec.profiles import profile_dirs
    from lmcore.atomic import write_private

    candidates = [str(d / f"{name}.yaml") for d in profile_dirs(environ)]
    source = next((c for c in candidates if os.path.isfile(c)), None)
    if source is None:
        return
    st = os.stat(source)
    entry = {"version": CACHE_VERSION, "source": source, "mtime_ns": st.st_mtime_ns, "size": st.st_size,
             "before": candidates[:candidates.index(source)], "login": login}
    try:
        path = _cache_file(environ, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(entry))
    except OSError:
        pass  # the next forward loads the profile again


def cached_login(environ: dict[str, str], name: str) -> LoginFacts | None:
    """The kept login section while its profile file is unchanged and none came before it."""
    try:
        entry = json.loads(_cache_file(environ, name).read_text())
        st = os.stat(entry["source"])
        if (entry.get("version") != CACHE_VERSION or (st.st_mtime_ns, st.st_size) != (entry["mtime_ns"], entry["size"])
                or any(os.path.exists(p) for p in entry["before"])):
            return None
        return LoginFacts(**entry["login"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forward_lean(name: str, argv: list[str], ctx: Context) -> int | None:
    """A read-only command to a profile whose login section is kept: run there without loading the
    profile; None: the full path (launcher.remote.forward) decides."""
    if not warm.answers(argv) or (login := cached_login(ctx.environ, name)) is None:
        return None
    return run_there(login, name, argv, ctx)
