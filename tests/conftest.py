"""Suite-wide options: where the time goes (--timing-report), the two phases scripts/test.sh runs
(--phase), the order tests are handed to parallel workers, results shared across workers, and one
zygote per test process that local launches fork their ranks from (lmtrain.local.zygote)."""

import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import shared_results
import suite_timing

REPO = Path(__file__).resolve().parent.parent
# Each test's wall seconds from a parallel run (tests/suite_timing.py FILE --write-durations): the
# longest tests are started first so that no long test is left for the end of a parallel run.
DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_TEST_S = 2.0
LONG_TEST_S = 10.0


def pytest_addoption(parser):
    parser.addoption(
        "--timing-report", metavar="FILE", default=None,
        help="append each test's wall time and CPU time to FILE (JSON lines; tests/suite_timing.py summarises it)",
    )
    parser.addoption(
        "--phase", choices=("parallel", "serial", "other-slurm"), default=None,
        help="parallel: every test but those marked serial; serial: only those (scripts/test.sh runs both, "
             "the serial ones alone after the others); other-slurm: those marked both_versions but not "
             "serial (run with LMLAUNCH_TEST_SLURM set); default: all",
    )


def pytest_configure(config):
    # Collection imports torch, Lightning and transformers: with the collector paused until it
    # ends (pytest_collection_finish), as a task's imports are (lmtrain.observe.startup.imports_without_gc).
    # Not in an xdist controller: it collects nothing, so that hook never runs there.
    if not _xdist_controller(config):
        gc.disable()
    path = config.getoption("--timing-report")
    if path:
        config.pluginmanager.register(suite_timing.Recorder(Path(path).absolute(), config.getoption("--phase")), "suite-timing")
    _start_zygote(config)


def _xdist_controller(config) -> bool:
    """This process hands tests to xdist workers and runs none itself."""
    return bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")


def _start_zygote(config) -> None:
    """Local launches (lmtrain.local.launch, also `lmlaunch run --local` started by a test) fork their ranks
    from one zygote of this test process, which imported torch, Lightning and transformers once,
    instead of each rank importing them (about 9 CPU-s each on this machine, ~250 ranks in the suite).
    A launch whose environment differs in a variable the frameworks read at import starts plain
    processes. Not in an xdist controller (it runs no test); LMTRAIN_ZYGOTE=off turns it off."""
    from lmtrain.local import zygote

    if os.environ.get(zygote.SHARED_ENV) == "off" or _xdist_controller(config):
        return
    where = Path(tempfile.mkdtemp(prefix="lmtrain-test-zygote-"))
    with open(where / "zygote.log", "ab") as log:
        proc = zygote.Zygote.spawn(os.environ, where / "sock", log=log)
    os.environ[zygote.SHARED_ENV] = str(where / "sock")
    config.add_cleanup(lambda: (zygote.stop(proc), shutil.rmtree(where, ignore_errors=True)))


def _known_durations() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist load` hands tests out longest first, never a long one held behind another
    (tests/scheduling.py)."""
    if config.getoption("dist") != "load":
        return None
    from scheduling import LongestFirst

    return LongestFirst(config, log, seconds=_known_durations(), unknown_s=UNKNOWN_TEST_S)


def _order(items) -> None:
    """Longest first, so that no long test is left for the end of a parallel run: every test of
    LONG_TEST_S or more on its own, by its measured seconds; then the other modules, longest (summed)
    first, each module's tests together and in pytest's order (its module fixtures set up once)."""
    known = _known_durations()
    if not known:
        return
    seconds = {item.nodeid: float(known.get(item.nodeid, UNKNOWN_TEST_S)) for item in items}
    totals: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        totals[module] = totals.get(module, 0.0) + seconds[item.nodeid]
        first_seen.setdefault(module, i)

    def key(item) -> tuple:
        if seconds[item.nodeid] >= LONG_TEST_S:
            return (0, -seconds[item.nodeid], 0)
        module = item.nodeid.split("::")[0]
        return (1, -totals[module], first_seen[module])

    items.sort(key=key)  # stable: a module's short tests keep their order


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()


def pytest_collection_modifyitems(config, items):
    phase = config.getoption("--phase")
    if phase is not None:
        keep, drop = [], []
        for item in items:
            serial = item.get_closest_marker("serial") is not None
            wanted = (not serial and item.get_closest_marker("both_versions") is not None
                      if phase == "other-slurm" else serial == (phase == "serial"))
            (keep if wanted else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    _order(items)  # a stable sort: tests of one module keep pytest's order (and its fixture grouping)


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("--timing-report")
    if path and Path(path).exists() and not hasattr(config, "workerinput"):
        terminalreporter.write_sep("=", "where the time went (tests/suite_timing.py)")
        terminalreporter.write_line(suite_timing.summary(suite_timing.read(Path(path))))


@pytest.fixture(scope="session", autouse=True)
def _shared_results(tmp_path_factory):
    shared_results.configure(tmp_path_factory)


@pytest.fixture(autouse=True)
def _own_lmlaunch_home(tmp_path_factory, monkeypatch):
    """Every test starts with a registry, user profiles and runs root of its own (LMLAUNCH_HOME,
    LMLAUNCH_RUNS_ROOT; a test or fixture may set its own after): the user's runs never decide a
    test (the demo's run 'tiny-cpu' in ~/.lmlaunch makes a dry run of that name refuse it, as submit
    does)."""
    home = tmp_path_factory.mktemp("lmhome")
    monkeypatch.setenv("LMLAUNCH_HOME", str(home))
    monkeypatch.setenv("LMLAUNCH_RUNS_ROOT", str(home / "runs"))


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def runs_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("LMLAUNCH_RUNS_ROOT", str(root))
    return root
