#!/usr/bin/env bash
# Set up (idempotently), start the local SLURM cluster, and run the whole test suite.
# Extra arguments go to pytest (e.g. -k submit, -m "not slurm", --timing-report FILE).
#
# By default the suite runs in three phases: every test but those marked `serial` on
# LMLAUNCH_TEST_WORKERS parallel workers (pytest-xdist; each worker runs its SLURM tests on a
# local cluster of its own, launcher/localcluster/workers.py), then the `serial` ones alone, then
# the integration tests marked `both_versions` again on each other SLURM version (24.11 on Debian
# 12, 22.05 on Debian 13, and 26.05 from Debian unstable; each from a Debian root,
# launcher/localcluster/debian_root.py), unless LMLAUNCH_TEST_OTHER_SLURM=0.
# `-n 0` (or any -n / --numprocesses / -p no:xdist) runs one pytest invocation as given instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${LMLAUNCH_VENV:-$PWD/.venv}
# shellcheck source=scripts/venv_env.sh
source scripts/venv_env.sh  # the venv by its real path; its own TORCH_EXTENSIONS_DIR
WORKERS=${LMLAUNCH_TEST_WORKERS:-4}
# The suite picks the cluster each test talks to. A shell pointed at a local cluster (`eval
# "$(lmlaunch cluster env --slurm 24.11)"`) would point the primary `cluster up` at that one and
# give the zygote another PATH than the ranks get (each rank then starts as a plain process,
# importing torch again: a fresh-clone run took 24:45 instead of ~18 min for phase 1 so).
unset SLURM_CONF LMLAUNCH_CLUSTER_DIR
PATH=$("$VENV/bin/python" -c "
import os
from launcher.localcluster.config import base_root
base = str(base_root()).rstrip('/') + '/'
print(':'.join(p for p in os.environ['PATH'].split(':') if not (p.startswith(base) and p.endswith('/bin'))))")
export PATH
# Start the cluster before pytest (the session fixture would too; starting it here shows its
# output and fails early). Without root and without the packages, `cluster up` says what to
# install and the integration tests are skipped with that reason.
# The parallel workers' clusters too (each worker claims one; a cluster not started here starts
# when its worker's first SLURM test needs it).
if ! "$VENV/bin/lmlaunch" cluster up --workers "$WORKERS"; then
  if [ "$(id -u)" = 0 ]; then
    echo "[test] the local SLURM cluster did not start (see above)" >&2
    exit 1
  fi
  echo "[test] no local SLURM cluster: integration tests will be skipped" >&2
fi
# The task image container jobs run in (podman, built offline the first time: a few minutes);
# as root only, as the cluster itself.
if [ "$(id -u)" = 0 ] && ! "$VENV/bin/lmlaunch" cluster image; then
  echo "[test] the container image for podman jobs could not be built (see above)" >&2
  exit 1
fi
OTHERS=()
if [ "${LMLAUNCH_TEST_OTHER_SLURM:-1}" != 0 ] && [ "$(id -u)" = 0 ]; then
  # every tested release but the machine's own (lmcore.slurm.versions' table), the other Debian
  # stable release's first, then unstable's (26.05)
  mapfile -t wanted < <("$VENV/bin/python" -c "
from launcher.localcluster.config import SLURM_RELEASES, native_version, other_version
for v in dict.fromkeys([other_version(), *SLURM_RELEASES]):
    if v and v != native_version(): print(v)")
  for version in "${wanted[@]}"; do
    # the first time, this makes the Debian root (debootstrap + apt-get: a few minutes)
    # exit 3: that SLURM cannot run here (this Python does not run in its root): said, and left out
    "$VENV/bin/lmlaunch" cluster up --slurm "$version" --workers "$WORKERS" && rc0=0 || rc0=$?
    if [ "$rc0" = 3 ]; then
      echo "[test] SLURM $version cannot run on this machine (above): its phase is left out" >&2
    elif [ "$rc0" != 0 ]; then
      echo "[test] the SLURM $version cluster did not start (see above)" >&2
      exit 1
    else
      OTHERS+=("$version")
    fi
  done
fi
# The host's speed, so that runs on different machines can be compared (docs/testing.md): one
# task's imports in CPU-s (bench/task_imports.py, one fresh interpreter per side, ~25 s).
# LMLAUNCH_TEST_HOST_FIGURE=0 leaves it out.
STRESS=${LMLAUNCH_TEST_STRESS:-0}
if [ "${LMLAUNCH_TEST_HOST_FIGURE:-1}" != 0 ] || [ "$STRESS" = slow ]; then
  host=$("$VENV/bin/python" bench/task_imports.py --runs 1 2>/dev/null | tail -1 \
         | "$VENV/bin/python" -c "import json, sys; print(json.load(sys.stdin)['median_paused'])" 2>/dev/null) || host="?"
  echo "[test] host: a task's imports take ${host} CPU-s (bench/task_imports.py --runs 1, collector paused)"
fi
# Results made once per test run and shared by its workers and phases (tests/shared_results.py).
LMLAUNCH_TEST_SHARED=$(mktemp -d "${TMPDIR:-/tmp}/lmlaunch-test-shared.XXXXXX")
export LMLAUNCH_TEST_SHARED
# The stress modes (docs/testing.md), beside the whole suite, as other work on the machine or a slower
# host would be; no test may depend on the host's speed:
# - LMLAUNCH_TEST_STRESS=N runs N CPU burners (a busy loop each);
# - LMLAUNCH_TEST_STRESS=slow copies a host whose task imports take LMLAUNCH_TEST_SLOW_S (6) s: a
#   burner pinned to each core, its nice value chosen from this host's figure (tests/slow_host.py).
burners=()
cleanup() {
  ((${#burners[@]})) && kill "${burners[@]}" 2>/dev/null
  rm -rf "$LMLAUNCH_TEST_SHARED"
}
trap cleanup EXIT
if [ "$STRESS" = slow ]; then
  if [ "$host" = "?" ]; then
    echo "[test] the slow-host stress mode needs this host's figure, which could not be measured" >&2
    exit 1
  fi
  slow=$("$VENV/bin/python" tests/slow_host.py --quiet "$host" --target "${LMLAUNCH_TEST_SLOW_S:-6}")
  mapfile -t burners < <("$VENV/bin/python" -c "import json, sys; sys.stdout.write(''.join(f'{p}\\n' for p in json.loads(sys.argv[1])['pids']))" "$slow")
  echo "[test] slow-host stress mode: $slow"
  echo "[test] a task's imports take $("$VENV/bin/python" -c "import json, sys; print(json.loads(sys.argv[1])['imports_s'])" "$slow") s under it (quiet: ${host} CPU-s)"
elif [[ "$STRESS" =~ ^[0-9]+$ ]]; then
  for ((i = 0; i < STRESS; i++)); do
    bash -c 'while :; do :; done' &
    burners+=($!)
  done
  ((${#burners[@]})) && echo "[test] stress mode: ${#burners[@]} CPU burner(s) beside the suite (pids ${burners[*]})"
else
  echo "[test] LMLAUNCH_TEST_STRESS=$STRESS: expected a number of CPU burners or 'slow'" >&2
  exit 2
fi

pytest() {
  set +e
  "$VENV/bin/python" -m pytest "$@"
  local rc=$?
  set -e
  return $rc
}

custom=0
for a in "$@"; do
  case "$a" in -n|-n[0-9]*|--numprocesses|--numprocesses=*|no:xdist) custom=1 ;; esac
done
if [ "$custom" = 1 ]; then
  pytest tests "$@" && rc=0 || rc=$?
  [ "$rc" = 5 ] && echo "[test] pytest collected no tests" >&2  # a failure of the suite, not a pass
  exit $rc
fi

start=$(date +%s)
echo "[test] phase 1: all tests but the serial ones, on $WORKERS workers"
# --dist load: tests/conftest.py hands the tests out longest first, one at a time, with the
# shortest held behind a long one (tests/scheduling.py; xdist's own would hand out blocks of
# consecutive tests, and the long ones would pile up on one worker)
pytest tests -n "$WORKERS" --dist load --phase parallel "$@" && rc1=0 || rc1=$?
# phase 2 collects only the modules that hold serial tests (collecting all of them costs ~20 s)
mapfile -t serial_modules < <(grep -rlE --include='test_*.py' 'pytest\.mark\.serial' tests | sort)  # decorator, pytestmark or param marks
if ((${#serial_modules[@]})); then
  echo "[test] phase 2: the tests marked serial, alone"
  pytest "${serial_modules[@]}" --phase serial "$@" && rc2=0 || rc2=$?
else
  rc2=5
fi
rc3=5
mapfile -t both_modules < <(grep -rl --include='test_*.py' 'pytest.mark.both_versions' tests/integration | sort)
if ((${#both_modules[@]})); then
  for version in "${OTHERS[@]}"; do
    echo "[test] phase 3: the tests marked both_versions, on SLURM $version"
    LMLAUNCH_TEST_SLURM=$version pytest "${both_modules[@]}" -n "$WORKERS" --dist load \
      --phase other-slurm "$@" && rc=0 || rc=$?
    [ "$rc3" = 5 ] || [ "$rc3" = 0 ] && rc3=$rc
  done
fi
echo "[test] all phases: $(( $(date +%s) - start )) s (phase 1 exit $rc1, phase 2 exit $rc2, phase 3 exit $rc3)"
# exit 5 (nothing collected) is fine for one phase when a filter (-k, -m) left it nothing to run
if [ "$rc1" = 5 ] && [ "$rc2" = 5 ] && [ "$rc3" = 5 ]; then
  echo "[test] pytest collected no tests" >&2
  exit 5
fi
for rc in "$rc1" "$rc2" "$rc3"; do
  [ "$rc" = 5 ] || [ "$rc" = 0 ] || exit "$rc"
done
exit 0
