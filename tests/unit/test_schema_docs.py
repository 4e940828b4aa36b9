"""`lmlaunch schema` is a valid JSON Schema with a description on every field, the shipped
specs pass it, and docs/spec-reference.md is the markdown generated from it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema
import pytest

from launcher.cli import main
from launcher.context import Context
from launcher.spec.schema_docs import reference_markdown
from launcher.spec.yamlio import load_yaml_file

REPO = Path(__file__).resolve().parents[2]


def cli_schema(*extra: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert main(["schema", *extra], Context(stdout=out, stderr=err, environ={})) == 0, err.getvalue()
    return out.getvalue()


def all_properties(schema: dict) -> dict[str, dict]:
    found = {}
    for model, sub in [("JobSpec", schema), *schema.get("$defs", {}).items()]:
        for key, prop in sub.get("properties", {}).items():
            found[f"{model}.{key}"] = prop
    return found


def test_schema_is_valid_json_schema_with_a_description_on_every_field():
    schema = json.loads(cli_schema())
    jsonschema.Draft202012Validator.check_schema(schema)
    props = all_properties(schema)
    assert len(props) > 60
    assert [name for name, prop in props.items() if not prop.get("description")] == []
    for sub in [schema, *schema["$defs"].values()]:
        if sub.get("type") == "object" and "properties" in sub:
            assert sub.get("additionalProperties") is False  # strict: unknown keys rejected


@pytest.mark.parametrize("job", sorted(p.name for p in (REPO / "jobs").glob("*.yaml")))
def test_shipped_job_specs_pass_the_schema(job):
    schema = json.loads(cli_schema())
    jsonschema.validate(load_yaml_file(REPO / "jobs" / job).data, schema)


def test_schema_rejects_an_unknown_key_like_the_cli_does():
    schema = json.loads(cli_schema())
    data = load_yaml_file(REPO / "jobs" / "tiny-cpu.yaml").data
    data["resources"]["nodse"] = 2
    with pytest.raises(jsonschema.ValidationError, match="nodse"):
        jsonschema.validate(data, schema)


def test_schema_output_file_matches_stdout(tmp_path):
    target = tmp_path / "job.schema.json"
    assert cli_schema("-o", str(target)) == f"wrote {target}\n"
    assert target.read_text() == cli_schema()


def test_spec_reference_doc_is_generated_from_the_schema_and_up_to_date():
    doc = (REPO / "docs" / "spec-reference.md").read_text()
    assert doc == reference_markdown(), (
        "docs/spec-reference.md is stale: run "
        "`lmlaunch schema --format markdown -o docs/spec-reference.md`"
    )
    assert cli_schema("--format", "markdown") == doc
    for key in ("global_batch_size", "zero_stage", "passthrough", "partition_kind", "max_time", "why"):
        assert f"| `{key}` |" in doc
