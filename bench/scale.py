"""The scale harness on the real local SLURM: what a run does to its run directory at 2 to 128 ranks,
counted, with the growth law of each figure. One run of jobs/scale-sim.yaml per size, all in this run.

Each size (``RANKSxNODES``) is one run whose ranks import no torch (lmtrain.simulate), in a home and
runs root of its own, through the same story:

1. attempt 1 trains until rank ``R-1`` is SIGKILLed at step ``--kill-step`` (lmtrain.faults, as the
   OOM killer would): the others' all-reduce fails, rank 0 decides a restart in place and every task's
   agent forks a new training process (attempt 2, same job and nodes);
2. attempt 2 trains until ``lmlaunch preempt RUN --mode signal --start-now`` at step ``--stop-step``:
   the stop is agreed, checkpointed, the job requeued and started again at once;
3. attempt 3 resumes (every shard verified against its checksum) and completes at ``--max-steps``.

Printed per size: the run's files at the end by kind (a path with its numbers made N), every rank
process's filesystem operations by phase (lmtrain.simulate.fs_count: opens for writing and reading,
stats, listings, mkdirs, renames, removes), per rank per non-logging step and per logging step, the
restart in place (attempt 1's end line -> attempt 2's first step line), the requeue (attempt 2's end ->
attempt 3's first step), and how long `status`, `history` and `metrics write` (the exporter's reading)
take on the run (median of ``--repeat``). Then for each figure its growth law over the sizes (flat,
per node, per rank, per node + per rank, per rank squared; lmtrain.simulate.tally.growth_law), the
budgets of docs/scale.md at the largest size, and one JSON object (``--json FILE`` writes it too).

    python bench/scale.py [--sizes 2x2,4x1,8x2,32x8,32x32,128x32] [--json FILE] [--keep]

It brings up a worker cluster of its own with as many nodes as the largest size needs (the primary
cluster is left as it is) and gives it back with 2 nodes at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from preemption import cli, jsonl  # bench/preemption.py: the CLI in-process, JSON lines

from lmcore.slurm import client as slurm
from lmtrain.simulate.tally import Counts, extrapolate, files_by_kind, growth_law

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "jobs" / "scale-sim.yaml"
TERMINAL = ("completed", "failed", "cancelled", "timeout")


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)", part.strip())
        if not m or int(m.group(1)) % int(m.group(2)):
            raise SystemExit(f"--sizes: {part!r} is not RANKSxNODES with RANKS a multiple of NODES")
        sizes.append((int(m.group(1)), int(m.group(2))))
    return sizes


def _wait(what: str, ready, timeout_s: float = 900.0, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        time.sleep(poll_s)
    raise SystemExit(f"timed out waiting for {what}")


def _steps(run_dir: Path, attempt: int) -> list[dict]:
    return [b for b in jsonl(run_dir / "metrics" / "heartbeat.jsonl") if b.get("event") == "step" and b.get("attempt") == attempt]


_PENDING_SINCE: dict[str, float] = {}


def _start_requeued(job: str) -> bool:
    """Start the requeued job at once rather than after SLURM's requeue BeginTime (~2 min here), once
    it has been pending 2 s and its nodes are clean (as tests/integration/preempt_helpers does)."""
    from lmcore.slurm import admin

    info = slurm.show_job(job) or {}
    if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
        since = _PENDING_SINCE.setdefault(f"{job}-{info.get('Restarts')}", time.monotonic())
        if time.monotonic() - since >= 2.0 and admin.ready_to_start(job):
            try:
                admin.start_now(job)
            except Exception as exc:  # the controller may still be finishing the requeue: next poll
                print(f"start_now {job}: {exc}", file=sys.stderr)
    return False


def _exchange_s(run_dir: Path, crashed_at: float) -> float | None:
    """Attempt 1's end line -> rank 0's agent wrote ``fork`` (every rank's agent ready): the restart's
    exchange between the agents, without the new training processes' own start."""
    forks = [p for p in (run_dir / "rendezvous").glob("*.next") if "-g" not in p.name and p.read_text().strip() == "fork"]
    return round(min(p.stat().st_mtime for p in forks) - crashed_at, 2) if forks else None


def _restart_cpu(counts: Counts) -> float | None:
    """The CPU seconds of an attempt-2 training process from its fork to its first step, per rank."""
    got = [p["cpu_to_first_step_s"] for p in counts.processes if p.get("attempt") == 2 and "cpu_to_first_step_s" in p]
    return round(statistics.median(got), 3) if got else None


IMPORT_KINDS = ("code/*", ".")  # the code snapshot's modules, and the task's directory as sys.path's ''


def _imports(counts: Counts, phase: str) -> int:
    return sum(n for k, n in counts.paths(phase).items() if k.split(" ", 1)[1] in IMPORT_KINDS)


def _not_imports(counts: Counts, phase: str) -> int:
    """A phase's operations but Python's imports (an agent's lazy imports come once, at its first restart)."""
    return counts.total(phase) - _imports(counts, phase)


def _per_logging_step(counts: Counts) -> float | None:
    """Every operation of one logging step, all ranks together, rank 0's straggler watch included,
    Python's lazy imports at the first one left out: what a logging step costs the filesystem."""
    looks = sum(int((p.get("steps") or {}).get("log_step", 0)) for p in counts.processes if str(p.get("rank")) == "0")
    ops = _not_imports(counts, "log_step") + _not_imports(counts, "thread lmtrain-straggler-watch")
    return round(ops / looks, 2) if looks else None


def _watch_per_look(counts: Counts) -> float | None:
    """Rank 0's straggler watch: its reads of the nodes' timing files per look (a look per logging step)."""
    reads = counts.total("thread lmtrain-straggler-watch", "open_read")
    looks = sum(int((p.get("steps") or {}).get("log_step", 0)) for p in counts.processes if str(p.get("rank")) == "0")
    return round(reads / looks, 2) if looks else None


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 4)


def one(root: Path, ranks: int, nodes: int, args: argparse.Namespace, cluster_env: dict[str, str]) -> dict:
    name = f"scale-{ranks}x{nodes}-{time.strftime('%H%M%S')}"
    home = root / name
    counts_dir = home / "counts"
    environ = {**os.environ, **cluster_env, "LMLAUNCH_HOME": str(home / "home"), "LMLAUNCH_RUNS_ROOT": str(home / "runs")}
    rule = {"point": "train.batch_end", "attempt": 1, "step": args.kill_step, "rank": ranks - 1, "action": "kill"}
    os.environ["LMLAUNCH_FAULTS"] = json.dumps([rule])  # SLURM hands the job the submitting environment
    try:
        out = cli(environ, "submit", SPEC, f"name={name}", f"resources.nodes={nodes}",
                  f"resources.tasks_per_node={ranks // nodes}", f"trainer.max_steps={args.max_steps}",
                  f"trainer.global_batch_size={ranks}", f"simulate.counts_dir={counts_dir}",
                  f"simulate.step_s={args.step_s}", "checkpoint.every_n_steps=100")
    finally:
        os.environ.pop("LMLAUNCH_FAULTS", None)
    job = re.search(r"job (\d+)", out).group(1)
    run_dir = home / "runs" / name
    files_at_submit = sum(files_by_kind(run_dir).values())
    _wait(f"{name}: attempt 2 at step {args.stop_step}",
          lambda: any(b["step"] >= args.stop_step for b in _steps(run_dir, 2)))
    cli(environ, "preempt", name, "--mode", "signal")
    _wait(f"{name}: job {job} ended", lambda: _start_requeued(job) or slurm.state_group(slurm.job_state(job)) in TERMINAL,
          poll_s=0.5)
    state = slurm.job_state(job)
    ledger = jsonl(run_dir / "attempts.jsonl")
    ends = [e for e in ledger if e.get("event") == "end"]
    if state != "COMPLETED" or [e.get("reason") for e in ends] != ["crashed", "preempted", "completed"]:
        raise SystemExit(f"{name}: job {job} {state}, attempts ended {[e.get('reason') for e in ends]}")
    first = {a: min(float(b["time"]) for b in _steps(run_dir, a)) for a in (2, 3)}
    counts = Counts.read(counts_dir)
    tasks = [p for p in counts.processes if p.get("role") == "task"]
    by_attempt = {a: sorted(int(p["rank"]) for p in tasks if p.get("attempt") == a) for a in (1, 2, 3)}
    missing = {a: sorted(set(range(ranks)) - set(r)) for a, r in by_attempt.items() if sorted(set(r)) != list(range(ranks))}
    imported = sorted({m for p in counts.processes for m in p.get("frameworks") or []})
    kinds = files_by_kind(run_dir)
    steps, log_steps = counts.steps("step"), counts.steps("log_step")
    starts = [e for e in ledger if e.get("event") == "start"]
    wall = float(ends[-1]["time"]) - float(starts[0]["time"])
    row = {
        "ranks": ranks, "nodes": nodes, "job": job, "run": name,
        "ranks_missing_counts": missing, "frameworks_imported": imported,
        "files_at_end": sum(kinds.values()), "files_at_submit": files_at_submit,
        "files_by_kind": dict(sorted(kinds.items())),
        "ops_by_phase": counts.by_phase(),
        "ops_per_rank_step": round(counts.total("step") / steps, 4) if steps else None,
        "ops_per_rank_log_step": round(counts.total("log_step") / log_steps, 4) if log_steps else None,
        "watch_opens_per_look": _watch_per_look(counts),
        "ops_per_logging_step": _per_logging_step(counts),
        "agent_ops_per_node_per_s": round(_not_imports(counts, "agent_wait") / wall / nodes, 3),
        "imports_per_process": round(sum(_imports(counts, ph) for ph in ("start", "agent")) / len(counts.processes), 1),
        "run_wall_s": round(wall, 1),
        "restart_in_place_s": round(first[2] - float(ends[0]["time"]), 2),
        "restart_exchange_s": _exchange_s(run_dir, float(ends[0]["time"])),
        "restart_cpu_s_per_rank": _restart_cpu(counts),
        "requeue_to_first_step_s": round(first[3] - float(ends[1]["time"]), 2),
        "status_s": _median_s(lambda: cli(environ, "status", name), args.repeat),
        "history_s": _median_s(lambda: cli(environ, "history", name), args.repeat),
        "exporter_s": (home / "prom").mkdir() or _median_s(lambda: cli(environ, "metrics", "write", str(home / "prom")), args.repeat),
    }
    print(json.dumps({k: v for k, v in row.items() if k not in ("files_by_kind", "ops_by_phase")}), flush=True)
    return row


def laws(rows: list[dict]) -> dict[str, dict]:
    """Each figure's growth law over the sizes."""
    sizes = [(r["ranks"], r["nodes"]) for r in rows]
    figures = {"files_at_end": [r["files_at_end"] for r in rows]}
    for kind in sorted({k for r in rows for k in r["files_by_kind"]}):
        figures[f"files {kind}"] = [r["files_by_kind"].get(kind, 0) for r in rows]
    for phase in sorted({p for r in rows for p in r["ops_by_phase"]}):
        figures[f"ops {phase}"] = [sum(r["ops_by_phase"].get(phase, {}).values()) for r in rows]
    for key in ("ops_per_rank_step", "ops_per_rank_log_step", "ops_per_logging_step", "watch_opens_per_look",
                "agent_ops_per_node_per_s",
                "imports_per_process",
                "restart_in_place_s",
                "restart_exchange_s", "restart_cpu_s_per_rank",
                "status_s", "history_s", "exporter_s"):
        figures[key] = [r[key] or 0.0 for r in rows]
    return {k: {**growth_law(sizes, v), "values": v} for k, v in figures.items()}


def budgets(rows: list[dict]) -> dict[str, dict]:
    """docs/scale.md's budgets at the largest size, against the 4-rank run (the restart) and the
    2-rank run (status, history, the exporter) measured in this run."""
    big = rows[-1]
    four = next((r for r in rows if r["ranks"] == 4), rows[0])
    two = next((r for r in rows if r["ranks"] == 2), rows[0])
    nodes = big["nodes"]
    # the files the run made (the checkpoints' apart), fitted over the sizes: "a few per node plus a constant"
    # is the law's per-node term, over the story's 3 attempts; the constant is said beside it
    made = [r["files_at_end"] - r["files_at_submit"]
            - sum(n for k, n in r["files_by_kind"].items() if k.startswith("checkpoints/")) for r in rows]
    law = growth_law([(r["ranks"], r["nodes"]) for r in rows], made)
    terms = dict(zip(["constant", *law["law"].split(" (")[0].split(" + ")], law["coefficients"], strict=False))
    per_rank_squared = terms.get("per rank squared", 0.0) * big["ranks"]  # a rank's (squared) share, at this size
    per_attempt_node = (terms.get("per node", 0.0)
                        + (terms.get("per rank", 0.0) + per_rank_squared) * big["ranks"] / nodes) / 3  # 3 attempts
    log_node = (big["ops_per_logging_step"] or 0) / nodes
    out = {
        "files_per_attempt_per_node": {"figure": round(per_attempt_node, 2), "budget": "a few (4) + a constant",
                                       "constant_per_run": round(terms.get("constant", 0.0), 1), "law": law["law"],
                                       "holds": per_attempt_node <= 4 and law["error"] <= 0.1},
        # 0 per rank: fewer than one operation in 100 steps over all the ranks (rank 0's rare own ones)
        "ops_per_rank_non_logging_step": {"figure": big["ops_per_rank_step"], "budget": 0,
                                          "holds": (big["ops_per_rank_step"] or 0) * big["ranks"] < 0.01},
        "ops_per_node_logging_step": {"figure": round(log_node, 2), "budget": "1 (+ rank 0's few)",
                                      "holds": log_node <= 1 + 8 / nodes},
        "restart_in_place_vs_4_ranks": {"figure": round(big["restart_in_place_s"] / four["restart_in_place_s"], 2),
                                        "budget": 2.0, "holds": big["restart_in_place_s"] <= 2 * four["restart_in_place_s"]},
        "restart_exchange_vs_4_ranks": {"figure": round((big["restart_exchange_s"] or 0) / (four["restart_exchange_s"] or 1), 2),
                                        "budget": 2.0,
                                        "holds": (big["restart_exchange_s"] or 0) <= 2 * (four["restart_exchange_s"] or 0)},
    }
    for key in ("status_s", "history_s", "exporter_s"):
        ratio = big[key] / two[key] if two[key] else None
        out[f"{key[:-2]}_vs_2_ranks"] = {"figure": round(ratio, 2) if ratio else None, "budget": 1.2,
                                        "holds": ratio is not None and ratio <= 1.2}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2x2,4x1,8x2,32x8,32x32,128x32", help="RANKSxNODES,... (default: %(default)s)")
    ap.add_argument("--kill-step", type=int, default=60)
    ap.add_argument("--stop-step", type=int, default=160)
    ap.add_argument("--max-steps", type=int, default=260)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    from launcher.localcluster import cluster, workers

    claim = workers.claim()
    lines: list[str] = []
    need = max(n for _, n in sizes)
    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    try:
        t0 = time.perf_counter()
        cluster.up(lines.append, layout=claim.layout, ports=claim.ports, system_conf=False, accounting=True,
                   min_job_age=300, nodes=need, topology="none")
        up_s = time.perf_counter() - t0
        env = claim.environ()
        os.environ.update(env)  # this process's own SLURM calls (the job's state) go to the worker cluster
        print(json.dumps({"cluster_nodes": need, "cluster_up_s": round(up_s, 1)}), flush=True)
        rows = [one(root, r, n, args, env) for r, n in sizes]
        result = {"sizes": [f"{r}x{n}" for r, n in sizes], "rows": rows, "laws": laws(rows), "budgets": budgets(rows),
                  "at_16384_ranks_on_2048_nodes": {}}
        for key, law in result["laws"].items():
            if key.startswith(("files", "ops ")):
                result["at_16384_ranks_on_2048_nodes"][key] = round(extrapolate(law, 16384, 2048))
        for key, law in result["laws"].items():
            print(f"{key:70s} {law['law']:28s} {law['coefficients']}  at sizes: {law['values']}")
        for key, b in result["budgets"].items():
            print(f"budget {key}: {b['figure']} (budget {b['budget']}): {'holds' if b['holds'] else 'DOES NOT HOLD'}")
        print(json.dumps(result), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        with cluster.own_conf(claim.layout):
            mine = [j.job_id for j in slurm.squeue() if j.name.startswith("scale-")]
            if mine:
                slurm.cancel(mine)
        cluster.up(lines.append, layout=claim.layout, ports=claim.ports, system_conf=False, nodes=2, topology="none")
        claim.release()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
