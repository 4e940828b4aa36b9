"""Read a job spec from YAML plus dotted command-line overrides, validated as one document."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from launcher.errors import SpecError
from launcher.spec import JobSpec
from launcher.validation import format_validation_error
from launcher.yamlio import LoadedYaml, load_yaml_file


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """'trainer.zero_stage=3' -> (('trainer', 'zero_stage'), 3). Values are YAML scalars."""
    if "=" not in text:
        raise SpecError(
            [f"override '{text}' must look like key.path=value (e.g. resources.nodes=4)"]
        )
    key, _, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not all(parts) or any(not p.replace("_", "a").isalnum() for p in parts):
        raise SpecError([f"override '{text}': '{key}' is not a dotted key path"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError(
                    [f"override '{text}': {'.'.join(parts[: i + 1])} is not a mapping"]
                )
            node = child
        node[parts[-1]] = value
    return out


def validate_data(data: Any, loaded: LoadedYaml | None, source: str) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(["a job spec must be a YAML mapping of keys to values"], source=source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, loaded, JobSpec), source=source) from None


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


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Load, override and validate a job spec; raises SpecError with every problem found.

    Relative paths in the spec are resolved against the spec file's directory, so the
    resolved spec (saved in the run directory) means the same thing on every node.
    """
    loaded = load_yaml_file(path)
    data = loaded.data
    if overrides:
        if not isinstance(data, dict):
            raise SpecError(["a job spec must be a YAML mapping"], source=str(path))
        data = apply_overrides(data, overrides)
    spec = validate_data(data, loaded, str(path))
    return resolve_paths(spec, Path(path).resolve().parent)
