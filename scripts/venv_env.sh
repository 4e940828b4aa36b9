# Sourced by setup.sh, test.sh and demo.sh after VENV is set: the venv by its real path. A venv
# reached through a symlinked path gives torch other include paths, so DeepSpeed's JIT op another
# build hash and another build folder (lmtrain.distributed.jit_ops keys it by sys.prefix): setup.sh builds the
# op for the path the suite and the demo then run.
VENV=$(cd "$VENV" && pwd -P)
PY="$VENV/bin/python"
