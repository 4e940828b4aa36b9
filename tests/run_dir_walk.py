"""Where a task's run directory goes: from ``lmtrain.task.entry.run_task``, every function that
receives the ``run_dir`` path as an argument, in the order a reader meets them.

A static walk over the source (no import): a call passes the run directory when one of its
arguments is a name that holds it in the calling function (its parameter, or a name it was
assigned to, as it is, as ``Path(...)``/``str(...)``, or a path under it: ``run_dir / NAME``) or an attribute named ``run_dir``
(``plan.paths.run_dir``, ``layout.run_dir``); the callee is resolved through the module's imports (module level and in
the function), ``Class.method`` and ``Class(...).method``. A function that receives it is a
*stop*; a *visit* is a stretch of consecutive stops in one module.

    python tests/run_dir_walk.py        # the walk, the stops and the visits per module

tests/unit/test_code_quality.py holds it to the budget the layout was redesigned for.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"launcher": REPO / "launcher", "lmcore": REPO / "src" / "lmcore", "lmtrain": REPO / "src" / "lmtrain"}
START = ("lmtrain.task.entry", "run_task", "run_dir")


@dataclass(frozen=True)
class Stop:
    module: str
    function: str
    param: str


def _modules() -> dict[str, ast.Module]:
    out = {}
    for pkg, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = ast.parse(path.read_text())
    return out


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = item
                    if item.name == "__init__":
                        out[node.name] = item
    return out


def _imports(nodes: list[ast.stmt], modules: dict[str, ast.Module]) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute or None for a module)."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in nodes:
        for sub in ast.walk(node) if not isinstance(node, ast.FunctionDef) else [node]:
            if isinstance(sub, ast.ImportFrom) and sub.module:
                for a in sub.names:
                    full = f"{sub.module}.{a.name}"
                    out[a.asname or a.name] = (full, None) if full in modules else (sub.module, a.name)
    return out


def _callee(call: ast.Call, module: str, names: dict[str, tuple[str, str | None]],
            funcs: dict[str, dict[str, ast.FunctionDef]]) -> tuple[str, str] | None:
    f = call.func
    if isinstance(f, ast.Name):
        if f.id in names:
            mod, attr = names[f.id]
            return (mod, attr) if attr else None
        return (module, f.id) if f.id in funcs.get(module, {}) else None
    if isinstance(f, ast.Attribute):
        base = f.value
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name):
            base = base.func  # Class(...).method
        if isinstance(base, ast.Name):
            if base.id in names:
                mod, attr = names[base.id]
                return (mod, f.attr) if attr is None else (mod, f"{attr}.{f.attr}")
            if f"{base.id}.{f.attr}" in funcs.get(module, {}):
                return module, f"{base.id}.{f.attr}"
    return None


def _holds(expr: ast.expr, held: set[str]) -> bool:
    """``expr`` is the run directory: a name holding it, an attribute ``run_dir``, the path as
    another type (``Path(run_dir)``, ``str(run_dir)``) or a path under it (``run_dir / NAME``)."""
    if isinstance(expr, ast.Attribute) and expr.attr == "run_dir":
        return True
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("Path", "str"):
        return len(expr.args) == 1 and _holds(expr.args[0], held)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Div):
        return _holds(expr.left, held)  # a path inside it
    return isinstance(expr, ast.Name) and expr.id in held


def walk() -> list[Stop]:
    modules = _modules()
    funcs = {m: _functions(t) for m, t in modules.items()}
    stops: list[Stop] = []
    seen: set[tuple[str, str]] = set()

    def visit(module: str, name: str, param: str) -> None:
        if (module, name) in seen or name not in funcs.get(module, {}):
            return
        seen.add((module, name))
        stops.append(Stop(module, name, param))
        fn = funcs[module][name]
        names = {**_imports(modules[module].body, modules), **_imports(list(ast.walk(fn)), modules)}  # type: ignore[arg-type]
        held = {param}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _holds(node.value, held):
                held |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            target = _callee(node, module, names, funcs)
            if target is None or target[1] not in funcs.get(target[0], {}):
                continue
            callee = funcs[target[0]][target[1]]
            params = [a.arg for a in callee.args.args if a.arg not in ("self", "cls")]
            for i, arg in enumerate(node.args):
                if _holds(arg, held) and i < len(params):
                    visit(target[0], target[1], params[i])
            for kw in node.keywords:
                if kw.arg and _holds(kw.value, held):
                    visit(target[0], target[1], kw.arg)

    visit(*START)
    return stops


def visits(stops: list[Stop]) -> Counter[str]:
    """How often the walk enters each module (a stretch of consecutive stops in it)."""
    out: Counter[str] = Counter()
    last = None
    for s in stops:
        if s.module != last:
            out[s.module] += 1
        last = s.module
    return out


def main() -> int:
    stops = walk()
    for s in stops:
        print(f"{s.module}.{s.function}({s.param})")
    per_module = visits(stops)
    print(f"{len(stops)} stops in {len(per_module)} modules; visits: "
          + ", ".join(f"{m} {n}" for m, n in per_module.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
