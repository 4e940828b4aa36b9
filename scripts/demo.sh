#!/usr/bin/env bash
# The demo, from a fresh clone: set up (idempotently), start the local 2-node SLURM cluster,
# submit the tiny CPU job (DDP on gloo, one task on each of n1 and n2), follow it to the end
# and print where its outputs are.
#   LMLAUNCH_DEMO_NAME   run name (default tiny-cpu; an earlier run of that name is archived)
#   extra arguments are passed to `lmlaunch submit` as overrides, e.g. trainer.max_steps=60
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${LMLAUNCH_VENV:-$PWD/.venv}
# shellcheck source=scripts/venv_env.sh
source scripts/venv_env.sh  # the venv by its real path; its own TORCH_EXTENSIONS_DIR
LM="$VENV/bin/lmlaunch"
NAME=${LMLAUNCH_DEMO_NAME:-tiny-cpu}

log() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }

log "starting the local SLURM cluster"
"$LM" cluster up

log "submitting jobs/tiny-cpu.yaml as run '$NAME'"
"$LM" submit jobs/tiny-cpu.yaml "name=$NAME" "$@" --new

log "following run '$NAME' to the end"
exec "$VENV/bin/python" - "$NAME" <<'PY'
"""Follow one run: SLURM state from the launcher's slurm module, progress from the heartbeat."""
import json, sys, time
from pathlib import Path

from launcher.runs import registry as runs
from lmcore.slurm import admin as rehearsal
from lmcore.slurm import client as slurm

name = sys.argv[1]
rec = runs.find_run(name)
job = rec.last_job_id
run_dir = Path(rec.run_dir)
heartbeat = run_dir / "metrics" / "heartbeat.jsonl"
seen = 0
last_state = None
first_loss = last_loss = None
final = None
while True:
    state = slurm.job_state(job)
    if state != last_state:
        print(f"[demo] job {job}: {state}", flush=True)
        last_state = state
    if heartbeat.exists():
        lines = heartbeat.read_text().splitlines()
        for line in lines[seen:]:
            try:
                hb = json.loads(line)
            except ValueError:
                break  # a line being written; read it next time
            seen += 1
            if hb.get("event") == "step" and hb.get("loss") is not None:
                first_loss = hb["loss"] if first_loss is None else first_loss
                last_loss = hb["loss"]
                tps = hb.get("tokens_per_s")
                print(f"[demo] step {hb['step']:>4}/{hb.get('max_steps')}  loss {hb['loss']:.3f}"
                      + (f"  {tps:,.0f} tok/s" if tps else "")
                      + f"  world_size {hb.get('world_size')}", flush=True)
            elif hb.get("event") in ("start", "checkpoint", "end", "val"):
                print(f"[demo] {hb['event']}: " + ", ".join(f"{k}={v}" for k, v in hb.items()
                                                           if k not in ("time", "event")), flush=True)
    group = slurm.state_group(state)
    if group not in ("queued", "running", "unknown"):
        final = state
        break
    if state == "PENDING" and (slurm.show_job(job) or {}).get("Reason") == "BeginTime":
        rehearsal.start_now(job)  # a requeued attempt: do not wait the 2 min BeginTime
    time.sleep(3)

print()
print(f"[demo] run '{name}' ended: {final}")
if first_loss is not None:
    print(f"[demo] loss {first_loss:.3f} -> {last_loss:.3f}")
for row in slurm.sacct([job], duplicates=True):
    print(f"[demo] sacct: job {row.job_id} {row.state} on {row.nodes} elapsed {row.elapsed}")
print(f"[demo] outputs in {run_dir}:")
for rel in ("spec.yaml", "plan.json", "logs", "metrics/heartbeat.jsonl", "attempts.jsonl", "checkpoints", "submitit"):
    p = run_dir / rel
    if p.exists():
        extra = ""
        if p.is_dir():
            extra = f"  ({sum(1 for _ in p.rglob('*') if _.is_file())} files)"
        print(f"  {p}{extra}")
print(f"[demo] next: lmlaunch status {name}; lmlaunch logs {name}; lmlaunch report {name}")
sys.exit(0 if final == "COMPLETED" else 1)
PY
