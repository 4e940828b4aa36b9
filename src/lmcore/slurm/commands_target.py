"""Which cluster SLURM's commands talk to: a profile's ``submit.slurm_conf`` and ``submit.slurm_bin``.

One login machine often reaches several clusters, each with its own ``slurm.conf`` (and, when
their SLURM versions differ, its own client commands): the site's modules set SLURM_CONF and
PATH per cluster. A profile says so once; a command about a run on that cluster (submit, status,
logs, history, cancel, ...) runs SLURM's commands with them, and so does the job it submits
(sbatch exports its environment to the job, whose ranks then ask their own controller).

A cluster reached through its login node (a profile's ``login`` section, in a run over several
clusters) has ``login``: the ssh command line up to its destination. Its commands then run there,
in the login shell, with its SLURM_CONF and clients (paths on that machine).

Nothing here runs a command: lmcore.slurm.client asks through the target in force
(``client.through_commands``).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Any

from lmcore.slurm.ssh import remote_path as _there  # ~/x as "$HOME"/x for the login shell there


@dataclass(frozen=True)
class CommandsTarget:
    """SLURM's commands of one cluster: its configuration file and the directory of its clients."""

    conf: str | None = None  # SLURM_CONF for the commands; None: theirs by default
    bin: str | None = None  # a directory searched before PATH for sbatch, squeue, ...; None: PATH
    profile: str = ""  # for messages
    login: tuple[str, ...] = ()  # ssh ... DESTINATION: the commands run on that login node; (): here

    def to_json(self) -> dict[str, Any]:
        return {"conf": self.conf, "bin": self.bin, "profile": self.profile,
                **({"login": list(self.login)} if self.login else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CommandsTarget:
        login = d.get("login") or ()
        if not isinstance(login, (list, tuple)) or not all(isinstance(w, str) for w in login):
            raise ValueError(f"login: not a command line: {login!r}")
        return cls(d.get("conf"), d.get("bin"), str(d.get("profile", "")), tuple(login))

    @property
    def where(self) -> str:
        parts = [f"SLURM_CONF={self.conf}"] if self.conf else []
        parts += [f"commands in {self.bin}"] if self.bin else []
        name = f"profile '{self.profile}'" if self.profile else "this cluster"
        over = f" over ssh to {self.login[-1]}" if self.login else ""
        return f"{name}'s SLURM{over} ({', '.join(parts) or 'the default configuration'})"

    def remote_argv(self, command: list[str]) -> list[str]:
        """``command`` run on the login node (``login``), in its login shell, with this cluster's
        SLURM_CONF and its clients first on that machine's PATH."""
        words = [f"SLURM_CONF={_there(self.conf)}"] if self.conf else []
        words += [f'PATH={_there(self.bin)}:"$PATH"'] if self.bin else []
        return [*self.login, " ".join([*words, shlex.join(command)])]

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this cluster's SLURM_CONF set and its commands first on PATH (unchanged
        for a cluster reached over ssh: they are that machine's paths)."""
        env = dict(base)
        if self.login:
            return env
        if self.conf:
            env["SLURM_CONF"] = os.path.expanduser(self.conf)
        if self.bin:
            directory = os.path.expanduser(self.bin)
            rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != directory]
            env["PATH"] = os.pathsep.join([directory, *rest])
        return env

    def assignments(self, base: dict[str, str]) -> list[str]:
        """``NAME=VALUE`` words for ``env(1)``: what :meth:`environ` changes, for a command line
        another program runs (submitit's sbatch)."""
        env = self.environ(base)
        return [f"{k}={env[k]}" for k in ("SLURM_CONF", "PATH") if env.get(k) != base.get(k)]
