"""Turn pydantic errors into messages that teach: key path, line, what is allowed, closest key."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from launcher.errors import closest
from launcher.yamlio import LoadedYaml


def _fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """Valid keys of the sub-model reached by ``path`` (for 'did you mean')."""
    current: Any = model
    for part in path:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(part)
        if field is None:
            return []
        current = _unwrap(field.annotation)
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


def dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def format_validation_error(
    exc: ValidationError, loaded: LoadedYaml | None, model: type[BaseModel]
) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        line = loaded.line_of(loc) if loaded is not None else None
        where = dotted(loc) + (f" (line {line})" if line else "")
        kind = err["type"]
        msg = err["msg"]
        if kind == "extra_forbidden":
            parent, key = loc[:-1], str(loc[-1])
            valid = _fields_at(model, parent)
            match = closest(key, valid)
            hint = f"; did you mean '{match}'?" if match else ""
            problems.append(
                f"{where}: unknown key '{key}'{hint} Valid keys here: {', '.join(valid)}"
            )
        elif kind == "missing":
            problems.append(f"{where}: required key is missing")
        elif kind in ("literal_error", "enum"):
            problems.append(f"{where}: {msg} (got {err.get('input')!r})")
        elif kind == "value_error":
            problems.append(f"{where}: {msg.removeprefix('Value error, ')}")
        else:
            problems.append(f"{where}: {msg} (got {err.get('input')!r})")
    return problems
