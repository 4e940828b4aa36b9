"""Read a job spec from YAML plus dotted command-line overrides, validated as one document.

An override is validated exactly like the same key written in the file; its messages name
the override (``override 'resources.nodse=4': unknown key 'nodse'; did you mean 'nodes'?``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from launcher.errors import SpecError
from launcher.spec import JobSpec
from launcher.validation import Origin, format_validation_error
from launcher.yamlio import load_yaml_file, parse_scalar

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """'trainer.zero_stage=3' -> (('trainer', 'zero_stage'), 3). Values are read as YAML."""
    if "=" not in text:
        raise SpecError(
            [f"override '{text}' must look like key.path=value (e.g. resources.nodes=4)"]
        )
    key, _, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not all(_KEY.match(p) for p in parts):
        raise SpecError(
            [f"override '{text}': '{key}' is not a dotted key path (e.g. trainer.max_steps)"]
        )
    return parts, parse_scalar(raw)


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, dict[tuple[str, ...], str]]:
    """The document with the overrides applied, and which override set which key path."""
    out = copy.deepcopy(data)
    origin: dict[tuple[str, ...], str] = {}
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError(
                    [
                        f"override '{text}': {'.'.join(parts[: i + 1])} is "
                        f"{type(child).__name__} {child!r}, not a mapping with keys"
                    ]
                )
            node = child
        node[parts[-1]] = value
        origin[parts] = text
    return out, origin


def validate_data(data: Any, origin: Origin | None, source: str) -> JobSpec:
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a YAML {type(data).__name__}"
        raise SpecError(
            [f"a job spec must be a YAML mapping of keys to values, got {got}"], source=source
        )
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise SpecError([f"top-level key {bad_keys[0]!r} is not a name"], source=source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, origin, JobSpec), source=source) from None


def resolve_paths(spec: JobSpec, base: Path) -> JobSpec:
    """Relative data/checkpoint/pretrained paths are relative to the spec file's directory."""

    def absolute(p: str | None) -> str | None:
        if p is None:
            return None
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (base / q).resolve())

    data = spec.data.model_copy(update={"path": absolute(spec.data.path)})
    ckpt = spec.checkpoint.model_copy(update={"dir": absolute(spec.checkpoint.dir)})
    model = spec.model.model_copy(update={"pretrained": absolute(spec.model.pretrained)})
    return spec.model_copy(update={"data": data, "checkpoint": ckpt, "model": model})


def load_job_with_origin(
    path: str | Path, overrides: list[str] | None = None
) -> tuple[JobSpec, Origin]:
    """Load, override and validate a job spec; also where each value came from."""
    loaded = load_yaml_file(path)
    data = loaded.data
    origin = Origin(loaded=loaded)
    if overrides:
        if not isinstance(data, dict):
            raise SpecError(["a job spec must be a YAML mapping of keys to values"], source=str(path))
        data, origin.overrides = apply_overrides(data, overrides)
    spec = validate_data(data, origin, str(path))
    return resolve_paths(spec, Path(path).resolve().parent), origin


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Load, override and validate a job spec; raises SpecError with every problem found.

    Relative paths in the spec are resolved against the spec file's directory, so the
    resolved spec (saved in the run directory) means the same thing on every node.
    """
    return load_job_with_origin(path, overrides)[0]
