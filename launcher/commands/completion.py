"""lmlaunch completion {bash,zsh,fish}: the shell's completion script, from argcomplete (a
maintained library that completes from the argument parsers themselves: every command, option and
choice, never a stale list):

    eval "$(lmlaunch completion bash)"                    # in ~/.bashrc
    eval "$(lmlaunch completion zsh)"                     # in ~/.zshrc
    lmlaunch completion fish | source                     # in ~/.config/fish/config.fish

The script calls `lmlaunch` back with argcomplete's variables set; launcher.cli then builds every
parser and answers: run names (the registry) where a command takes a run, YAML files where it takes
a spec (launcher.completers).
"""

from __future__ import annotations

import argparse

from launcher.context import Context

SHELLS = ("bash", "zsh", "fish")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete for")


def run(args: argparse.Namespace, ctx: Context) -> int:
    import argcomplete

    ctx.out(argcomplete.shellcode(["lmlaunch"], shell=args.shell).rstrip("\n"))
    return 0
