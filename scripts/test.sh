#!/usr/bin/env bash
# Set up (idempotently), start the local SLURM cluster, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${LMLAUNCH_VENV:-$PWD/.venv}
if [ "$(id -u)" = 0 ] && "$VENV/bin/lmlaunch" cluster --help >/dev/null 2>&1; then
  "$VENV/bin/lmlaunch" cluster up
fi
set +e
"$VENV/bin/python" -m pytest tests "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: that is a failure of the suite, not a pass.
exit $rc
