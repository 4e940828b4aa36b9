"""Which way a command reaches SLURM: the cluster's commands, or its slurmrestd.

- ``lmlaunch --rest PROFILE COMMAND`` (or $LMLAUNCH_REST): everything the command asks of SLURM
  goes through that profile's slurmrestd (its ``submit.url``).
- A profile with ``submit.via: rest``: a run submitted with it is submitted through slurmrestd,
  and the commands about that run (status, logs, history, cancel) ask through it too (the run's
  registry record names its profile).
- Otherwise SLURM's commands on this machine, as always.

lmcore.slurm.client does the asking either way (``through_rest``); this module only chooses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from launcher.spec.profiles import Profile, load_profile
from lmcore.errors import UserError
from lmcore.slurm import client as slurm
from lmcore.slurm.rest import RestTarget


def forced_target(name: str, environ: Mapping[str, str] | None = None) -> RestTarget:
    """``--rest NAME``: that profile's slurmrestd (its submit.url is required)."""
    target = load_profile(name, environ).submit.rest_target(name)
    if target is None:
        raise UserError(f"--rest {name}: profile '{name}' names no slurmrestd (its submit.url); add "
                        "submit: {url: http://HOST:6820, token_file: ~/.slurm-token}")
    return target


def profile_target(profile: Profile) -> RestTarget | None:
    """The profile's slurmrestd when its runs are submitted through it (submit.via: rest)."""
    return profile.submit.rest_target(profile.name) if profile.submit.via == "rest" else None


def run_target(run: str | None, environ: Mapping[str, str] | None = None) -> RestTarget | None:
    """The slurmrestd of the profile a named run (or sweep) was submitted with, when that is how it
    was submitted."""
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
    try:
        return profile_target(load_profile(rec.profile, environ))
    except UserError:
        return None  # a profile gone since: the commands' path, as before


@contextlib.contextmanager
def through(target: RestTarget | None) -> Iterator[Any]:
    """Within: SLURM through ``target``'s slurmrestd (nothing changes for None, or when the
    command already runs through one: ``--rest`` wins)."""
    if target is None or slurm.rest_client() is not None:
        yield slurm.rest_client()
        return
    with slurm.through_rest(target) as client:
        yield client
