"""No test waits on a fixed wall-clock figure for work whose speed varies with the host.

A wait's verdict must not depend on how fast the machine is (tests/waiting.py: wait while the work
advances, fail when it stalls). This walks the test tree's syntax and finds the figures that say
otherwise: a literal in a ``timeout=``/``deadline=`` argument or default, ``time.monotonic() + 60``,
``proc.wait(30)``/``thread.join(10)``, a hypothesis ``deadline`` that is not None. A figure that is
no verdict on speed (a hang guard far above the work, the length of a window in which something
must NOT happen, a timeout that is the feature under test) is allowed below, each with why.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import waiting

TESTS = Path(__file__).resolve().parents[1]
WAIT_KEYWORDS = {"timeout", "timeout_s", "deadline", "deadline_s", "wait_s"}
WAIT_METHODS = {"wait", "join", "communicate"}

# (file under tests/, text the offending line contains) -> why that figure is no verdict on speed.
ALLOWED: dict[tuple[str, str], str] = {
    ("unit/test_verify_exchange.py", "missing=6, wait_s=2.0"):
        "the exchange's own bound, the feature under test: the missing rank never checks, so the waits end "
        "at it whatever the host's speed (the others publish at once, in milliseconds)",
    ("unit/test_stragglers.py", "and took < 1.0, took"):
        "the scorer's own bound, the feature under test (8,192 ranks scored in under 1 s; it takes "
        "milliseconds, a margin of 100x), timed around the pure call alone",
    ("unit/test_watchdog.py", '""", timeout=1.0, grace='):
        "the watchdog's own timeout and grace, the feature under test (elapsed time is counted from the "
        "watchdog's start, not from the interpreter's)",
    ("unit/test_watchdog.py", "timeout: float = 1.0, grace: float = 2.0"):
        "the watchdog's own timeout and grace (the defaults of the helper that starts it)",
    ("unit/test_container.py", '["scontrol", "ping"], timeout='):
        "the relay's own timeout, the feature under test: no relay answers, the call must give up after it",
    ("unit/test_faults_resume_agreement.py", "timeout_s=5"):
        "the rendezvous' own bound; rank 0 published before, so rank 1 reads it at once (no wait on the host's speed)",
    ("unit/test_faults_resume_agreement.py", "wait_s="):
        "agreed_checkpoint's own wait, the feature under test (a lagging view waited for, then a clear error)",
    ("unit/test_entry_env.py", "timeout_s=20"):
        "the rendezvous' own bound for rank 1 while rank 0 publishes from this thread at once",
    ("unit/test_notify.py", "n.close(wait_s=1.0)"):
        "the notifier's own close bound, the feature under test (it gives up on what is left)",
    ("integration/test_faults_controller.py", "assert not slurm.ping(timeout=3)"):
        "the controller is stopped: the ping is refused at once; the figure only bounds a refusal",
    ("unit/test_watchdog.py", "assert elapsed < 1.0 + "):
        "the watchdog's timeout + linger, the feature under test, counted from the watchdog's start (not the "
        "interpreter's), with 5 s for the scheduler",
    ("unit/test_container.py", "assert time.monotonic() - t < 5"):
        "the relay's 0.3 s timeout, the feature under test; what it rules out (no timeout) never ends",
    ("unit/test_faults_resume_agreement.py", "assert 0.5 < time.monotonic() - t0 < 5"):
        "agreed_checkpoint waited for the checkpoint that appears after 0.7 s (the lower bound is the feature); "
        "the upper one rules out its 10 s wait running out",
    ("unit/test_notify.py", "assert time.perf_counter() - t0 < 1.0"):
        "100 queue puts against what it rules out: a send waiting on the network, 1 s (timeout_s) each",
    ("unit/test_notify.py", "assert time.perf_counter() - t0 < 1.5"):
        "close's own 1 s bound, the feature under test, against the retries it gives up on",
    ("unit/test_stacks_sections.py", "assert time.monotonic() - t0 < 10"):
        "what it rules out, a SLURM call for a run without a job, takes SLURM's 30 s timeout",
    ("integration/test_faults_controller.py", "assert elapsed < 60, elapsed"):
        "what it rules out, waiting for the sbatch wrapper's 60 s sleep, takes at least that figure",
    ("unit/test_remote.py", 'took < 10.0, (took, err)'):
        "'stops at once' against what it rules out: ssh trying an unreachable login node without a master "
        "(a TCP connect that waits for the network's answer, or ssh's own timeout)",
    ("integration/preempt_helpers.py", "time.monotonic() - first_seen < 2.0"):
        "no wait: a requeued job is started only once its BeginTime is 2 s old (SLURM kills one started "
        "within the second of its requeue)",
    ("integration/slurm_helpers.py", "time.monotonic() - first >= 2.0"):
        "no wait: a requeued job is started only once its BeginTime is 2 s old (as in preempt_helpers)",
    ("integration/sshd_helpers.py", "self.proc.wait(timeout=10)"):
        "sshd is killed after it: no verdict, only how long a terminate may take before the kill",
}


def _is_number(node: ast.AST) -> bool:
    """A literal number, or arithmetic of literal numbers (``2 * 60``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool) and node.value != 0
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    return False


def _has_number(node: ast.AST) -> bool:
    return any(_is_number(n) for n in ast.walk(node))


def _is_wait_name(name: str) -> bool:
    return name in WAIT_KEYWORDS or name.startswith("timeout")


def _is_elapsed(node: ast.Compare) -> bool:
    """``elapsed < 10``, ``time.monotonic() - t0 < 5``, ``0.5 < time.monotonic() - t0 < 5``."""
    sides = [node.left, *node.comparators]
    return any(
        (isinstance(s, ast.BinOp) and isinstance(s.op, ast.Sub) and (_is_clock(s.left) or _is_clock(s.right)))
        or (isinstance(s, ast.Name) and any(w in s.id for w in ("elapsed", "outage", "took")))
        for s in sides)


def _is_clock(node: ast.AST) -> bool:
    """``time.monotonic()``, ``time.time()``, ``monotonic()``, ``time.perf_counter()``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in {"monotonic", "time", "perf_counter"} and not node.args


def timeout_positions(source: str) -> dict[str, int]:
    """The functions of ``source`` that take a timeout, and its position: a literal passed in its
    place is a figure too (whichever test module calls them)."""
    return {
        f.name: i for f in ast.walk(ast.parse(source)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for i, a in enumerate(f.args.posonlyargs + f.args.args) if _is_wait_name(a.arg)
    }


def fixed_waits(source: str, timeout_at: dict[str, int] | None = None) -> list[tuple[int, str]]:
    """(line, what) for every fixed wall-clock figure in a wait in ``source`` (``timeout_at``: the
    helpers of other modules that take a timeout, by name)."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    timeout_at = {**(timeout_at or {}), **timeout_positions(source)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in WAIT_KEYWORDS and _has_number(kw.value):
                    found.append((kw.value.lineno, f"{kw.arg}= a literal figure"))
            i = timeout_at.get(node.func.id) if isinstance(node.func, ast.Name) else None
            if i is not None and len(node.args) > i and _is_number(node.args[i]):
                found.append((node.args[i].lineno, f"a literal figure as {node.func.id}()'s timeout"))
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in WAIT_METHODS and node.args and _is_number(node.args[0]):
                found.append((node.lineno, f".{f.attr}() with a literal figure"))
        elif isinstance(node, ast.Compare) and _is_elapsed(node) and any(_has_number(c) for c in node.comparators):
            found.append((node.lineno, "elapsed time compared with a literal figure"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            if (_is_clock(node.left) and _has_number(node.right)) or (_is_clock(node.right) and _has_number(node.left)):
                found.append((node.lineno, "a deadline of the clock plus a literal figure"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if _is_wait_name(arg.arg) and _is_number(default):
                    found.append((default.lineno, f"parameter {arg.arg} defaults to a literal figure"))
    return sorted(set(found))


def _offences() -> list[str]:
    out = []
    used: set[tuple[str, str]] = set()
    paths = [p for p in sorted(TESTS.rglob("*.py")) if p.relative_to(TESTS).as_posix() != "unit/test_waits.py"]
    helpers: dict[str, int] = {}
    for path in paths:
        helpers.update(timeout_positions(path.read_text()))
    for path in paths:
        rel = path.relative_to(TESTS).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        for line, what in fixed_waits(text, helpers):
            src = lines[line - 1]
            key = next((k for k in ALLOWED if k[0] == rel and k[1] in src), None)
            if key is not None:
                used.add(key)
                continue
            out.append(f"tests/{rel}:{line}: {what}: {src.strip()}")
    out += [f"allow-list entry matches nothing (remove it): {k}" for k in ALLOWED if k not in used]
    return out


def test_no_wait_in_the_tests_is_a_fixed_wall_clock_figure():
    offences = _offences()
    assert not offences, (
        "waits bounded by a fixed wall-clock figure (use tests/waiting.py: waiting.until with a progress "
        "function, waiting.HANG_S for a hang guard; or allow it in ALLOWED with why):\n" + "\n".join(offences))


def test_the_check_finds_each_kind_of_fixed_wait():
    source = '''
import time, subprocess
def wait_job(job, timeout: float = 120.0): ...
def f(proc, thread):
    deadline = time.monotonic() + 60
    subprocess.run(["x"], timeout=30)
    proc.wait(5)
    thread.join(timeout=2 * 60)
    wait_job("1", timeout=300)
    wait_job("1", 60)
    elapsed = time.monotonic() - deadline
    assert elapsed < 10
    assert time.monotonic() - elapsed < 5
@settings(deadline=5000)
def g(): ...
'''
    kinds = [what for _line, what in fixed_waits(source)]
    assert kinds == [
        "parameter timeout defaults to a literal figure",
        "a deadline of the clock plus a literal figure",
        "timeout= a literal figure",
        ".wait() with a literal figure",
        "timeout= a literal figure",
        "timeout= a literal figure",
        "a literal figure as wait_job()'s timeout",
        "elapsed time compared with a literal figure",
        "elapsed time compared with a literal figure",
        "deadline= a literal figure",
    ], kinds


def test_a_literal_in_place_of_another_modules_timeout_is_found_too():
    assert fixed_waits("from helpers import wait_nodes\nwait_nodes(60)\n", {"wait_nodes": 0}) == [
        (2, "a literal figure as wait_nodes()'s timeout")]


def test_the_check_leaves_progress_bounded_waits_and_named_guards_alone():
    source = '''
import time, subprocess, waiting
from waiting import HANG_S
def f(proc, run_dir, stall_s=None):
    subprocess.run(["x"], timeout=HANG_S)
    proc.wait(timeout=waiting.HANG_S)
    waiting.until(lambda: True, progress=waiting.tree(run_dir), what="x")
    started = time.monotonic()
    elapsed = time.monotonic() - started
    time.sleep(0.5)
@settings(deadline=None)
def g(): ...
'''
    assert fixed_waits(source) == []


def test_a_wait_goes_on_while_its_work_advances_and_fails_once_it_stalls(monkeypatch):
    monkeypatch.setattr(waiting, "PROGRESS_EVERY_S", 0.0)
    ticks = iter(range(10**6))
    started = time.monotonic()
    # the work advances every poll for 0.6 s (three times the stall window), then arrives
    got = waiting.until(lambda: time.monotonic() - started > 0.6 and "there", progress=lambda: next(ticks),
                        what="advancing work", poll=0.01, stall_s=0.2)
    assert got == "there"
    with pytest.raises(waiting.Stalled, match=r"stuck work: not reached after \d+ s, nothing advanced for"):
        waiting.until(lambda: False, progress=lambda: "same", what="stuck work", poll=0.01, stall_s=0.2,
                      explain=lambda: "the explanation")
    with pytest.raises(waiting.Stalled, match="still advancing after the 0 s cap"):
        waiting.until(lambda: False, progress=lambda: next(ticks), what="a loop", poll=0.01, stall_s=10, cap_s=0.3)


def test_progress_of_files_and_processes_changes_with_them(tmp_path):
    files = waiting.tree(tmp_path)
    empty = files()
    (tmp_path / "log").write_text("step 1\n")
    assert files() != empty
    before = files()
    with (tmp_path / "log").open("a") as f:
        f.write("step 2\n")
    assert files() != before
    cpu = waiting.process_cpu(__import__("os").getpid())
    first = cpu()
    t = time.process_time()
    while time.process_time() - t < 0.1:  # burn a few clock ticks
        pass
    assert cpu() > first
