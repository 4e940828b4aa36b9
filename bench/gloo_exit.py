"""How often a gloo rank aborts as it exits, without and with lmtrain's parting, in the same run.

A rank that exits with torch.distributed's process groups alive can abort in the interpreter's
C++ teardown ("terminate called without an active exception"): its job trained to the end and
SLURM records it FAILED. ``lmtrain.distributed.task_env.leave_process_group`` destroys the groups first
(lmtrain.task.entry calls it when an attempt ends well). Here ``--ranks`` fresh processes meet on gloo
over loopback, all_reduce and all_gather, and exit; ``--rounds`` times each way, alternating.

Goal: **no aborts with the parting**; the figure without it is the baseline (it varies by host:
3 aborts in 60 processes on the 2-core machine this project is built on).
Ends with one JSON object.

    python bench/gloo_exit.py [--rounds 12] [--ranks 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK = """
import sys
import torch
import torch.distributed as dist

rank, world, port, part = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "part"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
t = torch.ones(1000)
for _ in range(5):
    dist.all_reduce(t)
out = [torch.empty(1) for _ in range(world)]
dist.all_gather(out, torch.tensor([float(rank)]))
if part:
    from lmtrain.distributed.task_env import leave_process_group

    assert leave_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(ranks: int, part: bool) -> list[int]:
    """The exit codes of ``ranks`` processes that met, talked and exited."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(ranks), str(port), "part" if part else "keep"],
                              env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"},
                              stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    codes = []
    for p in procs:
        _, err = p.communicate()
        codes.append(p.returncode)
        if p.returncode not in (0, -6):  # -6: SIGABRT, what is counted; anything else is a broken bench
            raise SystemExit(f"a rank ended {p.returncode}:\n{err[-2000:]}")
    return codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--ranks", type=int, default=5)
    args = ap.parse_args()
    aborts = {"keep": 0, "part": 0}
    for _ in range(args.rounds):
        for way in ("keep", "part"):
            aborts[way] += sum(code == -6 for code in one_round(args.ranks, way == "part"))
    processes = args.rounds * args.ranks
    print(f"aborts at exit in {processes} processes each way: {aborts['keep']} without the parting (baseline), "
          f"{aborts['part']} with it (goal 0)")
    print(json.dumps({"processes_each_way": processes, "aborts_without": aborts["keep"], "aborts_with": aborts["part"],
                      "goal_met": aborts["part"] == 0}))
    return 0 if aborts["part"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
