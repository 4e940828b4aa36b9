"""Where a cluster keeps its searches' Optuna studies (the profile's ``sweep_storage``): pure.

A search (``lmlaunch sweep SPEC SEARCH.yaml`` with ``search: optuna``) keeps its study in a
database every trial's rank 0 and the driver reach: a database server through Optuna's RDB
storage (``url``, its password in ``password_file``, never in the URL), Optuna's journal file on
the shared filesystem where a site has no database server (``journal``), or, on the local cluster,
the MariaDB its accounting runs on (``local_cluster: true``: a database and user of the sweeps'
own). An SQLite file is refused: SQLite's locking is unsafe on the shared filesystems (NFS,
Lustre) that clusters' nodes share, and a study written from several nodes at once corrupts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import model_validator

from lmcore.job.strict_model import StrictModel
from lmcore.text_rules import OneLine, PathText

# scheme://user:password@host...: the password part, masked wherever a URL is said
_PASSWORD = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@]*):(?P<pw>[^@/]*)@")
_RDB_SCHEMES = ("mysql", "mariadb", "postgresql")


def mask_password(url: str) -> str:
    """``url`` with any password replaced by ``***`` (what an error or a log may say)."""
    return _PASSWORD.sub(lambda m: f"{m.group('head')}:***@", url)


def has_password(url: str) -> bool:
    return _PASSWORD.match(url) is not None


class SweepStorage(StrictModel):
    """Where this cluster's searches keep their Optuna studies (give exactly one of url, journal, local_cluster)."""

    url: OneLine | None = None
    """A database server, as SQLAlchemy names it: mysql+pymysql://USER@HOST[:PORT]/DATABASE (MySQL, MariaDB) or postgresql://USER@HOST/DATABASE. No password in it: it goes in password_file. sqlite: is refused (unsafe on a cluster's shared filesystem: use journal)."""
    password_file: PathText | None = None
    """A file (mode 0600) holding the database password on its first line; read by the driver and by each trial's rank 0, never copied into a plan, a script or a log."""
    journal: PathText | None = None
    """Optuna's journal file on a filesystem every node sees (where no database server exists): appended under a lock, safe on NFS."""
    local_cluster: bool = False
    """The local cluster's MariaDB (the one slurmdbd uses): a database and user of the searches' own there, made at the first search."""

    @model_validator(mode="after")
    def _one(self) -> SweepStorage:
        given = [k for k in ("url", "journal", "local_cluster") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of url, journal, local_cluster (got {', '.join(given) or 'none'})")
        if self.url is not None:
            problem = url_problem(self.url)
            if problem:
                raise ValueError(f"url: {problem}")
        if self.password_file is not None and self.url is None:
            raise ValueError("password_file goes with url (a database server's password)")
        return self


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot hold a cluster search's study (None: it can). Never repeats a password."""
    shown = mask_password(url)
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme == "sqlite":
        return (f"{shown}: an SQLite file is not safe on a cluster's shared filesystem (its locks do not "
                f"hold over NFS or Lustre, and trials on several nodes write the study at once); use a "
                f"database server (url) or Optuna's journal file (journal)")
    if scheme not in _RDB_SCHEMES or "://" not in url:
        return f"{shown}: not a database URL lmlaunch takes ({', '.join(_RDB_SCHEMES)}, e.g. mysql+pymysql://user@host/db)"
    if has_password(url):
        return (f"{shown} holds a password: it would be written to every plan and log that says the URL; "
                f"put the password in password_file and leave it out of the URL")
    return None


@dataclass(frozen=True)
class StorageRef:
    """A study's storage as the driver and the trials open it: never holds a password (only the
    file that does), so it may travel in a plan."""

    kind: str  # "rdb" | "journal"
    target: str  # the URL without a password, or the journal file
    password_file: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "password_file": self.password_file}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StorageRef:
        return cls(str(d["kind"]), str(d["target"]), d.get("password_file"))

    def describe(self) -> str:
        return mask_password(self.target) if self.kind == "rdb" else f"journal {self.target}"
