"""The README is the front door and the rest lives in the documentation site (mkdocs.yml, docs/):
the site builds with `mkdocs build --strict` (every page in the nav, no broken link or anchor),
and its two references are generated from the code, so neither drifts: the CLI reference from the
argument parsers (launcher.cli_reference), the spec reference from the schemas (test_schema_docs)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

REPO = Path(__file__).resolve().parents[2]


def test_the_cli_reference_is_generated_from_the_parsers():
    from launcher.cli_reference import reference_markdown

    page = (REPO / "docs" / "cli-reference.md").read_text()
    assert page == reference_markdown(), (
        "docs/cli-reference.md is stale: run `python -m launcher.cli_reference -o docs/cli-reference.md`")


def test_the_cli_reference_names_every_listed_command_and_option():
    from launcher.cli import build_parser
    from launcher.commands import COMMANDS

    page = (REPO / "docs" / "cli-reference.md").read_text()
    listed = [name for name, (_, help_text) in COMMANDS.items() if not name.startswith("_")]
    missing = [name for name in listed if f"## `lmlaunch {name}`" not in page]
    assert not missing, missing
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    submit = sub.choices["submit"]
    options = [o for a in submit._actions if a.help != argparse.SUPPRESS
               for o in a.option_strings if o not in ("-h", "--help")]
    assert options and [o for o in options if f"`{o}" not in page] == []


def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.fail("mkdocs is not installed in this environment: run scripts/setup.sh (it is in the dev extras)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([str(mkdocs), "build", "--strict", "-q", "-d", str(tmp_path / "site")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG_S, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    cli = (tmp_path / "site" / "cli-reference" / "index.html").read_text()
    assert "lmlaunch submit" in cli and "--dry-run" in cli


def test_the_readme_is_a_front_door_whose_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "the README is the front door: what lmlaunch is, the two commands, a tour"
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    broken = [t for t in targets if not t.startswith("http") and not (REPO / t).exists()]
    assert targets and not broken, broken
    nav = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert [p for p in pages if p not in nav] == [], "every page under docs/ is in the site's nav"
