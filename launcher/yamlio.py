"""Safe YAML loading that remembers the line of every key.

Only plain YAML is accepted (``yaml.SafeLoader``): tags such as ``!!python/object`` are an
error, never an object. Each mapping key's line is recorded against its dotted key path so
that schema errors can say ``resources.nodes (line 7)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import SpecError


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


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
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
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping  # type: ignore[arg-type]
)


def _record_lines(node: yaml.Node, path: tuple, lines: dict) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            sub = path + (key,)
            lines[sub] = key_node.start_mark.line + 1
            _record_lines(value_node, sub, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = path + (i,)
            lines[sub] = item.start_mark.line + 1
            _record_lines(item, sub, lines)


def load_yaml_text(text: str, source: str) -> LoadedYaml:
    """Parse YAML text safely; errors name the source and line."""
    try:
        node = yaml.compose(text, Loader=_LineLoader)
        data = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - _LineLoader is a SafeLoader
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
    lines: dict = {}
    if node is not None:
        _record_lines(node, (), lines)
    return LoadedYaml(data=data, source=source, lines=lines)


def parse_scalar(text: str) -> Any:
    """A command-line value read like a YAML value in a file (``4`` -> 4, ``4:00:00`` stays text).

    Anything that is not a plain scalar or flow list/mapping (a tag, broken YAML) stays text.
    """
    if not text.strip():
        return ""
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - _LineLoader is a SafeLoader
    except yaml.YAMLError:
        return text


def load_yaml_file(path: str | Path) -> LoadedYaml:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"file not found: {p}"]) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise SpecError([f"cannot read {p}: {exc}"]) from None
    return load_yaml_text(text, str(p))
