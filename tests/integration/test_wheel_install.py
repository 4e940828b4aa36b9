"""lmlaunch as a lab's engineer installs it: the package built as a wheel, installed by a user
without root into a fresh venv of their own, with no checkout on the path; then `--version`,
`examples`, `data prepare --shipped-corpus`, `profile init`, `validate` and a real submission to
the local cluster that trains to COMPLETED, run as that user (the tasks run the run's code snapshot,
taken from the installed wheel).

The training stack itself (torch, Lightning, transformers, DeepSpeed: 1.9 GB) is not installed
again: the user's venv reads it from the checkout's environment through a .pth file, as a site's
shared module or conda environment provides it; lmlaunch's own packages come from the wheel alone
(the environment's editable install is a .pth hook its site-packages would run; a directory named
by a .pth file is only put on the path, its hooks are never run).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_helpers import REPO, job_name, wait_terminal
from waiting import HANG_S

USER = "lmwheel"


def _user() -> pwd.struct_passwd:
    """The test's unprivileged account (made once per machine)."""
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(USER)
    subprocess.run(["useradd", "-m", "-d", f"/home/{USER}", "-s", "/bin/bash", USER], check=True)
    return pwd.getpwnam(USER)


@contextlib.contextmanager
def _reachable(*paths: Path) -> Iterator[None]:
    """The base interpreter (pyenv's under /root, mode 0700 here) and the environment of the
    training stack traversable by others while the user installs and its job runs, as a site's
    Python and shared modules are; each directory's mode restored after."""
    changed = []
    for d in dict.fromkeys(d for path in paths for d in reversed(path.parents)):
        mode = d.stat().st_mode
        if not mode & stat.S_IXOTH:
            d.chmod(mode | stat.S_IXOTH)
            changed.append((d, mode))
    try:
        yield
    finally:
        for d, mode in changed:
            d.chmod(stat.S_IMODE(mode))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[Path]:
    """lmlaunch's wheel, built from a copy of the working tree (the checkout is never written), in a
    directory the user can read (pytest's own are its owner's alone)."""
    src, out = tmp_path_factory.mktemp("wheel-src"), Path(tempfile.mkdtemp(prefix="lmlaunch-wheel-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, timeout=HANG_S)
    built = next(out.glob("lmlaunch-*.whl"))
    built.chmod(0o644)
    out.chmod(0o755)
    yield built
    shutil.rmtree(out, ignore_errors=True)


def _as_user(script: str, env: dict[str, str]) -> str:
    proc = subprocess.run(["runuser", "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                           "bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=HANG_S,
                          cwd=env["HOME"])  # not the checkout: `python -c` puts its directory first on the path
    assert proc.returncode == 0, f"as {USER}: {script}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="makes an unprivileged account to install as (needs root)")
def test_the_wheel_installed_by_a_user_without_root_validates_and_trains_to_completed(slurm_cluster, wheel, own_jobs):
    user = _user()
    home = Path(user.pw_dir)
    for old in ("venv", "lm", ".lmlaunch", ".cache"):
        shutil.rmtree(home / old, ignore_errors=True)
    base = Path(sys.base_prefix) / "bin" / f"python{sysconfig.get_python_version()}"
    stack = sysconfig.get_paths()["purelib"]  # the environment the training stack is installed in
    env = {"HOME": str(home), "USER": USER, "PATH": f"{home}/venv/bin:{os.environ['PATH']}",
           **{k: os.environ[k] for k in ("SLURM_CONF", "LMLAUNCH_CLUSTER_DIR") if k in os.environ}}
    name = job_name("it", "wheel")
    with _reachable(base, Path(stack) / "x", Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))):
        out = _as_user(f"""
            {base} -m venv ~/venv
            echo {stack} > ~/venv/lib/python{sysconfig.get_python_version()}/site-packages/shared-stack.pth
            ~/venv/bin/pip install -q --no-deps --no-index {wheel}
            lmlaunch --version
            python -c 'import launcher, lmcore, lmtrain; print("FROM", launcher.__file__, lmcore.__file__, lmtrain.__file__)'
            lmlaunch examples ~/lm
            lmlaunch data prepare --shipped-corpus --out ~/lm/data/prepared/tiny
            lmlaunch profile init mine
            lmlaunch validate ~/lm/jobs/tiny-cpu.yaml
            """, env)
        assert f"lmlaunch 0.1.0 ({home}/venv/lib/" in out, out
        froms = next(line for line in out.splitlines() if line.startswith("FROM ")).split()[1:]
        assert all(f.startswith(f"{home}/venv/") for f in froms), froms  # the wheel's code, not the checkout's
        assert "wrote 15 example specs" in out and "tokenizer bytes" in out, out
        assert f"wrote {home}/.lmlaunch/profiles/mine.yaml" in out, out
        assert f"ok: {home}/lm/jobs/tiny-cpu.yaml is valid for cluster 'local'" in out, out
        out = _as_user(f"lmlaunch submit ~/lm/jobs/tiny-cpu.yaml name={name} trainer.max_steps=12 "
                       "trainer.val_check_interval=6 checkpoint.every_n_steps=6", env)
        job = re.search(r"\bjob (\d+)", out)
        assert job, out
        own_jobs.append(job.group(1))
        assert wait_terminal(job.group(1)) == "COMPLETED"
        status = _as_user(f"lmlaunch status {name}", env)
    assert "COMPLETED" in status and "12/12" in status, status
    run_dir = home / ".lmlaunch" / "runs" / name
    assert (run_dir / "DONE").is_file() and run_dir.stat().st_uid == user.pw_uid
    snapshot = run_dir / "code"
    assert (snapshot / "lmtrain").is_dir() and (snapshot / "launcher").is_dir(), sorted(os.listdir(snapshot))
