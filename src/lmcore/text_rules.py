"""The one rule for every string that reaches the job script, a file name or an environment name.

Each kind of text a user writes (a run name, an environment variable name, a SLURM word, a
path, a shell line, an environment value) has one :class:`TextRule`: a pattern that must match
the *whole* string (``re.fullmatch``: Python's ``$`` also matches before a final newline, so
``^...$`` with ``re.match`` lets ``"name\\n"`` through), a length bound, and a sentence saying
what is allowed. The spec and the profile schemas use these rules and nothing else, so one
change here changes every place such a string is accepted.

Messages never echo a long or control-laden value as it is: :func:`brief` shortens it and
shows control characters escaped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

# C0 controls, DEL and C1 controls (a terminal reads \x9b as an escape sequence).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_BRIEF_LIMIT = 60


def brief(value: Any, limit: int = _BRIEF_LIMIT) -> str:
    """``repr(value)`` for a message: control characters escaped, at most ``limit`` characters
    of it shown (``'aaaa…' (5000 characters)``)."""
    if isinstance(value, str):
        text = repr(value)
        if len(text) > limit:
            return f"{text[: limit - 1]}…' ({len(value)} characters)"
        return text
    text = repr(value)
    if len(text) > limit:
        return f"{text[: limit - 1]}… ({len(text)} characters)"
    return text


def escape_controls(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\x1b``), for output
    that people read: a value holding ``\\n#SBATCH ...`` then shows on one line."""
    return CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


@dataclass(frozen=True)
class TextRule:
    """What a kind of text may hold: a full-match pattern, a length bound, words for the message."""

    what: str
    """The noun in messages: 'a run name'."""
    pattern: str
    """Must match the whole string (``re.fullmatch``)."""
    allowed: str
    """What is allowed, in words."""
    max_len: int

    def check(self, value: str) -> str:
        """``value`` when it follows the rule; ValueError naming the rule otherwise."""
        if not isinstance(value, str):
            raise ValueError(f"{brief(value)} is not {self.what}: expected text")
        if len(value) > self.max_len:
            raise ValueError(
                f"{brief(value)} is too long for {self.what}: {len(value)} characters, at most {self.max_len}"
            )
        if not re.fullmatch(self.pattern, value):
            bad = CONTROL.search(value)
            why = f" (it holds the control character {bad.group()!r})" if bad else ""
            raise ValueError(f"{brief(value)} is not {self.what}{why}: {self.allowed}")
        return value

    def ok(self, value: str) -> bool:
        try:
            self.check(value)
        except ValueError:
            return False
        return True

    @property
    def annotated(self) -> Any:
        """A pydantic type: ``name: RunName`` checks the field with this rule (pydantic imported
        here: the rules serve `status` too, which needs no pydantic)."""
        from pydantic import AfterValidator

        return Annotated[str, AfterValidator(self.check)]


RUN_NAME = TextRule(
    "a valid run name",
    r"[A-Za-z0-9][A-Za-z0-9._-]*",
    "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
    64,
)
PROFILE_NAME = TextRule(
    "a valid profile name",
    r"[A-Za-z0-9][A-Za-z0-9._-]*",
    "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
    64,
)
ENV_NAME = TextRule(
    "a valid environment variable name",
    r"[A-Za-z_][A-Za-z0-9_]*",
    "letters, digits and _, not starting with a digit",
    128,
)
SLURM_WORD = TextRule(
    "a SLURM name",
    r"[A-Za-z0-9_.,&|:*\[\]-]+",
    "letters, digits and _ . , & | : * [ ] - (what SLURM accepts here)",
    256,
)
MEM_SIZE = TextRule(
    "a SLURM memory size",
    r"[1-9][0-9]{0,12}[KMGT]?",
    "a whole number with an optional unit K, M, G or T, e.g. 64G or 500M",
    16,
)
GRES_NAME = TextRule("a GRES name", r"[A-Za-z0-9_.:-]+", "letters, digits and _ . : -", 64)
IDENTIFIER = TextRule(
    "a config attribute name", r"[A-Za-z_][A-Za-z0-9_]*", "letters, digits and _, not starting with a digit", 128
)
PATH = TextRule(
    "a usable path", r"(?![A-Za-z][A-Za-z0-9+.-]*://)[^\x00-\x1f\x7f-\x9f]+",
    "a filesystem path, non-empty, with no line breaks or control characters; not a URL (s3://, https://...: "
    "lmlaunch reads and writes files only, and would take it for a local directory)", 4096
)
ONE_LINE = TextRule(
    "one line of text", r"[^\x00-\x08\x0a-\x1f\x7f-\x9f]*", "no line breaks or control characters (tabs are fine)", 4096
)
SHELL_LINE = TextRule(
    "one shell line",
    r"[^\x00-\x08\x0a-\x1f\x7f-\x9f]*",
    "one line per list item, with no control characters (tabs are fine)",
    4096,
)
# Environment values are exported shell-quoted ($'...' when they hold a line break or a tab),
# so text with line breaks is safe; NUL cannot be in the environment at all.
ENV_VALUE = TextRule(
    "an environment value",
    r"[^\x00-\x08\x0b-\x1f\x7f]*",
    "text with no control characters other than tab and line break",
    32768,
)

WEBHOOK_URL = TextRule(
    "a webhook URL",
    r"https?://[^\s\x00-\x1f\x7f-\x9f]+",
    "http:// or https:// followed by no spaces or control characters",
    2048,
)

HTTP_URL = TextRule(
    "an http(s) URL",
    r"https?://[^\s\x00-\x1f\x7f-\x9f]+",
    "http:// or https:// followed by no spaces or control characters",
    2048,
)

def check_override_text(text: str) -> None:
    """A command-line override is one line: a control character in it is an error, never cut."""
    if len(text) > 8192:
        raise ValueError(f"override {brief(text)} is too long: {len(text)} characters, at most 8192")
    bad = CONTROL.search(text)
    if bad:
        raise ValueError(
            f"override {brief(text)} holds the control character {bad.group()!r}: an override is one "
            "line of text (write values with line breaks in the spec file)"
        )


# The pydantic types of the rules, made on first use (module __getattr__): `status` and the other
# commands that validate nothing import these rules without pydantic.
_TYPES = {"RunName": RUN_NAME, "ProfileName": PROFILE_NAME, "SlurmWord": SLURM_WORD, "MemSize": MEM_SIZE,
          "PathText": PATH, "OneLine": ONE_LINE, "ShellLine": SHELL_LINE, "EnvValue": ENV_VALUE,
          "WebhookUrl": WEBHOOK_URL, "HttpUrl": HTTP_URL, "EnvName": ENV_NAME}

if TYPE_CHECKING:  # to mypy each is the str it checks
    RunName: TypeAlias = str
    ProfileName: TypeAlias = str
    SlurmWord: TypeAlias = str
    MemSize: TypeAlias = str
    PathText: TypeAlias = str
    OneLine: TypeAlias = str
    ShellLine: TypeAlias = str
    EnvValue: TypeAlias = str
    WebhookUrl: TypeAlias = str
    HttpUrl: TypeAlias = str
    EnvName: TypeAlias = str
else:
    def __getattr__(name: str) -> Any:
        rule = _TYPES.get(name)
        if rule is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = globals()[name] = rule.annotated
        return value
