"""A Debian root that holds another release's SLURM: the local cluster's second SLURM version.

Debian 12's packages give SLURM 22.05 and Debian 13's give 24.11. A machine of either release
runs its own SLURM natively (cluster.py) and the other one from a root made by ``debootstrap``
under ``/var/lib/lmlaunch-roots/<release>``, with that release's slurm-wlm, slurmdbd, munge and
MariaDB installed in it. A SLURM client cannot talk to a controller of another major version, so
everything of that cluster runs inside the root (``chroot``): its daemons, its jobs and its
client commands. The root sees this machine's files where they are (the paths in
:func:`shared_paths` bind-mounted at the same place: the checkout, the Python and its venv,
/tmp, the homes, the cluster state), as the nodes of a real cluster see a shared filesystem, so
a job script written here runs there unchanged. Its own /etc and /run keep its munged and
/etc/hosts apart from the machine's.

The cluster's client commands are small wrappers in ``<state>/bin`` (:func:`write_wrappers`)
that enter the root; with that directory first on PATH (``lmlaunch cluster env``), lmlaunch,
submitit and a user's shell use that cluster as if its SLURM were installed here. Inside the
root the same wrappers run the root's own commands (a job's ``srun`` or submitit's ``scontrol
requeue`` find them on the PATH the job inherited).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from launcher.localcluster.config import SLURM_RELEASES, base_root
from launcher.localcluster.daemons import ClusterError, run_checked
from lmcore.errors import ExitCode, UserError

ROOTS = Path("/var/lib/lmlaunch-roots")
MARKER = Path("etc/lmlaunch-debian-root")  # in the root: written once its packages are installed
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# the cluster's packages, and what the machine's Python needs from the root's libraries
PACKAGES = (
    "slurm-wlm", "slurmdbd", "munge", "mariadb-server", "mariadb-client",
    "libffi8", "zlib1g", "libbz2-1.0", "liblzma5", "libsqlite3-0", "libexpat1",
    "procps", "iproute2", "ca-certificates",
    # DeepSpeed's CPU communication op is JIT-loaded through ninja (and rebuilt with g++ when stale)
    "ninja-build", "g++",
)
RELEASE_PACKAGES = {
    "bookworm": ("libssl3",),
    # libssl3 renamed in 13; slurmrestd and its JWT plugin for submission through REST (restd.py)
    "trixie": ("libssl3t64", "slurmrestd", "slurm-wlm-jwt-plugin"),
    "sid": ("libssl3t64", "slurmrestd", "slurm-wlm-jwt-plugin"),
}
# apt's options per release: unstable's Release file on a mirror snapshot is often past its Valid-Until
APT_OPTIONS = {"sid": "-o Acquire::Check-Valid-Until=false "}
CLIENT_COMMANDS = (
    "sbatch", "srun", "salloc", "squeue", "sacct", "sacctmgr", "scontrol", "scancel", "sinfo",
    "sprio", "sshare", "sstat", "sattach", "sbcast", "sdiag", "sreport", "strigger",
)
# the machine's directories a job may read or write, seen at the same paths inside the root
SHARED_DIRS = ("/tmp", "/root", "/home", "/work", "/srv", "/opt", "/check")
# The root's own system, never covered by the machine's: a venv made from /usr/bin/python3 has
# sys.base_prefix /usr, and the machine's /usr mounted there hid the root's SLURM behind the
# machine's (its "24.11" daemons were the machine's 22.05). /usr/local is the machine's own.
OS_DIRS = (
    "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/run", "/proc",
    "/sys", "/dev", "/var/lib/dpkg", "/var/lib/apt", "/var/cache", "/var/log", "/var/lib/mysql",
    "/var/lib/slurm", "/var/spool", "/var/run",
)
Say = Callable[[str], None]


def root_dir(version: str) -> Path:
    return ROOTS / SLURM_RELEASES[version]


def inside_root() -> bool:
    """True in a process that runs in one of these roots."""
    return (Path("/") / MARKER).exists()


def shared_paths(extra: str | None = None) -> list[Path]:
    """What the root sees of this machine: SHARED_DIRS, the cluster state, this checkout, the
    Python and its venv, and LMLAUNCH_SHARED_PATHS (colon-separated); nested ones are dropped."""
    repo = Path(__file__).resolve().parents[2]
    wanted = [Path(d) for d in SHARED_DIRS] + [base_root(), repo, Path(sys.prefix), Path(sys.base_prefix)]
    extra = os.environ.get("LMLAUNCH_SHARED_PATHS", "") if extra is None else extra
    wanted += [Path(p) for p in extra.split(":") if p]
    found = sorted({p.resolve() for p in wanted if p.is_dir() and not system_path(p.resolve())},
                   key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in found:
        if p.is_relative_to(ROOTS) or any(p.is_relative_to(k) for k in kept):
            continue
        kept.append(p)
    return kept


def system_path(path: Path) -> bool:
    """``path`` is, holds or lies in the root's own system (OS_DIRS; / too): never shared."""
    if path.is_relative_to("/usr/local"):
        return False
    return any(path.is_relative_to(d) or Path(d).is_relative_to(path) for d in OS_DIRS)


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (its sources name one that is reachable)."""
    for src in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = src.read_text()
        except OSError:
            continue
        for word in text.split():
            if word.startswith(("http://", "https://")) and word.rstrip("/").endswith("/debian"):
                return word.rstrip("/")
    return DEFAULT_MIRROR


def _mountinfo() -> dict[str, str]:
    """Mount point -> the mounted path within its filesystem ("…//deleted" once its source went)."""
    with open("/proc/self/mountinfo") as f:
        return {fields[4]: fields[3] for fields in (line.split() for line in f)}


def _mounted() -> set[str]:
    return set(_mountinfo())


def ensure_mounts(root: Path) -> None:
    """/proc, /sys and /dev, and the shared paths, bind-mounted into the root (idempotent). Each
    is made a slave mount: unmounting it later never reaches the machine's own. A mount under the
    root that is not one of these (left by an earlier lmlaunch, or whose source was deleted) is
    taken away first."""
    sources = [Path("/proc"), Path("/sys"), Path("/dev"), *shared_paths()]
    targets = [str(root / src.relative_to("/")) for src in sources]
    prefix = str(root).rstrip("/") + "/"
    info = _mountinfo()
    for point in sorted((m for m in info if m.startswith(prefix)), key=len, reverse=True):
        wanted = any(point == t or point.startswith(t.rstrip("/") + "/") for t in targets)
        stale = point in targets and info[point].endswith("//deleted")
        if (not wanted or stale) and point in _mounted():
            run_checked(["umount", "-R", "-l", point], f"unmounting {point}")
    mounted = _mounted()
    for src, target in zip(sources, targets):
        if target in mounted:
            continue
        Path(target).mkdir(parents=True, exist_ok=True)
        run_checked(["mount", "--rbind", str(src), target], f"mounting {src} into {root}")
        run_checked(["mount", "--make-rslave", target], f"mounting {src} into {root}")


def unmount(root: Path) -> list[str]:
    """Undo ensure_mounts (deepest first); returns what was unmounted."""
    prefix = str(root).rstrip("/") + "/"
    done = []
    for point in sorted((m for m in _mounted() if m.startswith(prefix)), key=len, reverse=True):
        if point in _mounted():
            run_checked(["umount", "-R", "-l", point], f"unmounting {point}")
            done.append(point)
    return done


def _remove_root(root: Path) -> None:
    """Delete a half-made root: only once nothing of the machine is mounted in it (a recursive
    delete would go on into the machine's own /tmp, /root, /work...)."""
    unmount(root)
    prefix = str(root).rstrip("/") + "/"
    left = sorted(m for m in _mounted() if m.startswith(prefix))
    if left:
        raise ClusterError(f"not deleting the half-made root {root}: still mounted in it: {', '.join(left)}")
    shutil.rmtree(root, ignore_errors=True)


def ensure_root(version: str, say: Say) -> Path:
    """The root of ``version``'s Debian release with its packages installed (made once: about a
    minute of debootstrap and two of apt-get)."""
    root = root_dir(version)
    packages = PACKAGES + RELEASE_PACKAGES.get(SLURM_RELEASES[version], ())
    _python_shareable(version)
    marker = f"SLURM {version}: made by `lmlaunch cluster up --slurm {version}`\npackages: {' '.join(packages)}\n"
    if (root / MARKER).exists() and (root / MARKER).read_text() == marker:
        ensure_mounts(root)
        _same_names(root)
        _python_runs(root, version)
        return root
    if os.geteuid() != 0:
        raise UserError(
            f"SLURM {version} runs here from a Debian {SLURM_RELEASES[version]} root made by debootstrap, "
            f"which needs root: as root run `lmlaunch cluster up --slurm {version}`", exit_code=1)
    if shutil.which("chroot") is None or shutil.which("mount") is None:
        raise ClusterError("making a Debian root needs chroot and mount (coreutils, mount)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    if shutil.which("debootstrap", path=env["PATH"]) is None:
        say("installing debootstrap (apt-get)")
        run_checked(["apt-get", "install", "-y", "-qq", "debootstrap"], "apt-get install debootstrap", env=env, timeout=600)
    if not (root / "usr/bin/apt-get").exists():
        release, mirror = SLURM_RELEASES[version], apt_mirror()
        say(f"making a Debian {release} root in {root} (debootstrap from {mirror})")
        _remove_root(root)  # a half-made one from an interrupted run
        root.parent.mkdir(parents=True, exist_ok=True)
        run_checked(["debootstrap", "--variant=minbase", release, str(root), mirror],
                    "debootstrap", env=env, timeout=1200)
    ensure_mounts(root)
    _same_names(root)
    say(f"installing SLURM {version} and what it needs in {root} (apt-get)")
    options = APT_OPTIONS.get(SLURM_RELEASES[version], "")
    apt = f"apt-get {options}update -qq && apt-get install -y -qq --no-install-recommends " + " ".join(packages)
    run_checked(["chroot", str(root), "/bin/sh", "-c", apt], f"apt-get install in {root}", env=env, timeout=1800)
    (root / MARKER).write_text(marker)  # a later lmlaunch that needs more packages installs them
    _python_runs(root, version)
    return root


def _python_shareable(version: str) -> None:
    """The system's own Python (under /usr) is not shared into the root at all: said before
    anything is made."""
    base = Path(sys.base_prefix).resolve()
    if system_path(base):
        raise UserError(
            f"this machine's Python ({sys.executable}) is built on the system's, under {base}, which the Debian "
            f"{SLURM_RELEASES[version]} root cannot share (it has its own {base}); the SLURM {version} cluster "
            "runs its jobs there. Make the virtualenv from a Python outside /usr (pyenv's, /usr/local's, /opt's: "
            "scripts/setup.sh takes one when it finds it, or the one LMLAUNCH_PYTHON names)",
            exit_code=ExitCode.UNAVAILABLE)


def _python_runs(root: Path, version: str) -> None:
    """This Python must run inside the root: the cluster's `up` and every job's ranks run there.
    A Python built on a newer Debian may need a newer glibc than an older release's root has."""
    proc = subprocess.run(inside(root, [sys.executable, "-c", "import ctypes, ssl, sqlite3, lzma"]),
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise UserError(
            f"this machine's Python ({sys.executable}) does not run in the Debian {SLURM_RELEASES[version]} root "
            f"{root}, where the SLURM {version} cluster runs its jobs: {(proc.stderr or proc.stdout).strip()[-400:]}. "
            f"A Python built for an older Debian (or a manylinux one) runs in both releases' roots",
            exit_code=ExitCode.UNAVAILABLE)


def _same_names(root: Path) -> None:
    """The root resolves names as the machine does (its hostname, localhost, the nodes): MariaDB's
    and SLURM's daemons look their host up. Its /etc/hosts starts as a copy of the machine's."""
    hosts, own = Path("/etc/hosts"), root / "etc/hosts"
    try:
        have = own.read_text().splitlines()
    except FileNotFoundError:  # a minbase trixie root has none (netbase, which ships it, is not in minbase)
        have = []
    missing = [line for line in hosts.read_text().splitlines()
               if line.strip() and not line.lstrip().startswith("#") and line not in have]
    if missing or not own.exists():
        with own.open("a") as f:
            f.write("".join(line + "\n" for line in missing))
    resolv = Path("/etc/resolv.conf")
    if resolv.exists() and not (root / "etc/resolv.conf").exists():
        shutil.copyfile(resolv, root / "etc/resolv.conf")


def inside(root: Path, argv: list[str], cwd: str | None = None) -> list[str]:
    """``argv`` run inside the root, in ``cwd`` (a shared path; default /)."""
    return ["chroot", str(root), "/usr/bin/env", f"--chdir={cwd or '/'}", *argv]


def write_wrappers(root: Path, bindir: Path) -> None:
    """``bindir/<command>`` for every SLURM client: enters the root in the caller's directory
    (falling back to / when the root cannot see it), or runs the root's own command when already
    inside."""
    bindir.mkdir(parents=True, exist_ok=True)
    for name in CLIENT_COMMANDS:
        text = (
            "#!/bin/sh\n"
            f"# SLURM's {name} of the local cluster in {root} (written by `lmlaunch cluster up`)\n"
            f'if [ -e /{MARKER} ]; then exec /usr/bin/{name} "$@"; fi\n'
            'dir=$PWD; [ -d "' + str(root) + '$dir" ] || dir=/\n'
            f'exec chroot {shlex.quote(str(root))} /usr/bin/env --chdir="$dir" /usr/bin/{name} "$@"\n'
        )
        path = bindir / name
        if not path.exists() or path.read_text() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.chmod(0o755)
            tmp.replace(path)
