"""Which way a command reaches SLURM, and which cluster: the commands, or its slurmrestd.

- ``lmlaunch --rest PROFILE COMMAND`` (or $LMLAUNCH_REST): everything the command asks of SLURM
  goes through that profile's slurmrestd (its ``submit.url``).
- A profile with ``submit.via: rest``: a run submitted with it is submitted through slurmrestd,
  and the commands about that run (status, logs, history, cancel) ask through it too (the run's
  registry record names its profile).
- A profile with ``submit.slurm_conf`` / ``submit.slurm_bin`` (one login machine, several
  clusters): a run submitted with it, and the commands about it, run SLURM's commands with that
  cluster's configuration and clients.
- A profile with a ``login`` section named in a run over several clusters: SLURM's commands run
  on its login node over the user's ssh master connection (lmcore.slurm.ssh), and the run's attempts
  there are submitted by the lmlaunch there, on a copy of the run directory
  (launcher.runs.far_copy). A process that was itself forwarded there (``LMLAUNCH_FORWARDED``) is
  on that login node: its commands run where it is.
- Otherwise SLURM's commands on this machine, as always.

lmcore.slurm.client does the asking either way (``through_rest``, ``through_commands``); this
module only chooses.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmcore.errors import UserError
from lmcore.slurm import client as slurm, way as slurm_way
from lmcore.slurm.commands_target import CommandsTarget
from lmcore.slurm.rest import RestTarget
from lmcore.slurm.ssh import Connection

if TYPE_CHECKING:  # `status` reads the registry's recorded targets: no pydantic/yaml import on that path
    from launcher.spec.profiles import Profile

Target = RestTarget | CommandsTarget  # a cluster's slurmrestd, or its own SLURM_CONF and commands


def forced_target(name: str, environ: Mapping[str, str] | None = None) -> RestTarget:
    """``--rest NAME``: that profile's slurmrestd (its submit.url is required)."""
    from launcher.spec.profiles import load_profile

    target = load_profile(name, environ).submit.rest_target(name)
    if target is None:
        raise UserError(f"--rest {name}: profile '{name}' names no slurmrestd (its submit.url); add "
                        "submit: {url: http://HOST:6820, token_file: ~/.slurm-token}")
    return target


def profile_target(profile: Profile) -> Target | None:
    """The profile's slurmrestd when its runs are submitted through it (submit.via: rest); its own
    SLURM_CONF and commands when it names them; None: the defaults."""
    if profile.submit.via == "rest":
        return profile.submit.rest_target(profile.name)
    if profile.login is not None and os.environ.get("LMLAUNCH_FORWARDED") != "1":  # paths of that machine, as written
        return CommandsTarget(profile.submit.slurm_conf, profile.submit.slurm_bin, profile.name, login_argv(profile))
    return profile.submit.commands_target(profile.name)


def login_argv(profile: Profile) -> tuple[str, ...]:
    """ssh ... DESTINATION for the profile's login node: over the master connection, never prompting."""
    return tuple(connection(profile).argv("")[:-1])


def connection(profile: Profile) -> Connection:
    assert profile.login is not None
    login = profile.login
    return Connection(login.ssh, login.control_path, tuple(os.path.expanduser(o) for o in login.options))


def run_target(run: str | None, environ: Mapping[str, str] | None = None) -> Target | None:
    """The way to the cluster of the profile a named run (or sweep) was submitted with, when it is
    not the default one."""
    if not run:
        return None
    from launcher.runs import registry

    try:
        points = registry.sweep_records(run, environ)  # a sweep: its points' profile
        rec = points[0] if points else registry.find_run(run, environ)  # a run name or one of its job ids
    except (UserError, OSError, ValueError):
        return None  # the command says what it cannot find
    if not rec.profile:
        return None
    return run_profile_target(rec.profile_of(rec.job_ids[-1]) if rec.job_ids else rec.profile, environ)


def run_profile_target(name: str, environ: Mapping[str, str] | None = None) -> Target | None:
    """The way to the cluster of profile ``name`` (a job of a run submitted with it); a profile
    gone since: the defaults."""
    try:
        from launcher.spec.profiles import load_profile

        return profile_target(load_profile(name, environ))
    except UserError:
        return None


def target_json(target: Target | None) -> dict[str, Any] | None:
    """A way to SLURM as the registry records it with a run's jobs (never a token, only where it is)."""
    if target is None:
        return None
    return {"via": "rest" if isinstance(target, RestTarget) else "commands", **target.to_json()}


def recorded(profile: Profile) -> dict[str, dict[str, Any]]:
    """A registry record's ``targets`` for jobs submitted with ``profile``."""
    target = target_json(profile_target(profile))
    return {profile.name: target} if target is not None else {}


def target_from_json(data: Mapping[str, Any] | None) -> Target | None:
    """:func:`target_json`'s inverse; None for None or a record it cannot read."""
    if not data:
        return None
    try:
        return RestTarget.from_json(dict(data)) if data.get("via") == "rest" else CommandsTarget.from_json(dict(data))
    except (KeyError, TypeError, ValueError):
        return None


def by_cluster(records: Sequence[Any], environ: Mapping[str, str] | None = None) -> list[tuple[Target | None, list[int]]]:
    """``records`` (registry records) grouped by the cluster of each one's last job, as recorded
    when it was submitted (no profile is read: `status` stays light), in order of first
    appearance: each group's way to SLURM and the indices of its records."""
    groups: dict[str, tuple[Target | None, list[int]]] = {}
    for i, rec in enumerate(records):
        target = target_from_json(rec.target_of(rec.last_job_id))
        groups.setdefault(repr(target), (target, []))[1].append(i)  # two profiles of one cluster: one group
    return list(groups.values())


def job_target(rec: Any, job_id: str | None, environ: Mapping[str, str] | None = None) -> Target | None:
    """The way to the cluster a run's job went to: its profile's now, or as recorded when the
    profile is gone (a job id of one cluster is another job on the next: never the default's)."""

    return profile_job_target(rec, rec.profile_of(job_id) if job_id else rec.profile, environ)


def profile_job_target(rec: Any, prof: str, environ: Mapping[str, str] | None = None) -> Target | None:
    """The way to the cluster of profile ``prof``, for a run's jobs that went there: its profile's
    now, or as recorded when the profile is gone."""
    from launcher.spec.profiles import load_profile

    try:
        return profile_target(load_profile(prof, environ))
    except UserError:
        return target_from_json(rec.targets.get(prof))


def active_jobs_of(rec: Any, environ: Mapping[str, str] | None = None) -> list[tuple[str, Any]]:
    """The run's jobs still queued or running, each asked on the cluster it was submitted to (a
    job id of one cluster is another job on the next): (profile, squeue's record) pairs."""
    out = []
    for prof, ids in rec.jobs_by_profile().items():
        with through(job_target(rec, ids[-1], environ), exactly=True):
            out += [(prof, j) for j in slurm.active_jobs(ids)]
    return out


_FORCED: contextvars.ContextVar[bool] = contextvars.ContextVar("lmlaunch_forced_rest", default=False)


@contextlib.contextmanager
def forced(target: RestTarget) -> Iterator[slurm_way.Way]:
    """``--rest PROFILE``: every SLURM call of the command through that slurmrestd, whatever run
    or cluster it is about."""
    token = _FORCED.set(True)
    try:
        with slurm.through_rest(target):
            yield slurm_way.way()
    finally:
        _FORCED.reset(token)


def for_command(run: str | None, rest_name: str | None, environ: Mapping[str, str], *, rest_answers: bool,
                say: Callable[[str], None]) -> contextlib.AbstractContextManager[slurm_way.Way]:
    """The way to SLURM for one command: ``--rest NAME`` (every call through that slurmrestd), else
    the way to the cluster the named ``run`` was submitted to: its own SLURM_CONF and commands, or its
    slurmrestd where the command can be answered through one (``rest_answers``; the others need
    SLURM's commands: as before, ``--rest`` asks for slurmrestd)."""
    own = run_target(run, environ) if run else None
    if isinstance(own, RestTarget) and not rest_answers:
        own = None
    if not rest_name:
        return through(own)
    target = forced_target(rest_name, environ)
    if own is not None and own.where != target.where:
        say(f"note: run '{run}' was submitted through {own.where}; --rest {rest_name} asks {target.where} instead")
    return forced(target)


def reached_over_ssh(target: Target | None) -> bool:
    """``target`` is a cluster whose SLURM commands run on its login node, over SSH."""
    return isinstance(target, CommandsTarget) and bool(target.login)


@contextlib.contextmanager
def through(target: Target | None, *, exactly: bool = False) -> Iterator[slurm_way.Way]:
    """Within: SLURM through ``target``: its slurmrestd, or its own SLURM_CONF and commands. None
    changes nothing, unless ``exactly``: then it is this machine's default cluster even within a
    command about another (a run whose jobs went to several). ``--rest`` wins over all."""
    if _FORCED.get() or (target is None and not exactly):
        yield slurm_way.way()
        return
    if isinstance(target, RestTarget):
        with slurm.through_rest(target):
            yield slurm_way.way()
        return
    commands = target or CommandsTarget()  # None, exactly: the shell's own SLURM_CONF and PATH
    _check_commands_target(commands)
    with slurm.without_rest(), slurm.through_commands(commands):
        yield slurm_way.way()


def _check_commands_target(target: CommandsTarget) -> None:
    """A profile's slurm_conf that is not a file, or slurm_bin that is not a directory, is said
    by name before SLURM's commands fail in their own words."""
    if target.login:
        return  # paths on its login node
    if target.conf and not os.path.isfile(target.conf):
        raise UserError(f"profile '{target.profile}': submit.slurm_conf {target.conf} is not a file "
                        "(the cluster's slurm.conf on this machine)", exit_code=2)
    if target.bin and not os.path.isdir(target.bin):
        raise UserError(f"profile '{target.profile}': submit.slurm_bin {target.bin} is not a directory "
                        "(where that cluster's sbatch, squeue, ... are)", exit_code=2)
