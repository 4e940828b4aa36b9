"""The code's own rules, checked by the tools that own them (docs/architecture.md):

- import-linter: the core imports neither side, the runtime imports only the core, the CLI's
  modules form layers (contracts in pyproject.toml);
- no import cycle anywhere in launcher/ or lmtrain (function-local imports included: grimp sees them);
- ruff on all Python code, mypy on the CLI and the runtime, --strict on the core (configs in
  pyproject.toml);
- no module grows past 400 lines without a stated reason;
- the runtime grouped into packages, each saying what belongs in it, at most 8 modules at its root;
- in the runtime: no function over 60 lines, no underscore name imported from another module,
  and the run directory handed on through few hands (tests/run_dir_walk.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# Modules allowed over the size limit, each with its reason.
LONG_MODULES = {
    "launcher/core/spec.py": "the job spec schema: one pydantic model per section, documented field by field",
    "launcher/core/slurm.py": "the one SLURM client: one small function per SLURM command",
    "src/lmtrain/data/loader.py": "the memmap dataset and its resumable sampler, which must change together",
    "launcher/localcluster/cluster.py": "the local SLURM cluster's lifecycle (config, daemons, accounting)",
}
MAX_LINES = 400


def _run(args: list[str], timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in this environment: run scripts/setup.sh (it is in the dev extras)")
    return str(path)


def test_import_contracts_are_kept():
    proc = _run([_tool("lint-imports"), "--no-cache"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_no_import_cycles():
    import grimp

    graph = grimp.build_graph("launcher", "lmtrain")
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & set(modules)) for m in modules}
    # A package's __init__ is its own module: `launcher.commands` importing nothing of its
    # children, only the children importing the package, is not a cycle; grimp reports edges
    # module -> module, so Tarjan's strongly connected components find every real cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for m in modules:
        if m not in index:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_ruff_passes():
    proc = _run([_tool("ruff"), "check", "--no-cache", "launcher", "src", "tests", "bench", "scripts"])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_mypy_on_the_cli_and_the_runtime_and_strict_on_the_core(tmp_path):
    """One run: launcher/ and src/lmtrain (every parameter typed, every body checked); pyproject.toml
    gives launcher.core every per-module flag of --strict."""
    proc = _run([_tool("mypy"), "--cache-dir", str(tmp_path / "mypy-cache")], timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_modules_stay_small_or_say_why():
    long = {}
    for root in ("launcher", "src/lmtrain"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            n = len(path.read_text().splitlines())
            if n > MAX_LINES and rel not in LONG_MODULES:
                long[rel] = n
    assert not long, f"modules over {MAX_LINES} lines without a reason in LONG_MODULES: {long}"
    stale = [m for m in LONG_MODULES if not (REPO / m).exists()
             or len((REPO / m).read_text().splitlines()) <= MAX_LINES]
    assert not stale, f"LONG_MODULES entries no longer needed: {stale}"


MAX_FUNCTION_LINES = 60


def test_no_function_runs_over_60_lines():
    """A function longer than a screen is split where its parts have names of their own."""
    import ast

    long = []
    for root in ("launcher", "src/lmtrain"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


MAX_ROOT_MODULES = 8


def test_the_runtime_is_grouped_into_packages_that_say_what_belongs_in_them():
    """src/lmtrain is a house by concept (docs/architecture.md): few modules at its root, and every
    package's ``__init__`` says what belongs there, so the place for a new thing is not a guess."""
    import ast

    root = REPO / "src" / "lmtrain"
    modules = sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_ROOT_MODULES, f"{len(modules)} modules at lmtrain's root: {modules}"
    silent = []
    for folder in sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        if not init.exists() or not ast.get_docstring(ast.parse(init.read_text())):
            silent.append(str(folder.relative_to(REPO)))
    assert not silent, f"packages without a docstring saying what belongs there: {silent}"


def test_no_run_directory_path_is_joined_by_hand():
    """launcher.core.run_layout (RunLayout and its names, re-exported by rundir) is the one speller
    of a run directory's paths, as submitit's JobPaths is of its folder: no other module joins a
    run-directory name onto a path (``x / rundir.PLAN``, ``x / LEDGER``, ``x / "plan.json"``,
    ``x / "submitit"``)."""
    import ast

    from launcher.core import run_layout as rundir

    names = {n for n, v in vars(rundir).items() if n.isupper() and isinstance(v, str) and not n.startswith("_")
             and n not in ("HANG_MARKER", "LAST_WORDS", "ENVIRONMENT", "RANK_TIMING")}  # files of an attempt's log dir: RunLayout's
    spelled = {getattr(rundir, n).split("/")[0] for n in names}

    def joined(node: ast.AST) -> bool:
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
            return False
        r = node.right
        if isinstance(r, ast.Name) and r.id in names:
            return True
        if isinstance(r, ast.Attribute) and r.attr in names and isinstance(r.value, ast.Name) and r.value.id == "rundir":
            return True
        return isinstance(r, ast.Constant) and isinstance(r.value, str) and r.value.split("/")[0] in spelled

    joins = []
    for root in ("launcher", "src/lmtrain"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "launcher" / "core" / "run_layout.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if joined(node):
                    joins.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not joins, "run-directory paths joined by hand (use launcher.core.run_layout.RunLayout):\n" + "\n".join(joins)


def _lmtrain_trees():
    import ast

    for path in sorted((REPO / "src" / "lmtrain").rglob("*.py")):
        yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text())


def test_no_runtime_function_is_over_60_lines():
    import ast

    long = [f"{rel}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)" for rel, tree in _lmtrain_trees()
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_no_underscore_name_is_imported_from_another_module():
    import ast

    private = [f"{rel}:{n.lineno} from {n.module} import {a.name}" for rel, tree in _lmtrain_trees()
               for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               for a in n.names if a.name.startswith("_") and (n.module or "").startswith(("lmtrain", "launcher"))]
    assert not private, private


def test_the_run_directory_passes_through_few_hands():
    """From the task's entry function, the functions that receive the run directory's path: under
    30, and each module entered at most twice (the run directory travels in the plan's paths and
    core.rundir.RunLayout, which spells every path in it)."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import run_dir_walk
    finally:
        sys.path.remove(str(REPO / "tests"))
    stops = run_dir_walk.walk()
    assert stops[0] == run_dir_walk.Stop("lmtrain.task.entry", "run_task", "run_dir")
    visits = run_dir_walk.visits(stops)
    assert len(stops) < 30 and max(visits.values()) <= 2, (stops, visits)


def test_no_tracker_numbers_in_code_or_docs():
    """The issue tracker is not part of the repository: code and docs say what, not which ticket."""
    import re

    pattern = re.compile(r"\b[Ii]ssues? ?#?\d+\b|\(#\d+\)")
    hits = []
    for root in ("launcher", "src", "tests", "bench", "scripts", "docs", "jobs", "cluster_profiles"):
        for path in sorted((REPO / root).rglob("*")):
            if path.suffix in (".py", ".md", ".sh", ".yaml", ".toml") and path.is_file():
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if pattern.search(line) and path.name != "test_code_quality.py":
                        hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    for name in ("README.md", "pyproject.toml"):
        for n, line in enumerate((REPO / name).read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)
