"""What a rank forked from the local launcher's zygote spends importing lmtrain's schemas from the
run's code zip: with the schemas' field documentation read (what every local rank did before) against
not read (a local launch's rank now, as an srun task already did: lmcore.job.strict_model), in the
same run.

pydantic reads a field's docstring by walking the importing frames with ``inspect.getmodule``; for a
module imported from a zip that scans every loaded module, and a rank forked from the zygote has about
3,000 loaded (torch, Lightning, transformers). Each side here is such a process: it imports the
frameworks first (the zygote's preload, not counted), then, counted, the schemas and the task's
environment module from a snapshot zip of this checkout (launcher.runs.snapshot.take), as
``lmtrain.task.entry.run_task`` does. ``--runs`` times, alternating; the figure is the process's own
CPU time over the counted imports.

Goal: **the counted imports take at most 0.5x the CPU without the documentation** (medians).
Ends with one JSON object.

    python bench/forked_rank_start.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL = 0.5

PROBE = """
import sys, time
import torch, lightning.pytorch, transformers  # the zygote's preload: not counted
sys.path.insert(0, sys.argv[1])
t = time.process_time()
from lmcore.job.plan import LaunchPlan
from lmtrain.distributed.task_env import begin_task
print(time.process_time() - t, len(sys.modules))
"""


def _cpu_of(code_zip: Path, *, documented: bool) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LMTRAIN_LAUNCHER", "SLURM_PROCID")}
    env["OMP_NUM_THREADS"] = "1"
    if not documented:
        env["LMTRAIN_LAUNCHER"] = "local"  # what lmtrain.local.launch sets for each rank
    done = subprocess.run([sys.executable, "-c", PROBE, str(code_zip)], env=env, capture_output=True, text=True,
                          check=True, timeout=600)
    cpu, modules = done.stdout.split()
    return float(cpu), int(modules)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path[:0] = [str(REPO), str(REPO / "src")]
    from launcher.runs.snapshot import take
    from lmcore.run.rundir import RunLayout

    with tempfile.TemporaryDirectory(prefix="lmlaunch-bench-") as tmp:
        take(Path(tmp))
        code_zip = RunLayout.of(tmp).code_zip
        sides: dict[str, list[float]] = {"documented": [], "undocumented": []}
        loaded = 0
        for _ in range(args.runs):
            for side in sides:
                cpu, loaded = _cpu_of(code_zip, documented=side == "documented")
                sides[side].append(cpu)
                print(f"{side:>12}: {cpu:.3f} CPU-s ({loaded} modules loaded)", flush=True)
    before, after = (statistics.median(sides[s]) for s in ("documented", "undocumented"))
    ratio = after / before
    print(json.dumps({"bench": "forked_rank_start", "runs": args.runs, "modules_loaded": loaded,
                      "median_documented_s": round(before, 3), "median_undocumented_s": round(after, 3),
                      "ratio": round(ratio, 3), "goal": GOAL, "met": ratio <= GOAL}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
