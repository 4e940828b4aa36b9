from pathlib import Path

import pytest
import suite_timing

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption(
        "--timing-report", metavar="FILE", default=None,
        help="append each test's wall time and CPU time to FILE (JSON lines; tests/suite_timing.py summarises it)",
    )


def pytest_configure(config):
    path = config.getoption("--timing-report")
    if path:
        config.pluginmanager.register(suite_timing.Recorder(Path(path).absolute()), "suite-timing")


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("--timing-report")
    if path and Path(path).exists() and not hasattr(config, "workerinput"):
        terminalreporter.write_sep("=", "where the time went (tests/suite_timing.py)")
        terminalreporter.write_line(suite_timing.summary(suite_timing.read(Path(path))))


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def runs_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("LMLAUNCH_RUNS_ROOT", str(root))
    return root
