# Sourced by setup.sh, test.sh and demo.sh after VENV is set: the venv by its real path (a venv
# reached through a symlinked path would give torch other include paths, and DeepSpeed's JIT op a
# rebuild), and TORCH_EXTENSIONS_DIR in it, so no other venv or checkout of the machine rebuilds
# the op this one's ZeRO ranks load (SLURM jobs inherit both from the submitting environment).
VENV=$(cd "$VENV" && pwd -P)
PY="$VENV/bin/python"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
