"""The job spec's and the cluster profile's schemas as documents: the JSON Schema editors validate
job specs with (``lmlaunch schema``) and the reference page generated from it
(docs/spec-reference.md, checked by tests/unit/test_schema_docs.py)."""

from __future__ import annotations

import json
from typing import Any

from launcher.spec.profiles import Profile
from lmcore.job.spec import JobSpec

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def job_schema() -> dict[str, Any]:
    schema = JobSpec.model_json_schema()
    schema["$schema"] = DRAFT
    schema["title"] = "lmlaunch job spec"
    return schema


def profile_schema() -> dict[str, Any]:
    schema = Profile.model_json_schema()
    schema["$schema"] = DRAFT
    schema["title"] = "lmlaunch cluster profile"
    return schema


def _type_of(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return "mapping (see below)"
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    if "anyOf" in prop:
        parts = [_type_of(p) for p in prop["anyOf"] if p.get("type") != "null"]
        nullable = any(p.get("type") == "null" for p in prop["anyOf"])
        return " \\| ".join(parts) + (" or null" if nullable else "")
    kind = prop.get("type", "any")
    if kind == "array":
        if "prefixItems" in prop:
            return "list of " + ", ".join(_type_of(p) for p in prop["prefixItems"])
        return f"list of {_type_of(prop.get('items', {}))}"
    if kind == "object":
        extra = prop.get("additionalProperties")
        return f"mapping of names to {_type_of(extra)}" if isinstance(extra, dict) else "mapping"
    bounds = [
        f"{sym} {prop[key]}"
        for key, sym in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if key in prop
    ]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _default(prop: dict[str, Any], required: bool) -> str:
    if required:
        return "**required**"
    if "default" not in prop:
        return ""
    return f"`{json.dumps(prop['default'])}`"


def _section(title: str, schema: dict[str, Any], defs: dict[str, Any], prefix: str, out: list[str]) -> None:
    out += [f"### `{prefix or title}`", ""]
    if schema.get("description"):
        out += [schema["description"].strip(), ""]
    out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    required = set(schema.get("required", []))
    nested = []
    for key, prop in schema.get("properties", {}).items():
        desc = " ".join(prop.get("description", "").split()).replace("|", "\\|")
        out.append(f"| `{key}` | {_type_of(prop)} | {_default(prop, key in required)} | {desc} |")
        refs = [prop] + prop.get("anyOf", [])
        for r in refs:
            if "$ref" in r:
                nested.append((key, defs[r["$ref"].split("/")[-1]]))
        extra = prop.get("additionalProperties")
        if isinstance(extra, dict) and "$ref" in extra:
            nested.append((f"{key}.<name>", defs[extra["$ref"].split("/")[-1]]))
    out.append("")
    for key, sub in nested:
        _section(key, sub, defs, f"{prefix}.{key}" if prefix else key, out)


def reference_markdown() -> str:
    """docs/spec-reference.md: every field of the job spec and the cluster profile."""
    out = [
        "# Job spec and cluster profile reference",
        "",
        "Generated from the schemas in `src/lmcore/job/spec.py` and `launcher/spec/profiles.py` by",
        "`lmlaunch schema --format markdown -o docs/spec-reference.md`; do not edit by hand",
        "(a test checks it is up to date). Unknown keys are errors. Editors can validate job",
        "specs with `lmlaunch schema -o job.schema.json`.",
        "",
        "## Job spec (`job.yaml`)",
        "",
    ]
    job = job_schema()
    _section("job spec", job, job.get("$defs", {}), "", out)
    out += ["## Cluster profile (`cluster_profiles/<name>.yaml`)", ""]
    prof = profile_schema()
    _section("profile", prof, prof.get("$defs", {}), "", out)
    return "\n".join(out).rstrip("\n") + "\n"
