"""The code's own rules, checked by the tools that own them (docs/architecture.md):

- import-linter: the kernel (lmcore) imports neither side, the runtime imports only the kernel, the
  launcher's packages form layers (contracts in pyproject.toml, by package);
- no import cycle anywhere in launcher/, lmcore or lmtrain (function-local imports included: grimp sees them);
- ruff on all Python code, mypy on the CLI and the runtime, --strict on the kernel (configs in
  pyproject.toml);
- no module grows past 400 lines without a stated reason;
- the runtime and the launcher grouped into packages, each saying what belongs in it, at most 8
  modules at either root; the wheel's package list names every package on disk;
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
    "src/lmcore/job/spec.py": "the job spec schema: one pydantic model per section, documented field by field",
    "src/lmcore/slurm/client.py": "the one SLURM client: one small function per SLURM command",
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

    graph = grimp.build_graph("launcher", "lmcore", "lmtrain")
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
    """One run: launcher/, src/lmcore and src/lmtrain (every parameter typed, every body checked);
    pyproject.toml gives the kernel (lmcore) every per-module flag of --strict."""
    proc = _run([_tool("mypy"), "--cache-dir", str(tmp_path / "mypy-cache")], timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_modules_stay_small_or_say_why():
    long = {}
    for root in ("launcher", "src/lmcore", "src/lmtrain"):
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
    for root in ("launcher", "src/lmcore", "src/lmtrain"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


MAX_ROOT_MODULES = 8


@pytest.mark.parametrize("root", ["src/lmtrain", "launcher", "src/lmcore"])
def test_each_side_is_grouped_into_packages_that_say_what_belongs_in_them(root):
    """src/lmtrain, launcher/ and the kernel are houses by concept (docs/architecture.md): few
    modules at the root of each side, and every package's ``__init__`` says what belongs there, so
    the place for a new thing is not a guess."""
    import ast

    base = REPO / root
    modules = sorted(p.name for p in base.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_ROOT_MODULES, f"{len(modules)} modules at {root}'s root: {modules}"
    silent = []
    for folder in sorted([base, *(p for p in base.rglob("*") if p.is_dir())]):
        if folder.name in ("__pycache__", "web") or not any(folder.glob("*.py")):
            continue
        init = folder / "__init__.py"
        if not init.exists() or not ast.get_docstring(ast.parse(init.read_text())):
            silent.append(str(folder.relative_to(REPO)))
    assert not silent, f"packages without a docstring saying what belongs there: {silent}"


def test_the_wheel_names_every_package_on_disk():
    """pyproject.toml lists the packages one by one (three roots: launcher/, src/lmcore,
    src/lmtrain): a package missing there is missing from an installed lmlaunch."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for root, base in (("launcher", REPO / "launcher"), ("lmcore", REPO / "src" / "lmcore"),
                       ("lmtrain", REPO / "src" / "lmtrain")):
        for init in base.rglob("__init__.py"):
            on_disk.add(".".join([root, *init.parent.relative_to(base).parts]))
    assert on_disk - listed == set(), f"packages not in pyproject.toml: {sorted(on_disk - listed)}"
    # data folders mapped in as packages (package-dir): the profiles, the example specs, the shipped corpus
    assert listed - on_disk == {"launcher.cluster_profiles", "launcher.examples", "lmtrain.data.corpus"}, \
        sorted(listed - on_disk)


def test_no_run_directory_path_is_joined_by_hand():
    """lmcore.run.run_layout (RunLayout and its names, re-exported by rundir) is the one speller
    of a run directory's paths, as submitit's JobPaths is of its folder: no other module joins a
    run-directory name onto a path (``x / rundir.PLAN``, ``x / LEDGER``, ``x / "plan.json"``,
    ``x / "submitit"``)."""
    import ast

    from lmcore.run import run_layout as rundir

    names = {n for n, v in vars(rundir).items() if n.isupper() and isinstance(v, str) and not n.startswith("_")
             and n not in ("HANG_MARKER", "LAST_WORDS", "LAST_WORDS_OF_A_RANK", "ENVIRONMENT", "RANK_TIMING")}  # files of an attempt's log dir: RunLayout's
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
    for root in ("launcher", "src/lmcore", "src/lmtrain"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "src" / "lmcore" / "run" / "run_layout.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if joined(node):
                    joins.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not joins, "run-directory paths joined by hand (use lmcore.run.run_layout.RunLayout):\n" + "\n".join(joins)


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


OUR_PACKAGES = ("launcher", "lmcore", "lmtrain", "lmeval")


def _private_uses(tree) -> list[tuple[int, str]]:
    """A module's uses of another module's underscore names: ``from ours import _x`` and
    ``module._x`` where ``module`` (or a class) was imported from our packages."""
    import ast

    found, imported = [], set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in OUR_PACKAGES:
            for a in n.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append((n.lineno, f"from {n.module} import {a.name}"))
                imported.add(a.asname or a.name)
        elif isinstance(n, ast.Import):
            imported.update(a.asname or a.name.split(".")[0] for a in n.names if a.name.split(".")[0] in OUR_PACKAGES)
    for n in ast.walk(tree):
        if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                and isinstance(n.value, ast.Name) and n.value.id in imported):
            found.append((n.lineno, f"{n.value.id}.{n.attr}"))
    return found


def test_no_underscore_name_of_another_module_is_used():
    import ast

    sample = ast.parse("from lmcore.x import _a\nfrom lmcore.slurm import client as slurm\nslurm._B\nimport os\nos._exit")
    assert [what for _, what in _private_uses(sample)] == ["from lmcore.x import _a", "slurm._B"]  # the check finds both
    private = [f"{path.relative_to(REPO).as_posix()}:{line} {what}"
               for root in (REPO / "launcher", REPO / "src") for path in sorted(root.rglob("*.py"))
               for line, what in _private_uses(ast.parse(path.read_text()))]
    assert not private, private


def test_the_run_directory_passes_through_few_hands():
    """From the task's entry function, the functions that receive the run directory's path: under
    30, and each module entered at most twice (the run directory travels in the plan's paths and
    lmcore.run.rundir.RunLayout, which spells every path in it)."""
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


SLURM_COMMANDS = frozenset({"sbatch", "srun", "salloc", "sacct", "squeue", "scontrol", "scancel", "sinfo", "sacctmgr",
                            "sstat", "sprio", "sshare", "sreport", "strigger", "sattach", "sbcast"})
SLURM_CLIENT = ("src/lmcore/slurm/", "launcher/localcluster/")  # the client; the local cluster's own administration


def _slurm_command_lines(tree):
    """Command lines of SLURM's programs spelled in a module: a list or tuple display holding one of
    their names as a constant word (``["sacct", "-n", ...]``, ``["timeout", "5", "sbatch", path]``)."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if SLURM_COMMANDS & set(words):
                yield node.lineno, next(w for w in words if w in SLURM_COMMANDS)


def test_slurm_command_lines_are_built_by_the_slurm_client_only():
    """One SLURM client (lmcore.slurm): outside it and the local cluster's administration, no module
    builds an sbatch/srun/sacct/squeue/scontrol/scancel/sinfo/sacctmgr command line; they ask it."""
    import ast

    spelled = []
    for root in ("launcher", "src"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(SLURM_CLIENT):
                continue
            spelled += [f"{rel}:{n} {cmd}" for n, cmd in _slurm_command_lines(ast.parse(path.read_text()))]
    assert not spelled, "SLURM command lines outside lmcore.slurm (ask the client instead):\n" + "\n".join(spelled)


# Where the way to SLURM may be looked at: the client's one chooser of the way in force
# (lmcore.slurm.client.way_in_force) and the one chooser of the way a command or a run takes (from the
# profile and the flags); every other module, lmcore.slurm's included, asks lmcore.slurm.way's Way
WAY_CHOOSERS = ("src/lmcore/slurm/client.py", "launcher/planning/transport.py")
WAY_TYPES = {"RestTarget", "RestClient", "CommandsTarget"}


def _way_branches(tree):
    """Where a module looks at how SLURM is reached: a call of ``rest_client()`` or
    ``commands_target()``, or an ``isinstance`` against a way's type."""
    import ast

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if name in ("rest_client", "commands_target"):
            yield node.lineno, f"{name}()"
        if name == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for k in kinds:
                kind = getattr(k, "id", None) or getattr(k, "attr", None)
                if kind in WAY_TYPES:
                    yield node.lineno, f"isinstance(..., {kind})"


def test_nothing_outside_the_slurm_client_branches_on_how_slurm_is_reached():
    """Commands here, commands over SSH and slurmrestd are chosen once (launcher.planning.transport) and
    answered for by their classes (lmcore.slurm.way's Way: each query, can the controller judge a
    script first, can it carry a heterogeneous job, how is a script submitted): no other module
    branches on which it is, and inside the client only the chooser of the way in force does."""
    import ast

    found = []
    for root in ("launcher", "src"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(WAY_CHOOSERS):
                found += [f"{rel}:{n} {what}" for n, what in _way_branches(ast.parse(path.read_text()))]
    assert not found, "branches on how SLURM is reached (ask lmcore.slurm.way):\n" + "\n".join(found)
    # inside the client, only its two choosers look: every query asks the Way they return
    client = ast.parse((REPO / "src/lmcore/slurm/client.py").read_text())
    looking = {f.name for f in ast.walk(client) if isinstance(f, ast.FunctionDef) and any(_way_branches(f))}
    assert looking == {"way_in_force", "commands"}, looking
    sample = ast.parse("if slurm.rest_client() is not None: pass\nok = isinstance(t, (str, CommandsTarget))")
    assert sorted(w for _, w in _way_branches(sample)) == ["isinstance(..., CommandsTarget)", "rest_client()"]


def test_the_slurm_command_line_check_finds_one_added_elsewhere():
    """The check above, shown a module that spells its own sacct query and a wrapped sbatch."""
    import ast

    module = ast.parse('import subprocess\n'
                       'def probe():\n'
                       '    subprocess.run(["sacct", "-n", "-X"], check=False)\n'
                       '    return ("timeout", "30", "sbatch", "job.sh")\n'
                       'KINDS = {"sbatch": 1}  # a name in a mapping is not a command line\n')
    assert sorted(_slurm_command_lines(module)) == [(3, "sacct"), (4, "sbatch")]


def _batch_script_lines(tree):
    """Where a module writes batch-script text: a script's first line (``#!/bin/bash``), an ``#SBATCH``
    option line, or submitit's script renderer (``_make_sbatch_string``)."""
    import ast
    import re

    option = re.compile(r"^#SBATCH --[\w-]+=")
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text = node.values[0].value
        if isinstance(text, str) and (text.startswith("#!/bin/") or option.match(text)):
            yield node.lineno, text[:40]
        if isinstance(node, (ast.Name, ast.Attribute, ast.alias)):
            name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
            if name == "_make_sbatch_string":
                yield node.lineno, name


def test_the_batch_script_is_rendered_by_one_module():
    """launcher/submit/script.py renders every batch script (a run's, a sweep's array, data prepare's,
    `lmlaunch eval`'s, an evaluator's component): no other module writes a script's first line, an
    #SBATCH option or calls submitit's renderer (hetjob.py and container_lines.py give it options and
    shell lines, never script text of that kind)."""
    import ast

    owner = REPO / "launcher" / "submit" / "script.py"
    found = []
    for root in ("launcher", "src"):
        for path in sorted((REPO / root).rglob("*.py")):
            # the local cluster writes its own daemons' wrappers (its administration, not a job's script)
            if path != owner and \
                    not path.relative_to(REPO).as_posix().startswith("launcher/localcluster/"):
                found += [f"{path.relative_to(REPO)}:{n} {w!r}" for n, w in _batch_script_lines(ast.parse(path.read_text()))]
    assert not found, "batch-script text outside launcher/submit/script.py:\n" + "\n".join(found)
    assert list(_batch_script_lines(ast.parse(owner.read_text()))), "the renderer itself is seen by the check"


def test_the_python_inside_the_shell_scripts_imports_what_exists():
    """scripts/*.sh run Python of their own (heredocs, ``-c``): its imports of lmlaunch's packages name
    modules and attributes that exist (a move of a module once broke the demo's follow step)."""
    import ast
    import importlib
    import re

    snippets = []
    for path in sorted((REPO / "scripts").glob("*.sh")):
        text = path.read_text()
        snippets += [(path.name, m.group(2)) for m in re.finditer(r"<<'(\w+)'\n(.*?)\n\1\n", text, re.S)]
        snippets += [(path.name, m.group(1)) for m in re.finditer(r'python"? -c "\n?(.*?)"\)?', text, re.S)]
    assert snippets, "no Python found in scripts/*.sh"
    missing = []
    for name, code in snippets:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("launcher", "lmcore", "lmtrain"):
                module = importlib.import_module(node.module)
                missing += [f"{name}: from {node.module} import {a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in ("launcher", "lmcore", "lmtrain") and importlib.util.find_spec(a.name) is None:
                        missing.append(f"{name}: import {a.name}")
    assert not missing, missing
