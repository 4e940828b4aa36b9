"""Integration tests against the real local SLURM cluster (`lmlaunch cluster up`).

The session fixture starts the cluster (fast when it already runs). Tests are skipped only
when SLURM cannot be installed on this machine (not root and the packages are missing).
Other people submit to the same cluster at the same time: every test uses a unique run name
and waits for its own job ids only.

Run in parallel (pytest-xdist), each worker has a cluster of its own
(launcher/localcluster/workers.py): it claims a slot when it starts and points LMLAUNCH_CLUSTER_DIR
and SLURM_CONF at that cluster in its own environment, which everything it runs and submits
inherits. A serial run (`-n 0`) uses the primary cluster.

LMLAUNCH_TEST_SLURM=24.11 (or 22.05) runs them on that SLURM version's clusters instead of the
machine's own: on the other Debian release's SLURM, from a Debian root
(launcher/localcluster/debian_root.py). scripts/test.sh runs the tests marked `both_versions`
so after the rest.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import pytest
from slurm_helpers import REPO, cancel_orphaned_test_jobs, claim_session, job_name, wait_nodes_usable  # noqa: F401  (tests/integration is on sys.path)

from launcher.cli import main
from launcher.context import Context
from lmcore.errors import UserError
from lmcore.slurm import client as slurm

_CLAIM = None  # this worker's cluster (launcher.localcluster.workers.Claim); None when serial
VERSION = os.environ.get("LMLAUNCH_TEST_SLURM") or None  # None: the machine's own SLURM


def pytest_configure(config):
    """A pytest-xdist worker claims its own cluster before any test (or module fixture) reads the
    environment."""
    global _CLAIM
    if os.environ.get("PYTEST_XDIST_WORKER") and _CLAIM is None:
        from launcher.localcluster import workers

        _CLAIM = workers.claim(VERSION)
        os.environ.update(_CLAIM.environ())
    elif VERSION is not None and _CLAIM is None:
        from launcher.localcluster import cluster
        from launcher.localcluster.config import Layout, primary_root

        os.environ.update(cluster.environ_of(Layout(primary_root(VERSION)), VERSION))


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster, started once per session."""
    from launcher.localcluster import cluster

    if cluster.missing_packages() and os.geteuid() != 0:
        pytest.skip(
            "SLURM cannot be installed here: missing Debian packages "
            f"{' '.join(cluster.missing_packages())} and not root (apt-get install -y {' '.join(cluster.APT_PACKAGES)})"
        )
    lines: list[str] = []
    try:
        # the user signal on preemption, accounting and MinJobAge named: a test may have left the
        # cluster without them (a run killed inside user_signal_on_preemption(True) left it on)
        if _CLAIM is None:  # two CPU nodes and no topology, as the tests expect, whatever `up` a developer left
            cluster.up(lines.append, version=VERSION, preempt_send_user_signal=False, nodes=2, topology="none",
                       gpus="none")
        else:
            cluster.up(lines.append, layout=_CLAIM.layout, ports=_CLAIM.ports, system_conf=False, version=VERSION,
                       accounting=True, min_job_age=300, preempt_send_user_signal=False, nodes=2, topology="none",
                       gpus="none")
    except UserError as exc:
        pytest.fail(f"`lmlaunch cluster up` failed: {exc.message}\n" + "\n".join(lines))
    layout = cluster.Layout.default()  # the worker's own when parallel (LMLAUNCH_CLUSTER_DIR)
    leases = layout.root / "test-sessions"
    orphans = cancel_orphaned_test_jobs(leases)
    lease = claim_session(leases)
    if orphans:
        print(f"cancelled {len(orphans)} job(s) of test sessions that are gone: "
              + ", ".join(f"{j.job_id} {j.name}" for j in orphans))
        wait_nodes_usable()
    yield layout
    lease.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _nodes_back_in_service(request):
    """After a test on the cluster, its nodes back in service before the worker's next test: one
    that set a node DOWN or DRAINED and resumed it leaves it unresponsive (``idle*``) a few
    seconds, and the next test's `sbatch --test-only` would be refused meanwhile."""
    yield
    if "slurm_cluster" in request.fixturenames:
        from launcher.localcluster import cluster

        if not cluster.nodes_ready():
            wait_nodes_usable()


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def lm_env(tmp_path, monkeypatch) -> dict[str, str]:
    """A private LMLAUNCH_HOME (registry) and runs root for one test."""
    home = tmp_path / "home"
    runs = tmp_path / "runs"
    monkeypatch.setenv("LMLAUNCH_HOME", str(home))
    monkeypatch.setenv("LMLAUNCH_RUNS_ROOT", str(runs))
    return dict(os.environ)


@pytest.fixture
def cli(lm_env, slurm_cluster):
    """Run `lmlaunch ARGS...` in-process with captured output and the test's environment (the
    cluster up: a worker's own cluster starts when its first test needs it)."""

    def run(*args: str, env: dict[str, str] | None = None) -> CliResult:
        out, err = io.StringIO(), io.StringIO()
        ctx = Context(stdout=out, stderr=err, environ=dict(env or lm_env))
        code = main([str(a) for a in args], ctx)
        return CliResult(code, out.getvalue(), err.getvalue())

    return run


@pytest.fixture
def run_name(request) -> str:
    """Unique per test: concurrent sessions share the cluster."""
    stem = request.node.name.removeprefix("test_").replace("_", "-")[:24]
    return job_name("it", stem)


def _cancel_quietly(ids: list[str]) -> None:
    if ids:
        try:
            slurm.cancel(ids)
        except UserError:
            pass  # cleanup must not hide the test's own failure


@pytest.fixture
def own_jobs():
    """Job ids a test started; any still queued or running at the end are cancelled."""
    ids: list[str] = []
    yield ids
    _cancel_quietly(ids)


@pytest.fixture(scope="module")
def module_env(slurm_cluster, tmp_path_factory):
    """One registry and runs root for a test module (tests that share a reference run), on this
    worker's cluster as the session set it up (a test run alone once found its slot's cluster
    left without accounting by test_no_accounting, and classified a node failure as a preemption)."""
    root = tmp_path_factory.mktemp("module")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMLAUNCH_HOME", str(root / "home"))
        mp.setenv("LMLAUNCH_RUNS_ROOT", str(root / "runs"))
        yield dict(os.environ)


@pytest.fixture(scope="module")
def module_jobs():
    """Job ids a test module started; any still queued or running at its end are cancelled."""
    ids: list[str] = []
    yield ids
    _cancel_quietly(ids)
