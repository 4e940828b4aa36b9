"""lmlaunch completion {bash,zsh,fish}: the shell's completion script, from argcomplete (a
maintained library that completes from the argument parsers themselves: every command, option and
choice, never a stale list):

    eval "$(lmlaunch completion bash)"                    # in ~/.bashrc
    eval "$(lmlaunch completion zsh)"                     # in ~/.zshrc
    lmlaunch completion fish | source                     # in ~/.config/fish/config.fish

The script calls `lmlaunch` back with argcomplete's variables set; launcher.cli then builds the
parser of the command being completed and answers, with the completers below attached by each
argument's name: run names (the registry) where a command takes a run, YAML files where it takes a
spec, the cluster profiles for --cluster.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from launcher.context import Context

SHELLS = ("bash", "zsh", "fish")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete for")


def run(args: argparse.Namespace, ctx: Context) -> int:
    import argcomplete

    ctx.out(argcomplete.shellcode(["lmlaunch"], shell=args.shell).rstrip("\n"))
    return 0


def run_names(prefix: str = "", environ: Mapping[str, str] | None = None, **_: Any) -> list[str]:
    """Registered run names starting with ``prefix`` (the registry's directory listed, nothing read)."""
    from launcher.runs.registry import registry_dir

    try:
        names = [p.name[:-5] for p in registry_dir(environ).iterdir() if p.name.endswith(".json")
                 and not p.name.startswith(".")]
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def profile_names(prefix: str = "", environ: Mapping[str, str] | None = None, **_: Any) -> list[str]:
    from launcher.spec.profiles import available_profiles

    try:
        names = list(available_profiles(os.environ if environ is None else environ))
    except Exception:  # a directory that cannot be read: complete nothing rather than fail the shell
        return []
    return sorted(n for n in names if n.startswith(prefix))


def attach(parser: argparse.ArgumentParser) -> None:
    """Set each argument's completer by its name, in ``parser`` and every subcommand's."""
    from argcomplete.completers import FilesCompleter

    specs = FilesCompleter(allowednames=("yaml", "yml"), directories=True)
    from launcher.commands import subcommands

    for sub in subcommands(parser).values():
        attach(sub)
    for action in parser._actions:
        if action.dest in ("run", "run_a", "run_b") and not action.option_strings:
            action.completer = run_names  # type: ignore[attr-defined]
        elif action.dest in ("spec", "file") and not action.option_strings:
            action.completer = specs  # type: ignore[attr-defined]
        elif action.dest == "cluster":
            action.completer = profile_names  # type: ignore[attr-defined]
