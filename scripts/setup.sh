#!/usr/bin/env bash
# Idempotent setup of everything lmlaunch needs on a fresh Debian machine:
# system packages for the local SLURM cluster (as root), a virtualenv with torch pinned
# first (the CPU wheel on this machine kind), the package itself, and the demo corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${LMLAUNCH_VENV:-$ROOT/.venv}
TORCH_VERSION=${LMLAUNCH_TORCH_VERSION:-2.13.0}

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# 1. System packages for the local cluster (slurm-wlm, munge, accounting on MariaDB).
need=()
for pkg in slurm-wlm munge slurmdbd mariadb-server; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ]; then
    log "installing ${need[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
  else
    log "missing system packages: ${need[*]}; as root run: apt-get install -y ${need[*]}"
  fi
fi

# 1b. Servers the tests start themselves on loopback ports, installed with a policy that starts no
# service (no system sshd on port 22, no system Prometheus): OpenSSH's (the remote tests' login
# node), Prometheus' (the metrics test scrapes `lmlaunch metrics serve`) and its Pushgateway (a job
# pushes to it).
install_without_service() {  # PACKAGE WHAT-FOR
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" && return 0
  if [ "$(id -u)" != 0 ]; then
    log "missing system package: $1 ($2); as root run: apt-get install -y $1"
    return 0
  fi
  log "installing $1 (apt; its service not started)"
  export DEBIAN_FRONTEND=noninteractive
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
  fi
  { apt-get install -y -qq --no-install-recommends "$1" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$1" >/dev/null; }; }
  if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
}
install_without_service openssh-server "the remote tests' sshd"
install_without_service prometheus "the metrics test's server"
install_without_service prometheus-pushgateway "the push test's gateway"
install_without_service chromium "the dashboard test's browser (headless)"
install_without_service zsh "the completion test's shells (lmlaunch completion zsh, fish)"
install_without_service fish "the completion test's shells (lmlaunch completion zsh, fish)"

# 2. Python environment: torch pinned first so nothing pulls a CUDA build.
# The Python to build it on: LMLAUNCH_PYTHON, else a Python 3.11 outside /usr where there is one
# (the local cluster's second SLURM version runs its jobs in a Debian root that has its own /usr
# and sees this machine's Python only where it is not the system's), else the system's.
pick_python() {
  if [ -n "${LMLAUNCH_PYTHON:-}" ]; then echo "$LMLAUNCH_PYTHON"; return; fi
  local c base first=""
  for c in $(command -v python3.11 2>/dev/null) "$HOME"/.pyenv/versions/3.11*/bin/python3.11 \
           /usr/local/bin/python3.11 /opt/*/bin/python3.11 $(command -v python3 2>/dev/null); do
    [ -x "$c" ] || continue
    base=$("$c" -c 'import os, sys; print(os.path.realpath(sys.base_prefix))' 2>/dev/null) || continue
    [ -n "$first" ] || first=$c
    case "$base" in /usr/local|/usr/local/*) echo "$c"; return ;; /usr|/usr/*) ;; *) echo "$c"; return ;; esac
  done
  echo "${first:-python3}"
}
if [ ! -x "$VENV/bin/python" ]; then
  BASE_PY=$(pick_python)
  log "creating $VENV (from $BASE_PY)"
  "$BASE_PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# The versions the suite passed with (scripts/constraints.txt) for everything below torch;
# LMLAUNCH_CONSTRAINTS=none resolves the newest releases pyproject.toml allows instead.
CONSTRAINTS=${LMLAUNCH_CONSTRAINTS:-$ROOT/scripts/constraints.txt}
if [ "$CONSTRAINTS" != none ]; then export PIP_CONSTRAINT=$CONSTRAINTS; fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION"
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
DS_VERSION=${LMLAUNCH_DEEPSPEED_VERSION:-0.19.8}
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('deepspeed') == '$DS_VERSION' else 1)" 2>/dev/null; then
  # From source with no ops compiled ahead of time (no CUDA toolkit here); without build
  # isolation so its setup.py sees the pinned torch instead of pulling another one.
  log "installing deepspeed==$DS_VERSION (DS_BUILD_OPS=0)"
  "$PY" -m pip install -q setuptools wheel
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-build-isolation "deepspeed==$DS_VERSION"
fi
stamp="$VENV/.lmlaunch-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  log "installing lmlaunch (editable) with the training stack and the dev extras"
  "$PY" -m pip install -q -e ".[runtime,dev]"
  touch "$stamp"
fi

# The evaluator's environment (eval.alongside, `lmlaunch eval`: the local profile's eval_python:
# auto), beside this one and layered on it: this venv's packages are visible there (a .pth file),
# and lm-eval with what it adds (scipy, scikit-learn, pandas, datasets, ...) is installed there
# only. In the tasks' own environment torchmetrics would import scipy.signal at every rank's start
# (1.3 CPU-s, a quarter of a task's imports: bench/task_imports.py).
EVAL_VENV="$VENV-eval"
if [ ! -x "$EVAL_VENV/bin/python" ]; then
  log "creating $EVAL_VENV (the evaluator's environment, layered on $VENV)"
  "$("$PY" -c 'import sys; print(sys._base_executable)')" -m venv "$EVAL_VENV"
fi
eval_site=$("$EVAL_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
main_site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$main_site')" > "$eval_site/lmlaunch-runtime.pth"
eval_stamp="$EVAL_VENV/.lmlaunch-eval-installed"
if [ ! -f "$eval_stamp" ] || [ pyproject.toml -nt "$eval_stamp" ] || [ scripts/constraints-eval.txt -nt "$eval_stamp" ]; then
  log "installing lm-eval into $EVAL_VENV (the eval extra)"
  if [ "$CONSTRAINTS" != none ]; then export PIP_CONSTRAINT=$ROOT/scripts/constraints-eval.txt; fi
  "$EVAL_VENV/bin/python" -m pip install -q "$("$PY" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['eval'][0])")"
  touch "$eval_stamp"
fi

# DeepSpeed's CPU shared-memory collective op is compiled on first use (JIT, ~1 CPU-min) unless
# it is built: build it here, once, into this environment's own folder (lmtrain.distributed.jit_ops: torch's
# default, ~/.cache/torch_extensions, is shared by every venv of the machine, and a venv reached
# through another path builds it with other include paths: each rebuild holds a lock every ZeRO rank
# waits on). The venv is taken by its real path (scripts/venv_env.sh), as test.sh and demo.sh run it.
# shellcheck source=scripts/venv_env.sh
source "$ROOT/scripts/venv_env.sh"
if ! DS_ACCELERATOR=cpu "$PY" -m lmtrain.distributed.jit_ops --build >/dev/null 2>&1; then
  log "DeepSpeed's CPU shared-memory op did not build here: ZeRO jobs build it on first use"
fi

# 3. The demo corpus, tokenized (skipped when already prepared).
if "$VENV/bin/lmlaunch" data --help >/dev/null 2>&1; then
  "$VENV/bin/lmlaunch" data prepare --shipped-corpus --out "$ROOT/data/prepared/tiny" --if-missing
fi
log "ready: $VENV/bin/lmlaunch"
