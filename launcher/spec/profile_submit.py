"""A cluster profile's ``submit`` section: SLURM's commands here, or its REST API (slurmrestd)."""

from __future__ import annotations

import os
import re

from pydantic import field_validator, model_validator

from lmcore.job.strict_model import StrictModel
from lmcore.slurm.commands_target import CommandsTarget
from lmcore.slurm.rest import RestTarget, Via
from lmcore.text_rules import OneLine, PathText, SlurmWord, brief


class Submission(StrictModel):
    """How lmlaunch reaches this cluster's SLURM: its commands (sbatch, squeue, ...) on this
    machine, or slurmrestd's REST API with a JWT (lmcore.slurm.rest), e.g. from a portal or a
    workstation that cannot ssh to a login node."""

    via: Via = "sbatch"
    """sbatch: SLURM's commands here. rest: every submission, query and control of this cluster's runs through slurmrestd at url."""
    url: OneLine | None = None
    """slurmrestd's address, e.g. http://slurm-rest.example.org:6820 (needed by via: rest and by `lmlaunch --rest NAME`)."""
    token_file: PathText | None = None
    """A file holding the JWT (the token, or `scontrol token`'s SLURM_JWT=... line), mode 600: never printed or logged. Absent: $SLURM_JWT, else `scontrol token`."""
    user: SlurmWord | None = None
    """The user name sent with the token (X-SLURM-USER-NAME); absent: the token's own user."""
    api: OneLine | None = None
    """Pin slurmrestd's API version (e.g. v0.0.44); absent: the newest that the server offers and lmlaunch speaks."""
    slurm_conf: PathText | None = None
    """via: sbatch, a login machine that reaches several clusters: this cluster's slurm.conf (SLURM_CONF for its commands and its jobs); absent: the commands' default (or the shell's SLURM_CONF)."""
    slurm_bin: PathText | None = None
    """via: sbatch: the directory of this cluster's SLURM commands (sbatch, squeue, ...), searched before PATH; e.g. another SLURM version's clients. Absent: PATH."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", v):
            raise ValueError(f"url {brief(v)} is not an http:// or https:// address")
        return v.rstrip("/") if v else v

    @field_validator("api")
    @classmethod
    def _api(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"v\d+\.\d+\.\d+", v):
            raise ValueError(f"api {brief(v)} is not a data_parser version such as v0.0.44")
        return v

    @model_validator(mode="after")
    def _needs_url(self) -> Submission:
        if self.via == "rest" and self.url is None:
            raise ValueError("via: rest needs url (slurmrestd's address, e.g. http://host:6820)")
        if self.via == "rest" and (self.slurm_conf or self.slurm_bin):
            raise ValueError("slurm_conf and slurm_bin say how SLURM's commands reach this cluster (via: sbatch); "
                             "via: rest reaches it through url instead: remove them or set via: sbatch")
        return self

    def commands_target(self, profile: str) -> CommandsTarget | None:
        """This cluster's own SLURM_CONF and commands, or None when the defaults serve."""
        if self.slurm_conf is None and self.slurm_bin is None:
            return None
        conf = os.path.expanduser(self.slurm_conf) if self.slurm_conf else None
        return CommandsTarget(conf, os.path.expanduser(self.slurm_bin) if self.slurm_bin else None, profile)

    def rest_target(self, profile: str) -> RestTarget | None:
        """Where slurmrestd is, or None when this profile names none."""
        if self.url is None:
            return None
        token = os.path.expanduser(self.token_file) if self.token_file else None
        return RestTarget(self.url, token, self.user, self.api, profile)
