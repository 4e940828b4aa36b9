#!/usr/bin/env bash
# The GPU tests and benches, in the parts one device call of at most 10 minutes can hold.
#
#   COMMIT=<sha> bash bench/gpu_session.sh PART   (PART: lease | lease2 | tests | throughput | big | rest | cpu-io)
#
# `lease` is the first of the two calls a 15-minute lease holds (BUDGET=540, then `lease2` with
# BUDGET=245 while the machine is warm): the figures the last run left unmeasured first (the Llama
# 1.1B ratio, the 1B stop checkpoint held and durable against dd), then the ones changed since
# (ZeRO-2 against DDP; GPT-2 against the compiled hand loop with its host syncs and profile); three
# alternated pairs each, both sides in one process. `lease2`: the GPU tests, then FSDP2 against DDP
# with its profile. Each step is capped so that what finished always comes back; at the end
# bench/gpu_report.py writes the GPU section ($OUT/gpu-section.md) with the date, the GPU and
# $COMMIT. Back here:
#   python bench/gpu_report.py FILES_AT --commit <sha> --append bench/RESULTS.md --profiles-to bench/gpu-profiles
#
# Run on a GPU machine from the repository root, with the wheels of bench/RESULTS.md ("Commands
# for an H100 session") in .carry/whl (the device image has torch, lightning and transformers but
# not deepspeed, pydantic, submitit or python-hostlist). Every step has its own time limit so the
# call comes back with what finished; logs and JSON lines go to $OUT (or ./gpu-out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-560}          # seconds this part may use (a device call is killed at 600)
T0=$(date +%s)

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
# transformers as the project pins it where it imports with the image's packages, else the image's own
python3 -c "import transformers" 2>/dev/null || { echo "the carried transformers does not import here: the image's is used"; rm -rf /tmp/site/transformers /tmp/site/transformers-*; }
# every package the project path imports, before any step spends its time (a missing wheel cost a call)
python3 -c "import hostlist, pydantic, submitit, hjson, zstandard, deepspeed, lmtrain.task.entry, launcher.submit.local_run" || { echo "a package the runs need is missing: see .carry/whl in bench/RESULTS.md"; exit 1; }
python3 -c "import sys,torch,lightning,transformers,deepspeed;print(sys.version.split()[0],torch.__version__,lightning.__version__,transformers.__version__,deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$OUT/device.txt"

# step NAME CMD...: runs CMD with what is left of the budget (at most $CAP seconds where set), logs to $OUT/NAME.log
step() {
    local name=$1; shift
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    if [[ -n "${CAP:-}" ]] && (( CAP < left )); then left=$CAP; fi
    if (( left < 30 )); then echo "== $name: skipped, ${left}s left"; return; fi
    echo "== $name (limit ${left}s)"
    local s=$(date +%s)
    timeout --signal=TERM --kill-after=10 "$left" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: rc=$? in $(( $(date +%s) - s ))s"
    tail -n 4 "$OUT/$name.log"
}

case "${1:-}" in
    lease)
        # the prepared GPU run, one call (BUDGET=540): first what the 2026-11-29 H200 run of 0b47bf8 left
        # unmeasured (the Llama ratio, two pairs, and the 1B stop checkpoint: their caps of 110 and 70 s were too
        # short), then ZeRO-2 again (its host syncs taken out since), then GPT-2 with its host syncs
        # (filed under the right step since) and its profile
        python3 -c "import os,torch,lightning.pytorch,transformers;print('after the zygote imports: cuda initialised', torch.cuda.is_initialized(), 'threads', len(os.listdir('/proc/self/task')))" 2>&1 | tail -1 | tee -a "$OUT/device.txt"
        CAP=230 step tp-llama python3 bench/throughput.py --config llama-1b --repeat 2 --warmup 4 --steps 12 --out "$OUT/throughput.jsonl"
        CAP=130 step ck-llama python3 bench/checkpoint_speed.py --config llama-1b --no-resume --out "$OUT/ckpt.jsonl"
        CAP=90 step tp-zero2 python3 bench/throughput.py --config zero2 --repeat 3 --out "$OUT/throughput.jsonl"
        step tp-gpt2 python3 bench/throughput.py --config gpt2-124m --repeat 2 --out "$OUT/throughput.jsonl" --profile "$OUT/profile"
        ;;
    lease2)  # the second call of the same lease (BUDGET=250 or what is left): the GPU tests, three at a
        # time on the one GPU (the 2026-11-29 run got through 5 of 12 one at a time in 150 s), then FSDP2
        CAP=170 step gpu-tests python3 -m pytest -m gpu tests/gpu -v -s -n 3 -p no:cacheprovider -o addopts="" --durations=0
        step tp-fsdp python3 bench/throughput.py --config fsdp --repeat 3 --out "$OUT/throughput.jsonl" --profile "$OUT/profile"
        ;;
    one)  # a lease with one call left (BUDGET=490 or so; 15 tests took over 150 s three at a time on 2026-12-04): the GPU tests, the 1B stop checkpoint, ZeRO-2, then
        # GPT-2 in one pair with its host syncs (the Llama pair, about 100 s a side, does not fit beside them)
        CAP=200 step gpu-tests python3 -m pytest -m gpu tests/gpu -v -s -n 3 -p no:cacheprovider -o addopts="" --durations=0
        CAP=110 step ck-llama python3 bench/checkpoint_speed.py --config llama-1b --no-resume --out "$OUT/ckpt.jsonl"
        CAP=80 step tp-zero2 python3 bench/throughput.py --config zero2 --out "$OUT/throughput.jsonl"
        step tp-gpt2 python3 bench/throughput.py --config gpt2-124m --out "$OUT/throughput.jsonl" --profile "$OUT/profile"
        ;;
    tests)
        step gpu-tests python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider -o addopts=""
        step tp-gpt2 python3 bench/throughput.py --config gpt2-124m --out "$OUT/throughput.jsonl"
        ;;
    throughput)
        step tp-zero2 python3 bench/throughput.py --config zero2 --out "$OUT/throughput.jsonl"
        step tp-fsdp python3 bench/throughput.py --config fsdp --out "$OUT/throughput.jsonl"
        step tp-llama python3 bench/throughput.py --config llama-1b --out "$OUT/throughput.jsonl"
        ;;
    big)
        step ck-llama python3 bench/checkpoint_speed.py --config llama-1b --out "$OUT/ckpt.jsonl"
        step ck-gpt2 python3 bench/checkpoint_speed.py --config gpt2-124m --out "$OUT/ckpt.jsonl"
        ;;
    rest)
        step tp-zero1 python3 bench/throughput.py --config zero1 --out "$OUT/throughput.jsonl"
        step tp-zero3 python3 bench/throughput.py --config zero3 --out "$OUT/throughput.jsonl"
        ;;
    cpu-io)  # the CPU checkpoint bench (bench/checkpoint_io.py) on a machine with 128 GiB: both shapes
        step io-124m python3 bench/checkpoint_io.py --params 124e6
        step io-1b python3 bench/checkpoint_io.py --params 1.1e9 --steps 6
        ;;
    *) echo "usage: bash bench/gpu_session.sh tests|throughput|big|rest|cpu-io" >&2; exit 2 ;;
esac
grep -h '^{' "$OUT"/*.jsonl 2>/dev/null | tail -n 8
python3 bench/gpu_report.py "$OUT" --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$OUT/gpu-section.md" 2>&1
cat "$OUT/gpu-section.md"
# a device call brings back at most 8 files: the logs travel as one archive (device.txt stays for the report)
(cd "$OUT" && tar czf "logs-${1}.tgz" ./*.log device.txt && rm -f ./*.log)
