"""Preflight in every attempt: cheap checks on every node before the ranks meet.

A node that lost a mount, or lacks the interface ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``
names, otherwise shows up as a hang in the rendezvous or a cryptic error of the collective
library. At the start of every attempt the first rank of each node checks, for that node:

- every ``*_SOCKET_IFNAME`` selects an interface the node has (NCCL's and gloo's syntax,
  ``lmcore.node_facts``);
- the checkpoint directory is writable from the node (a file written, fsynced, removed);
- the data directory's metadata is readable from the node;
- in a GPU job, every rank of the node has a GPU of its own (its task record, written before the
  ranks met: lmtrain.distributed.gpu_binding).

It writes its verdict to ``logs/attempt-<N>/preflight-node-<K>.json``; every rank waits (up to
:data:`WAIT_S`) for every node's verdict, so all of them agree. Rank 0 writes the ledger line
``preflight`` (per node: ok or what failed). When a node failed, every rank raises
:class:`PreflightFailed`: the attempt ends as ``preflight_failed`` and lmtrain.preemption.policy requeues
the job off the failing nodes where the partition has others (``ExcNodeList``), else stops it
with what to fix.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lmcore.atomic import write_private
from lmcore.node_facts import ifname_verdicts
from lmcore.run.rundir import Ledger, LedgerNote, RunLayout
from lmtrain import faults

WAIT_S = 60.0  # for every node's verdict (a node whose first rank never starts: the rendezvous times out as before)
NAME = "preflight-node-{node}.json"
DATA_META = "meta.json"  # lmtrain.data.prepare.build.META_FILE (not imported: it pulls numpy in)


class PreflightFailed(RuntimeError):
    """A node failed its checks; ``failed`` maps the node to what failed there."""

    def __init__(self, failed: dict[str, list[str]]) -> None:
        self.failed = failed
        super().__init__("preflight failed on " + "; ".join(f"{n}: {', '.join(m)}" for n, m in sorted(failed.items())))


def node_checks(plan: Any, environ: dict[str, str], node: str, env: Any = None) -> list[dict[str, Any]]:
    """This node's checks (each: name, ok, message); ``env`` (the TaskEnv): its ranks' GPUs too."""
    out = []
    if env is not None and plan.slurm.gpus_per_node:
        out.append(gpu_check(plan, env, node))
    try:
        available = sorted(os.listdir("/sys/class/net"))
    except OSError:
        available = []
    for v in ifname_verdicts(environ, available):
        out.append({"name": f"interface {v.var}", "ok": v.ok, "message": v.why})
    ckpt = Path(plan.paths.checkpoint_dir)
    probe = ckpt / f".preflight-{node}-{os.getpid()}"
    try:
        ckpt.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"lmtrain preflight\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        out.append({"name": "checkpoint dir", "ok": True, "message": f"{ckpt}: writable"})
    except OSError as exc:
        out.append({"name": "checkpoint dir", "ok": False, "message": f"{ckpt}: cannot write there ({exc.strerror or exc})"})
    for store in plan.job_spec().data.stores:
        data = Path(store.path)
        try:
            json.loads((data / DATA_META).read_text())
            out.append({"name": "data", "ok": True, "message": f"{data}: readable"})
        except (OSError, ValueError) as exc:
            out.append({"name": "data", "ok": False, "message": f"{data}/{DATA_META}: cannot read it ({exc})"})
    try:
        faults.point("preflight.node", node=node)  # the tests make a node fail its checks here
    except RuntimeError as exc:
        out.append({"name": "fault injection", "ok": False, "message": str(exc)})
    return out


def gpu_check(plan: Any, env: Any, node: str) -> dict[str, Any]:
    """The GPUs of this node's ranks, from their task records (every rank wrote its own before the
    ranks met, so the node's are all there by now)."""
    from lmcore.run.task_records import read_task_records
    from lmtrain.distributed.gpu_binding import binding, node_problems

    records, unreadable = read_task_records(plan.paths.run_dir, env.job_id, env.restart_count)
    here = os.environ.get("SLURMD_NODENAME") or node  # as the records name it (task_env.record_this_task)
    mine = [r for r in records if r.node == here]
    bind = binding(env.launcher, plan.slurm.gpu_bind)
    problems = node_problems(mine, bind=bind, gpus_per_node=plan.slurm.gpus_per_node)
    if not problems:
        used = ", ".join(f"rank {r.rank}: {r.gpu}" for r in mine)
        return {"name": "GPUs", "ok": True, "message": f"one GPU a rank ({used or 'no records'}"
                f"{'; unreadable: ' + '; '.join(unreadable) if unreadable else ''})"}
    return {"name": "GPUs", "ok": False, "message": "; ".join(problems)}


def run(plan: Any, env: Any, attempt: int, *, wait_s: float = WAIT_S) -> dict[str, Any]:
    """Every rank: check this node (its first rank), agree on every node's verdict through the
    run directory, raise PreflightFailed on every rank alike when a node failed."""
    logs = RunLayout.of_plan(plan).attempt_logs(attempt)
    node = env.nodes[env.node_rank] if env.node_rank < len(env.nodes) else str(env.node_rank)
    if env.local_rank == 0:
        verdict = {"node": node, "checks": node_checks(plan, dict(os.environ), node, env), "time": time.time()}
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / NAME.format(node=env.node_rank)
        write_private(path, json.dumps(verdict) + "\n")
    verdicts = _gather(logs, env.num_nodes, wait_s)
    failed = {v["node"]: [c["message"] for c in v["checks"] if not c["ok"]] for v in verdicts.values()}
    failed = {n: m for n, m in failed.items() if m}
    missing = sorted(set(range(env.num_nodes)) - set(verdicts))
    summary = {"attempt": attempt, "ok": not failed,
               "nodes": {v["node"]: [c["message"] for c in v["checks"] if not c["ok"]] or "ok" for v in verdicts.values()},
               **({"no_verdict_from_node_ranks": missing} if missing else {})}
    if env.rank == 0:
        Ledger(plan.paths.ledger).write(LedgerNote(event="preflight", time=time.time(), fields=summary))
    if failed:
        raise PreflightFailed(failed)
    return summary


def _gather(logs: Path, num_nodes: int, wait_s: float) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + wait_s
    out: dict[int, dict[str, Any]] = {}
    while True:
        for k in range(num_nodes):
            if k not in out:
                try:
                    out[k] = json.loads((logs / NAME.format(node=k)).read_text())
                except (OSError, ValueError):
                    pass
        if len(out) == num_nodes or time.monotonic() >= deadline:
            return out
        time.sleep(0.05)
