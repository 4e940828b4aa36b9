#!/usr/bin/env bash
# Set up (idempotently), start the local SLURM cluster, and run the whole test suite.
# Extra arguments go to pytest (e.g. -k submit, -m "not slurm").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${LMLAUNCH_VENV:-$PWD/.venv}
# Start the cluster before pytest (the session fixture would too; starting it here shows its
# output and fails early). Without root and without the packages, `cluster up` says what to
# install and the integration tests are skipped with that reason.
if ! "$VENV/bin/lmlaunch" cluster up; then
  if [ "$(id -u)" = 0 ]; then
    echo "[test] the local SLURM cluster did not start (see above)" >&2
    exit 1
  fi
  echo "[test] no local SLURM cluster: integration tests will be skipped" >&2
fi
set +e
"$VENV/bin/python" -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  # pytest exits 5 when it collected nothing: a failure of the suite, not a pass.
  echo "[test] pytest collected no tests" >&2
fi
exit $rc
