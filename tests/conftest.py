from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def runs_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("LMLAUNCH_RUNS_ROOT", str(root))
    return root
