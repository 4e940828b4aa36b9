"""Safe, bounded YAML loading that remembers the line of every key.

Only plain YAML is accepted (``yaml.SafeLoader``): tags such as ``!!python/object`` are an
error, never an object. Each mapping key's line is recorded against its dotted key path so
that schema errors can say ``resources.nodes (line 7)``.

Bounded, so that no document can hang the CLI or exhaust its memory: the file must be a
regular file of at most ``MAX_FILE_BYTES``; nesting is at most ``MAX_DEPTH`` deep (checked on
the event stream before anything recursive runs); a document may not refer to itself through
an alias, and expanded through its aliases it holds at most ``MAX_VALUES`` values (a
"billion laughs" bomb of a few hundred bytes is refused, not expanded); an integer has at most
``MAX_INT_DIGITS`` digits.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmcore.errors import ExitCode, SpecError
from lmcore.text_rules import brief, escape_controls

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 100_000
MAX_INT_DIGITS = 19  # |n| < 10**19: every integer a spec or profile means fits in 64 bits


@dataclass
class LoadedYaml:
    data: Any
    source: str
    lines: dict[tuple[str | int, ...], int] = field(default_factory=dict)

    def line_of(self, path: tuple[str | int, ...]) -> int | None:
        """Line (1-based) of the deepest known prefix of ``path``."""
        p = tuple(path)
        while p:
            if p in self.lines:
                return self.lines[p]
            p = p[:-1]
        return None


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads scalars the way people mean them.

    YAML 1.1 (PyYAML) reads ``time: 4:00:00`` as the base-60 integer 14400 and ``lr: 3e-4``
    as a string. Here a colon-separated number stays a string (a SLURM time) and a number
    with an exponent but no dot is a float (as in YAML 1.2 and JSON).
    """


# Per first character, the implicit resolvers are tried in order; the first match wins.
_LineLoader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_FLOAT_EXP = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _first in "+-0123456789":
    _LineLoader.yaml_implicit_resolvers.setdefault(_first, [])
    _LineLoader.yaml_implicit_resolvers[_first][:0] = [
        ("tag:yaml.org,2002:str", _SEXAGESIMAL),
        ("tag:yaml.org,2002:float", _FLOAT_EXP),
    ]


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key '{key}' (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


class _Limit(yaml.YAMLError):
    """A document beyond the bounds above; ``line`` is 1-based or None."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


def _construct_int(loader: _LineLoader, node: yaml.ScalarNode) -> int:
    digits = sum(c.isdigit() for c in str(node.value))
    if digits > MAX_INT_DIGITS:
        raise _Limit(
            f"the integer {brief(node.value, 30)} has {digits} digits; at most {MAX_INT_DIGITS}",
            node.start_mark.line + 1,
        )
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_LineLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _check_events(text: str) -> None:
    """Nesting depth and alias count on the event stream (iterative: no recursion to exhaust)."""
    depth = 0
    aliases = 0
    for event in yaml.parse(text, Loader=_LineLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Limit(
                    f"nesting is deeper than {MAX_DEPTH} levels of lists and mappings",
                    _line(event),
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_VALUES:
                raise _Limit(f"more than {MAX_VALUES} aliases", _line(event))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: yaml.Node) -> None:
    """The document expanded through its aliases: no cycle, at most MAX_VALUES values and
    MAX_DEPTH levels. Shared nodes are measured once (memoised), so a bomb costs its size in
    the file, not its expanded size."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            kids = _children(node)
            size[key] = min(1 + sum(size[id(c)] for c in kids), MAX_VALUES + 1)
            depth[key] = 1 + max((depth[id(c)] for c in kids), default=0)
            on_path.discard(key)
            if size[key] > MAX_VALUES:
                raise _Limit(
                    f"the document expands to more than {MAX_VALUES} values through its aliases "
                    "(&anchor / *alias); a job spec holds a few hundred",
                    node.start_mark.line + 1,
                )
            if depth[key] > MAX_DEPTH:
                raise _Limit(
                    f"nesting is deeper than {MAX_DEPTH} levels once aliases are expanded",
                    node.start_mark.line + 1,
                )
            continue
        if key in size:
            continue
        if key in on_path:
            raise _Limit(
                "an alias refers to the list or mapping that contains it (a structure that never ends)",
                node.start_mark.line + 1,
            )
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise _Limit(
                    "an alias refers to the list or mapping that contains it (a structure that never ends)",
                    child.start_mark.line + 1,
                )
            if id(child) not in size:
                stack.append((child, False))


def _bounded_load(text: str) -> tuple[yaml.Node | None, Any]:
    """Compose and construct one document within the bounds; raises _Limit or yaml.YAMLError."""
    _check_events(text)
    loader = _LineLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _check_expansion(node)
        return node, loader.construct_document(node)
    finally:
        loader.dispose()


def _line(event: yaml.Event) -> int | None:
    return event.start_mark.line + 1 if event.start_mark is not None else None


def _record_lines(root: yaml.Node, lines: dict[tuple[Any, ...], int]) -> None:
    """Line of every key path (bounded: the document passed _check_expansion)."""
    stack: list[tuple[yaml.Node, tuple[Any, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                sub = path + (key_node.value,)
                lines[sub] = key_node.start_mark.line + 1
                stack.append((value_node, sub))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = path + (i,)
                lines[sub] = item.start_mark.line + 1
                stack.append((item, sub))


def load_yaml_text(text: str, source: str) -> LoadedYaml:
    """Parse YAML text safely and within bounds; errors name the source and line."""
    if len(text) > MAX_FILE_BYTES:
        raise SpecError([f"the document is {len(text)} characters; at most {MAX_FILE_BYTES}"], source=source)
    try:
        node, data = _bounded_load(text)
    except _Limit as exc:
        where = f"line {exc.line}: " if exc.line else ""
        raise SpecError([f"{where}{exc.message}"], source=source) from None
    except RecursionError:
        raise SpecError([f"nesting is too deep (at most {MAX_DEPTH} levels)"], source=source) from None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}: " if mark else ""
        problem = exc.problem or str(exc)
        if "could not determine a constructor" in problem:
            tag = problem.split("for the tag")[-1].strip().strip("'")
            tag = tag.replace("tag:yaml.org,2002:", "!!")
            problem = (
                f"the tag '{tag}' is not allowed: only plain YAML (mappings, lists, strings, "
                "numbers, booleans) is accepted"
            )
        raise SpecError([f"{where}{problem}"], source=source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"{where}invalid YAML: {problem}"], source=source) from None
    lines: dict[tuple[Any, ...], int] = {}
    if node is not None:
        _record_lines(node, lines)
    return LoadedYaml(data=data, source=source, lines=lines)


def parse_scalar(text: str) -> Any:
    """A command-line value read like a YAML value in a file (``4`` -> 4, ``4:00:00`` stays text).

    Anything that is not a plain scalar or flow list/mapping (a tag, broken YAML) stays text.
    A value beyond the bounds (a 30-digit integer, an alias bomb) raises ValueError.
    """
    if not text.strip():
        return ""
    try:
        return _bounded_load(text)[1]
    except _Limit as exc:
        raise ValueError(exc.message) from None
    except RecursionError:
        raise ValueError(f"nesting is too deep (at most {MAX_DEPTH} levels)") from None
    except yaml.YAMLError:
        return text


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a named pipe",
    stat.S_IFSOCK: "a socket",
}


def read_text_bounded(path: str | Path, what: str = "file", limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; SpecError otherwise.

    Not-regular files (a directory, /dev/zero, a FIFO that would block) are refused before they
    are opened; every OSError (a symlink loop, a name too long) becomes one clear message.
    """
    p = Path(path)
    shown = escape_controls(str(p))
    if len(shown) > 200:
        shown = f"{shown[:120]}…{shown[-40:]} ({len(shown)} characters)"
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise SpecError([f"{what} {shown} is {kind}, not a regular file"], exit_code=ExitCode.USAGE)
        if st.st_size > limit:
            raise SpecError([f"{what} {shown} is {st.st_size} bytes; at most {limit} ({limit >> 10} KiB)"])
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise SpecError([f"{what} not found: {shown}"], exit_code=ExitCode.USAGE) from None
    except OSError as exc:
        raise SpecError([f"cannot read {what} {shown}: {exc.strerror or exc}"], exit_code=ExitCode.USAGE) from None
    if len(raw) > limit:
        raise SpecError([f"{what} {shown} is more than {limit} bytes ({limit >> 10} KiB)"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([f"{what} {shown} is not UTF-8 text (byte {exc.start})"]) from None


def load_yaml_file(path: str | Path, what: str = "file") -> LoadedYaml:
    text = read_text_bounded(path, what)
    return load_yaml_text(text, str(path))
