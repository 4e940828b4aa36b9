"""Turn validation problems into messages that teach: key path, where it was written (line of
the YAML file or the command-line override), what is allowed, the closest valid key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from launcher.spec.yamlio import LoadedYaml
from lmcore.errors import closest
from lmcore.text_rules import brief, escape_controls

# A message that starts with its own key path, e.g. "trainer.zero_stage(2) needs ...".
_LEADING_PATH = re.compile(r"^([a-z_]+(?:\.[A-Za-z_0-9]+)+)")
_QUOTED = re.compile(r"'([^']*)'")


@dataclass
class Origin:
    """Where the values of a document came from: a YAML file and dotted overrides."""

    loaded: LoadedYaml | None = None
    overrides: dict[tuple[str, ...], str] = field(default_factory=dict)

    def locate(self, path: tuple[Any, ...]) -> str | None:
        """'line 7', "override 'resources.nodes=4'" or None."""
        path = tuple(path)
        # An override that set this key or one of its parents decides the value.
        for opath, text in self.overrides.items():
            if path[: len(opath)] == opath:
                return f"override '{text}'"
        if self.loaded is not None and path in self.loaded.lines:
            return f"line {self.loaded.lines[path]}"
        # The key is not in the file: an override below this path (e.g. a model-level check
        # on a section the override changed), else the closest enclosing key in the file.
        for opath, text in self.overrides.items():
            if opath[: len(path)] == path and path:
                return f"override '{text}'"
        if self.loaded is not None:
            line = self.loaded.line_of(path)
            if line is not None:
                return f"line {line}"
        return None


def dotted(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        if not isinstance(part, int):
            part = escape_controls(str(part))
            part = part if len(part) <= 40 else part[:39] + "…"
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def leading_path(message: str) -> tuple[str, ...] | None:
    m = _LEADING_PATH.match(message)
    return tuple(m.group(1).split(".")) if m else None


def located(message: str, origin: Origin | None, path: tuple[Any, ...] = ()) -> str:
    """Prefix a message with where its key was written.

    A message that names its own key path first ("trainer.zero_stage(2) needs ...") gets
    ``line N: `` in front; otherwise the key path is written too: ``resources.nodes (line 7): ...``.
    """
    own = leading_path(message)
    if own is not None:
        where = origin.locate(own) if origin else None
        return f"{where}: {message}" if where else message
    if not path:
        return message
    where = origin.locate(path) if origin else None
    head = dotted(path) + (f" ({where})" if where else "")
    return f"{head}: {message}"


def _fields_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """Valid keys of the sub-model reached by ``path`` (for 'did you mean')."""
    current: Any = model
    for part in path:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        fld = current.model_fields.get(part)
        if fld is None:
            return []
        current = _unwrap(fld.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    args = getattr(annotation, "__args__", None)
    if args:
        for a in args:
            if isinstance(a, type) and issubclass(a, BaseModel):
                return a
    return annotation


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string (quote it)",
    "dict_type": "a mapping of keys to values",
    "list_type": "a list",
    "tuple_type": "a list",
    "model_type": "a mapping of keys to values",
    "model_attributes_type": "a mapping of keys to values",
}


def format_validation_error(
    exc: ValidationError, origin: Origin | LoadedYaml | None, model: type[BaseModel]
) -> list[str]:
    if isinstance(origin, LoadedYaml):
        origin = Origin(loaded=origin)
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        if loc and loc[-1] == "[key]":  # a mapping's key was refused: the path ends at that key
            loc = loc[:-1]
        kind = err["type"]
        msg = err["msg"]
        got = err.get("input")
        if kind == "extra_forbidden":
            parent, key = loc[:-1], str(loc[-1])
            valid = _fields_at(model, parent)
            match = closest(key, valid) if len(key) <= 100 else None
            hint = f" (did you mean '{match}'?)" if match else ""
            text = f"unknown key {brief(key)}{hint}; valid keys here: {', '.join(valid)}"
        elif kind == "missing":
            text = "required key is missing"
        elif kind in ("literal_error", "enum"):
            allowed = _QUOTED.findall(str((err.get("ctx") or {}).get("expected", "")))
            hint = ""
            if isinstance(got, str) and allowed and len(got) <= 100:
                match = closest(got, allowed)
                hint = f" (did you mean '{match}'?)" if match else ""
            text = f"{msg}, got {brief(got)}{hint}"
        elif kind in ("value_error", "assertion_error"):
            text = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        elif kind in _TYPE_WORDS:
            text = f"must be {_TYPE_WORDS[kind]} (got {brief(got)})"
        else:
            text = f"{msg} (got {brief(got)})"
        problems.append(located(text, origin, loc))
    return problems
