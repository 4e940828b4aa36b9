"""`lmlaunch`: one small module per subcommand (launcher/commands/), imported lazily.

Nothing here imports torch: status, logs, cancel, validate and dry-run stay fast.
Errors a user caused print one message and exit 2 (no traceback unless LMLAUNCH_DEBUG=1).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from launcher.commands import COMMANDS
from launcher.context import Context
from lmcore.errors import ExitCode, UserError

T = TypeVar("T")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmlaunch",
        description="Launch, watch and resume language-model training on SLURM.",
    )
    parser.add_argument("--remote", metavar="PROFILE",
                        help="run the command on the login node of this cluster profile (its login section) over "
                             "your ssh master connection; default $LMLAUNCH_REMOTE")
    parser.add_argument("--rest", metavar="PROFILE",
                        help="ask SLURM through this cluster profile's slurmrestd (its submit.url, a JWT from its "
                             "submit.token_file or $SLURM_JWT) instead of SLURM's commands here; default $LMLAUNCH_REST")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        listed: dict[str, Any] = {} if help_text == argparse.SUPPRESS else {"help": help_text}  # hidden: not in --help
        if only is not None and name != only:
            sub.add_parser(name, **listed)
            continue
        p = sub.add_parser(name, description=listed.get("help"), **listed)
        mod = _load(module)
        if mod is not None:
            mod.add_arguments(p)
    return parser


def _load(module: str):
    try:
        return importlib.import_module(f"launcher.commands.{module}")
    except ModuleNotFoundError as exc:
        if exc.name == f"launcher.commands.{module}":
            return None
        raise


def main(argv: Sequence[str] | None = None, ctx: Context | None = None) -> int:
    ctx = ctx or Context.default()
    ctx.entry = ctx.entry or main
    words = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("LMLAUNCH_DEBUG") == "1"
    if (words and words[0].startswith("--remote")) or ctx.environ.get("LMLAUNCH_REMOTE"):
        forwarded = _reported(lambda: _forward(words, ctx), ctx, debug)
        if isinstance(forwarded, int):
            return forwarded
        words = forwarded
    # Only the chosen subcommand's module is imported (fast start).
    chosen = next((a for a in words if not a.startswith("-")), None)
    if chosen == "profile":  # `profile RUN` is `profile run RUN` (torch.profiler); `profile init NAME` stays
        at = words.index("profile")
        following = words[at + 1:at + 2]
        if following and following[0] not in ("init", "run", "-h", "--help"):  # RUN, or its options first
            words = [*words[:at + 1], "run", *words[at + 1:]]
    parser = build_parser(only=chosen if chosen in COMMANDS else None)
    # Dotted overrides may follow options (`submit job.yaml --dry-run nodes=2`): argparse
    # leaves positionals after an option unparsed, so they join the overrides here.
    args, extra = parser.parse_known_args(words)
    if extra:
        if hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not args.command:
        parser.print_help(ctx.stdout)
        return ExitCode.USAGE
    mod = _load(COMMANDS[args.command][0])
    if mod is None:
        ctx.err(f"lmlaunch {args.command}: not available in this build")
        return ExitCode.FAILURE
    def run() -> int:
        with _transport(args, ctx):
            code = int(mod.run(args, ctx) or 0)
        ctx.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code

    try:
        return _reported(run, ctx, debug)
    except BrokenPipeError:
        # `lmlaunch submit ... --dry-run | head -1`: the reader is gone; end quietly, as `cat` does.
        _silence_stdout(ctx)
        return ExitCode.BROKEN_PIPE
    except Exception as exc:  # a bug, not the user's doing: one line unless debugging
        if debug:
            raise
        ctx.err(
            f"error: lmlaunch {args.command} failed unexpectedly: {type(exc).__name__}: "
            f"{_short(str(exc))} (LMLAUNCH_DEBUG=1 shows the traceback)"
        )
        return ExitCode.FAILURE


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _silence_stdout(ctx: Context) -> None:
    """Point stdout at /dev/null so the interpreter's final flush raises nothing."""
    if ctx.stdout is sys.stdout:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass


def _reported(call: Callable[[], T], ctx: Context, debug: bool) -> T | int:
    """``call()``, a user's error printed as one line (its exit status) and Ctrl-C as INTERRUPTED."""
    try:
        return call()
    except UserError as exc:
        if debug:
            raise
        ctx.err(f"error: {exc.message}")
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


# The commands about a run that ask SLURM through slurmrestd when the run was submitted so (the
# others, e.g. preempt, stacks and profile, need SLURM's commands on the cluster: `--rest` asks for it).
RUN_COMMANDS_THROUGH_REST = frozenset({"status", "logs", "history", "cancel", "metrics", "report"})
# ... and those that run SLURM's commands with the run's cluster's own SLURM_CONF and clients when
# its profile names them (submit.slurm_conf / slurm_bin: one login machine, several clusters).
RUN_COMMANDS_ON_ITS_CLUSTER = RUN_COMMANDS_THROUGH_REST | {"preempt", "stacks", "profile", "eval", "export"}


def _transport(args: argparse.Namespace, ctx: Context) -> Any:
    """SLURM's commands here, or a slurmrestd: ``--rest PROFILE``, else the way to the cluster of
    the profile a named run was submitted with (its slurmrestd, or its own SLURM_CONF and commands;
    launcher.spec.transport)."""
    import contextlib

    name = getattr(args, "rest", None) or ctx.environ.get("LMLAUNCH_REST")
    run = getattr(args, "run", None) if args.command in RUN_COMMANDS_ON_ITS_CLUSTER else None
    if not name and not isinstance(run, str):
        return contextlib.nullcontext()
    from launcher.spec import transport
    from lmcore.slurm.rest import RestTarget

    own = transport.run_target(run, ctx.environ) if isinstance(run, str) else None
    if isinstance(own, RestTarget) and args.command not in RUN_COMMANDS_THROUGH_REST:
        own = None  # these need SLURM's commands: as before, `--rest` asks for slurmrestd
    if not name:
        return transport.through(own)
    target = transport.forced_target(name, ctx.environ)
    if own is not None and own.where != target.where:
        ctx.err(f"note: run '{run}' was submitted through {own.where}; --rest {name} asks {target.where} instead")
    return transport.forced(target)


def _forward(argv: list[str], ctx: Context) -> int | list[str]:
    """`--remote NAME` / LMLAUNCH_REMOTE (launcher.remote.forward): the command's exit status on the login
    node, or the command line to run here (a command about this machine, or no remote)."""
    from launcher.remote import read as remote_read

    name, rest = remote_read.split_remote(argv, ctx.environ)
    if name is None:
        return rest
    code = remote_read.forward_lean(name, rest, ctx)  # a read-only command, its login kept: no profile load
    if code is None:
        from launcher.remote import forward as remote

        code = remote.forward(name, rest, ctx)
    return rest if code is None else code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
