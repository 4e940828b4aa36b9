"""The command environment (streams, process env), injectable so tests can capture it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO


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

    def working(self, what: str, *, quiet: bool = False) -> Any:
        """A spinner on stderr saying what runs (the model built and traced, doctor's checks, the
        probe job), with ``.update(text)`` for the next stage; where stderr is not a terminal (a pipe,
        a log, `--json`: ``quiet``) a context that shows nothing. Rich is imported only to show it."""
        if quiet or not getattr(self.stderr, "isatty", lambda: False)() or self.environ.get("TERM") == "dumb":
            return _Silent()
        from rich.console import Console

        return Console(file=self.stderr, stderr=True).status(what, spinner="dots")


class _Silent(contextlib.AbstractContextManager):
    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, *_: Any, **__: Any) -> None:
        return None
