"""Read a job spec from YAML plus dotted command-line overrides, validated as one document.

An override is validated exactly like the same key written in the file; its messages name
the override (``override 'resources.nodse=4': unknown key 'nodse'; did you mean 'nodes'?``).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from launcher.spec.validation import Origin, format_validation_error
from launcher.spec.yamlio import load_yaml_file, parse_scalar
from lmcore.errors import SpecError
from lmcore.job.spec import JobSpec
from lmcore.text_rules import brief, check_override_text

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """'trainer.zero_stage=3' -> (('trainer', 'zero_stage'), 3). Values are read as YAML.

    An override is one line: a control character (a newline above all) is an error, never cut."""
    try:
        check_override_text(text)
    except ValueError as exc:
        raise SpecError([str(exc)]) from None
    if "=" not in text:
        raise SpecError(
            [f"override {brief(text)} must look like key.path=value (e.g. resources.nodes=4)"]
        )
    key, _, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if len(parts) > 16 or not all(_KEY.fullmatch(p) for p in parts):
        raise SpecError(
            [f"override {brief(text)}: {brief(key)} is not a dotted key path (e.g. trainer.max_steps)"]
        )
    try:
        value = parse_scalar(raw)
    except ValueError as exc:
        raise SpecError([f"override {brief(text)}: {exc}"]) from None
    return parts, value


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
                        f"override {brief(text)}: {'.'.join(parts[: i + 1])} is "
                        f"{type(child).__name__} {brief(child)}, not a mapping with keys"
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
        raise SpecError([f"top-level key {brief(bad_keys[0])} is not a name"], source=source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, origin, JobSpec), source=source) from None


# A spec sent from a workstation (launcher.remote.forward) sits in a staging directory: its relative paths
# are relative to the profile's login.workdir on the cluster, which this names.
SPEC_BASE_ENV = "LMLAUNCH_SPEC_BASE"


def resolve_paths(spec: JobSpec, base: Path, origin: Origin | None = None) -> JobSpec:
    """Relative data/checkpoint/pretrained paths are relative to the spec file's directory
    (``LMLAUNCH_SPEC_BASE`` where set: a spec sent over ssh).

    A path that cannot be resolved (a symlink loop, a name too long, ~user unknown) is an error
    naming its key, not a traceback."""

    def absolute(p: str | None, key: tuple[str | int, ...]) -> str | None:
        if p is None:
            return None
        try:
            q = Path(p).expanduser()
            return str(q if q.is_absolute() else (base / q).resolve())
        except (OSError, RuntimeError) as exc:
            where = origin.locate(key) if origin else None
            head = ".".join(map(str, key)) + (f" ({where})" if where else "")
            reason = getattr(exc, "strerror", None) or str(exc)
            raise SpecError([f"{head}: cannot resolve the path {brief(p)}: {reason}"]) from None

    data = spec.data.model_copy(update={
        "path": absolute(spec.data.path, ("data", "path")),
        "sources": None if spec.data.sources is None else [
            src.model_copy(update={"path": absolute(src.path, ("data", "sources", i, "path"))})
            for i, src in enumerate(spec.data.sources)],
    })
    ckpt = spec.checkpoint if spec.checkpoint.store else spec.checkpoint.model_copy(
        update={"dir": absolute(spec.checkpoint.dir, ("checkpoint", "dir"))})
    model = spec.model.model_copy(
        update={"pretrained": absolute(spec.model.pretrained, ("model", "pretrained"))}
    )
    update: dict[str, Any] = {"data": data, "checkpoint": ckpt, "model": model}
    if spec.eval is not None:
        ev = spec.eval.model_copy(update={"checkpoint": absolute(spec.eval.checkpoint, ("eval", "checkpoint"))})
        if ev.alongside is not None:
            dirs = [absolute(d, ("eval", "alongside", "task_dirs", i)) for i, d in enumerate(ev.alongside.task_dirs)]
            ev = ev.model_copy(update={"alongside": ev.alongside.model_copy(update={"task_dirs": dirs})})
        update["eval"] = ev
    return spec.model_copy(update=update)


def load_job_with_origin(
    path: str | Path, overrides: list[str] | None = None
) -> tuple[JobSpec, Origin]:
    """Load, override and validate a job spec; also where each value came from."""
    loaded = load_yaml_file(path, "job spec")
    data = loaded.data
    origin = Origin(loaded=loaded)
    if overrides:
        if not isinstance(data, dict):
            raise SpecError(["a job spec must be a YAML mapping of keys to values"], source=str(path))
        data, origin.overrides = apply_overrides(data, overrides)
    spec = validate_data(data, origin, str(path))
    try:
        shipped_base = os.environ.get(SPEC_BASE_ENV)
        base = Path(shipped_base).expanduser().resolve() if shipped_base else Path(path).resolve().parent
    except (OSError, RuntimeError) as exc:
        raise SpecError([f"cannot resolve the spec's directory: {exc}"], source=str(path)) from None
    try:
        return resolve_paths(spec, base, origin), origin
    except SpecError as exc:
        raise SpecError(exc.problems, source=str(path), exit_code=exc.exit_code) from None


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Load, override and validate a job spec; raises SpecError with every problem found.

    Relative paths in the spec are resolved against the spec file's directory, so the
    resolved spec (saved in the run directory) means the same thing on every node.
    """
    return load_job_with_origin(path, overrides)[0]
