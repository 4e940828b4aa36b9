#!/usr/bin/env bash
# Set up (idempotently), start the local SLURM cluster, submit the tiny 2-node CPU job,
# follow it to the end and print where its outputs are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
LM="${LMLAUNCH_VENV:-$PWD/.venv}/bin/lmlaunch"
"$LM" submit jobs/tiny-cpu.yaml --dry-run
