"""The command environment (streams, process env), injectable so tests can capture it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Context:
    stdout: TextIO
    stderr: TextIO
    environ: dict[str, str] = field(default_factory=dict)
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter running lmlaunch; what a profile's ``python: auto`` resolves to."""
    entry: Callable[[list[str], Context], int] | None = None
    """The CLI's own entry (launcher.cli.main), for a long-lived command that answers other
    command lines in-process (launcher.remote.warm)."""

    @classmethod
    def default(cls) -> Context:
        return cls(stdout=sys.stdout, stderr=sys.stderr, environ=dict(os.environ))

    def out(self, text: str = "") -> None:
        print(text, file=self.stdout)

    def err(self, text: str) -> None:
        print(text, file=self.stderr)
