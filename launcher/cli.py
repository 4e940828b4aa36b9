"""`lmlaunch`: one small module per subcommand (launcher/commands/), imported lazily.

Nothing here imports torch: status, logs, cancel, validate and dry-run stay fast.
Errors a user caused print one message and exit with its code (lmcore.errors.ExitCode; no traceback
unless LMLAUNCH_DEBUG=1); a usage error prints the usage of the command it was made in, with a hint
where a habit of another CLI shows. Under ``--json`` an error is also JSON on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from launcher.commands import COMMANDS, subcommands
from launcher.context import Context
from lmcore.errors import ERROR_KINDS, EXIT_CODES, ExitCode, UserError

T = TypeVar("T")


class UsageProblem(Exception):
    """A command line argparse refused, with the parser (the command) it was refused by."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are raised to :func:`main` (which prints them through
    the command's context, with that command's usage) rather than printed and exited on."""

    def error(self, message: str) -> NoReturn:
        raise UsageProblem(self, message)


class _Version(argparse.Action):
    """``--version``: lmlaunch's version, and those of the Python and packages a bug report needs
    (read from the installed metadata: nothing is imported)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(version_text(), file=sys.stdout)
        parser.exit()


def version_text() -> str:
    from importlib import metadata

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return (f"lmlaunch {of('lmlaunch')} ({here})\n"
            f"python {sys.version.split()[0]} ({sys.executable})\n"
            + ", ".join(f"{p} {of(p)}" for p in ("torch", "lightning", "transformers", "submitit", "deepspeed")))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(
        prog="lmlaunch",
        description="Launch, watch and resume language-model training on SLURM.",
        epilog="exit codes: " + "; ".join(f"{int(code)} {what}" for code, what in EXIT_CODES.items()),
    )
    parser.add_argument("--version", action=_Version, help="lmlaunch's version, with its Python and main packages'")
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
    if argv is None and "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (`lmlaunch completion SHELL`)
        return _complete()
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
    try:
        args = _parse(parser, words)
    except UsageProblem as exc:
        return _usage_error(exc, words, ctx)
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

    as_json = getattr(args, "json", False) is True
    try:
        return _reported(run, ctx, debug, as_json=as_json)
    except BrokenPipeError:
        # `lmlaunch submit ... --dry-run | head -1`: the reader is gone; end quietly, as `cat` does.
        _silence_stdout(ctx)
        return ExitCode.BROKEN_PIPE
    except Exception as exc:  # a bug, not the user's doing: one line unless debugging
        if debug:
            raise
        message = (f"lmlaunch {args.command} failed unexpectedly: {type(exc).__name__}: "
                   f"{_short(str(exc))} (LMLAUNCH_DEBUG=1 shows the traceback)")
        ctx.err(f"error: {message}")
        if as_json:
            _json_error(ctx, "bug", message, ExitCode.FAILURE)
        return ExitCode.FAILURE


def _complete(exit_method: Callable[[int], Any] = os._exit) -> int:
    """argcomplete's answer to the shell: every parser built (only here: an ordinary command builds
    its own alone), each argument's completer attached by name (launcher.commands.completion)."""
    import argcomplete

    from launcher.commands import completion

    line = os.environ.get("COMP_LINE", "")[:int(os.environ.get("COMP_POINT") or 10**6)]
    words = line.split()[1:]
    chosen = next((w for w in words if not w.startswith("-")), "")
    typing_it = bool(words) and words[-1] == chosen and not line.endswith(" ")
    parser = build_parser(only=chosen if chosen in COMMANDS and not typing_it else "")  # that command's module alone
    completion.attach(parser)
    argcomplete.autocomplete(parser, exit_method=exit_method)
    return ExitCode.OK  # not asked after all (argcomplete found no completion request)


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """The arguments; a word no parser took is refused by the chosen command's parser (its usage)."""
    # Dotted overrides may follow options (`submit job.yaml --dry-run nodes=2`): argparse
    # leaves positionals after an option unparsed, so they join the overrides here.
    args, extra = parser.parse_known_args(words)
    if extra:
        if hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            _chosen_parser(parser, words).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _chosen_parser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The innermost (sub)command's parser the words name (`data prepare`'s, not `data`'s)."""
    for word in words:
        subs = subcommands(parser)
        if word in subs:
            parser = subs[word]
    return parser


def _usage_error(exc: UsageProblem, words: list[str], ctx: Context) -> int:
    """The refused command line: the usage of the command it was refused by, the error, a hint
    where a habit of another CLI shows (``--trainer.max_steps=10``); JSON too under ``--json``."""
    ctx.stderr.write(exc.parser.format_usage())
    ctx.err(f"{exc.parser.prog}: error: {exc.message}")
    hint = usage_hint(words)
    if hint:
        ctx.err(f"hint: {hint}")
    ctx.err(f"('{exc.parser.prog} --help' says more)")
    if "--json" in words:
        _json_error(ctx, "usage", exc.message + (f" (hint: {hint})" if hint else ""), ExitCode.USAGE)
    return ExitCode.USAGE


def usage_hint(words: list[str]) -> str | None:
    """What a refused command line probably meant: ``--a.b=c`` or ``--a.b c`` (the Lightning CLI's and
    Hydra's ``++a.b=c`` override habits) is the override ``a.b=c``."""
    for i, word in enumerate(words):
        name = word.lstrip("+-")
        if word[:1] not in "-+" or "." not in name.split("=")[0] or not name[:1].isalpha():
            continue
        if "=" in name:
            return f"overrides are written without dashes: {name}"
        following = words[i + 1] if i + 1 < len(words) else None
        if following is not None and not following.startswith("-"):
            return f"overrides are written without dashes, as key=value: {name}={following}"
        return f"overrides are written as key=value, without dashes: {name}=VALUE"
    return None


def _json_error(ctx: Context, kind: str, message: str, code: int, problems: list[str] | None = None) -> None:
    """An error as the one JSON document a ``--json`` command prints: ``{"ok": false, "error": ...}``."""
    import json

    ctx.out(json.dumps({"ok": False, "error": {"kind": kind, "message": message, "problems": problems or [message],
                                              "exit_code": int(code)}}, indent=2, sort_keys=True))


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


def _reported(call: Callable[[], T], ctx: Context, debug: bool, *, as_json: bool = False) -> T | int:
    """``call()``, a user's error printed as one line (its exit status; under ``as_json`` also as JSON
    on stdout) and Ctrl-C as INTERRUPTED."""
    try:
        return call()
    except UserError as exc:
        if debug:
            raise
        ctx.err(f"error: {exc.message}")
        if as_json:
            kind = ERROR_KINDS.get(exc.exit_code, "failed")
            _json_error(ctx, kind, exc.message, exc.exit_code, getattr(exc, "problems", None))
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
    launcher.planning.transport)."""
    import contextlib

    name = getattr(args, "rest", None) or ctx.environ.get("LMLAUNCH_REST")
    run = getattr(args, "run", None) if args.command in RUN_COMMANDS_ON_ITS_CLUSTER else None
    if not name and not isinstance(run, str):
        return contextlib.nullcontext()
    from launcher.planning import transport

    return transport.for_command(run if isinstance(run, str) else None, name, ctx.environ,
                                 rest_answers=args.command in RUN_COMMANDS_THROUGH_REST, say=ctx.err)


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
