"""A seeded chaos campaign on the real local cluster: faults at random, nothing lost.

One training run of jobs/tiny-cpu.yaml (the suite's small model, 2 nodes x 1 rank, DDP on gloo,
a spare node, the warm restart in place) on a worker cluster of three nodes of its own, with
faults drawn from tests/integration/chaos_schedule.py's catalogue at seeded steps, several
overlapping when the draw says so, each landed for real (tests/integration/chaos_faults.py). The
verdict (tests/integration/chaos_verdict.py) compares the run with the same spec's uninterrupted
run, bit for bit, and looks for anything left behind; the table says per fault how the run
recovered and what it cost.

    python bench/chaos.py [--seed N] [--faults 40] [--steps 1200] [--every 10] [--pace 0.5]
                          [--replay SCHEDULE.json] [--out DIR] [--kinds a,b] [--slurm 26.05]

The seed is printed first, the schedule saved (``DIR/schedule.json``) before the run starts, the
verdict's table and a JSON line at the end; exit 1 on a failed verdict. ``--replay`` runs a saved
schedule again as it was. The cluster's daemons must be installed (`lmlaunch cluster up` once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "src"), str(REPO / "tests"), str(REPO / "tests" / "integration")]

import chaos_campaign
import chaos_schedule
import chaos_verdict
from chaos_faults import small_filesystem
from slurm_helpers import own_worker_cluster

from launcher.localcluster import cluster


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="the campaign's seed (default: a fresh one, printed)")
    p.add_argument("--faults", type=int, default=40)
    p.add_argument("--steps", type=int, default=1200, help="the run's max_steps")
    p.add_argument("--every", type=int, default=10, help="checkpoint.every_n_steps")
    p.add_argument("--pace", type=float, default=0.5, help="seconds of sleep after each step (numbers unchanged)")
    p.add_argument("--overlap", type=float, default=0.2, help="the chance that a fault lands with the one before")
    p.add_argument("--kinds", default="", help="only these kinds, comma-separated (default: the whole catalogue)")
    p.add_argument("--slurm", default=None, help="another SLURM release's cluster (24.11, 26.05: in its Debian root; "
                   "default: the machine's own)")
    p.add_argument("--replay", type=Path, help="a saved schedule.json to run again as it was")
    p.add_argument("--out", type=Path, help="where the schedule, the verdict and the runs go (default: a temporary folder)")
    return p.parse_args(argv)


def _schedule(a: argparse.Namespace) -> chaos_schedule.Schedule:
    if a.replay:
        return chaos_schedule.Schedule.from_json(a.replay.read_text())
    kinds = {k: chaos_schedule.KINDS[k] for k in a.kinds.split(",")} if a.kinds else None
    seed = a.seed if a.seed is not None else secrets.randbelow(2**31)
    return chaos_schedule.draw(seed, faults=a.faults, max_steps=a.steps, every=a.every, overlap_p=a.overlap, kinds=kinds)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.slurm:  # a worker cluster of that release, in its Debian root (as the suite's other-version phase)
        os.environ["LMLAUNCH_TEST_SLURM"] = a.slurm
    schedule = _schedule(a)
    out = a.out or Path(tempfile.mkdtemp(prefix="chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos: seed {schedule.seed} (replay: python bench/chaos.py --replay {out / 'schedule.json'})", flush=True)
    schedule.save(out / "schedule.json")
    for f in schedule.faults:
        print("  " + f.label())
    os.environ.update(LMLAUNCH_HOME=str(out / "home"), LMLAUNCH_RUNS_ROOT=str(out / "runs"))
    tag = f"chaos-{schedule.seed}-{secrets.token_hex(2)}"
    with own_worker_cluster(tag, nodes=3) as claim, cluster.own_conf(claim.layout):
        env = {**os.environ, **claim.environ()}
        t0 = time.time()
        reference = chaos_campaign.reference(env, f"{tag}-reference", schedule.max_steps)
        print(f"reference: {schedule.max_steps} steps uninterrupted in {time.time() - t0:.0f} s", flush=True)
        with small_filesystem(out / "checkpoints-fs", a.slurm) as fs:  # a full disk fills this one
            campaign = chaos_campaign.run(schedule, env, claim.layout, f"{tag}-run", pace_s=a.pace,
                                          small_fs=fs, say=lambda line: print(line, flush=True))
            verdict = chaos_verdict.judge(campaign, reference, env, keep_last=2)
    print(verdict.table())
    (out / "verdict.json").write_text(verdict.to_json() + "\n")
    print(json.dumps({"bench": "chaos", "seed": schedule.seed, "ok": verdict.ok, "faults": len(schedule.faults),
                      "landed": sum(r.landed for r in verdict.rows), "kinds": schedule.kinds(),
                      "attempts": verdict.attempts, "goodput": verdict.goodput, "wall_s": round(verdict.wall_s),
                      "slurm": a.slurm or _native_version(), "problems": verdict.problems}))
    return 0 if verdict.ok else 1


def _native_version() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout.split()[-1]
    return "?"


if __name__ == "__main__":
    sys.exit(main())
