"""Shell words for the batch script and the dry run: a value as one quoted word on one line, and
an ``export`` line (one that keeps what the allocation already has where that is the rule)."""

from __future__ import annotations

import re
import shlex

# C0 controls and DEL: what breaks a line or a terminal in a single-quoted word.
_NEEDS_ESCAPE = re.compile(r"[\x00-\x1f\x7f]")


def shell_quote(value: str) -> str:
    """``value`` as one shell word on one line.

    Plain text is single-quoted (``shlex.quote``). Text with a line break or another control
    character is written in bash's ``$'...'`` form with the character escaped, so no value
    ever spreads the script over extra lines (a line reading ``#SBATCH ...`` inside a quoted
    value is harmless to sbatch, but not to the person reading the dry run)."""
    if not _NEEDS_ESCAPE.search(value):
        return shlex.quote(value)
    out = []
    for ch in value:
        if ch in "\\'":
            out.append("\\" + ch)
        elif _NEEDS_ESCAPE.fullmatch(ch):
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch, f"\\x{ord(ch):02x}"))
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


# Variables the allocation may already hold (a `module load` in the profile's setup, the cluster's
# own environment): the planned value comes first and the inherited one is kept after it.
INHERITED_AFTER = frozenset({"PYTHONPATH"})


def export_line(name: str, value: str) -> str:
    """``export NAME=VALUE`` for the batch script, the value shell-quoted; for a variable of
    :data:`INHERITED_AFTER` the value it already has at that point is appended (``:``-separated)."""
    line = f"export {name}={shell_quote(value)}"
    return line + f'"${{{name}:+:${name}}}"' if name in INHERITED_AFTER else line
