"""The CLI reference (docs/cli-reference.md), generated from the argument parsers themselves, so
the documentation cannot drift from what ``lmlaunch`` accepts (tests/unit/test_docs_site.py checks
the committed page against this output)::

    python -m launcher.cli_reference -o docs/cli-reference.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from launcher.cli import build_parser

HEADER = [
    "# CLI reference",
    "",
    "Generated from lmlaunch's argument parsers by `python -m launcher.cli_reference -o docs/cli-reference.md`;",
    "do not edit by hand (a test checks it is up to date). `lmlaunch COMMAND --help` prints the same.",
    "",
]


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each listed subcommand, in the parser's order."""
    for action in parser._actions:  # argparse keeps no public list of its subcommands
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                if name in helps:  # hidden commands (argparse.SUPPRESS) have no entry
                    yield name, helps[name], sub


def _usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().split()).removeprefix("usage: ")


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        metavar = action.metavar if isinstance(action.metavar, str) else None
        name = ", ".join(action.option_strings) or metavar or action.dest
        if action.option_strings and action.nargs != 0:
            name += " " + (metavar or action.dest.upper())
        text = " ".join((action.help or "").split()).replace("|", "\\|")
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            text += f" (one of: {', '.join(map(str, action.choices))})"
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            text += f" (default: {action.default})"
        rows.append(f"| `{name}` | {text} |")
    return (["| argument | what it does |", "|---|---|", *rows, ""]) if rows else []


def _command(title: str, help_text: str, parser: argparse.ArgumentParser, level: int, out: list[str]) -> None:
    out += [f"{'#' * level} `{title}`", "", " ".join(help_text.split()), "", "```", _usage(parser), "```", ""]
    out += _options(parser)
    for name, sub_help, sub in _subparsers(parser):
        _command(f"{title} {name}", sub_help, sub, level + 1, out)


def _exit_codes() -> list[str]:
    from lmcore.errors import ERROR_KINDS, EXIT_CODES

    return ["## Exit codes and `--json`", "",
            "Every command exits with one of these; under `--json` a command prints one JSON document on "
            "stdout whether it succeeds or not: on an error `{\"ok\": false, \"error\": {\"kind\", \"message\", "
            f"\"problems\", \"exit_code\"}}}}` (kind: {', '.join(ERROR_KINDS.values())}, failed, bug), the message on "
            "stderr as well. A usage error prints the usage of the command it was made in.", "",
            "| code | meaning |", "|---|---|", *(f"| {int(c)} | {what} |" for c, what in EXIT_CODES.items()), ""]


def reference_markdown() -> str:
    parser = build_parser()
    out = list(HEADER)
    out += ["```", _usage(parser), "```", "", *_options(parser), *_exit_codes()]
    for name, help_text, sub in _subparsers(parser):
        _command(f"lmlaunch {name}", help_text, sub, 2, out)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description="write the CLI reference (docs/cli-reference.md)")
    args.add_argument("-o", "--output", help="write the page here (default: stdout)")
    ns = args.parse_args(argv)
    text = reference_markdown()
    if ns.output:
        with open(ns.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
