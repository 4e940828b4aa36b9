"""Nodes a failure points at, kept out of the requeued job.

After an attempt that ended in a node failure or a hang, rank 0 names the nodes the failure
points at (DOWN in SLURM now; the nodes of the ranks whose hang watchdog fired, when not every
rank hung), and lmtrain.preemption.policy.nodes_to_exclude decides which the requeued job keeps off (never
so many that the job no longer fits its partition). Once the job is pending again, rank 0 sets
its ``ExcNodeList`` (``scontrol update``) and the ledger says ``nodes_excluded`` (``history``
shows it), or ``exclude_failed`` with SLURM's answer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hostlist import expand_hostlist  # SLURM hostlist notation

from lmcore.run.rundir import Ledger, LedgerNote, RunLayout
from lmcore.slurm import client as slurm
from lmtrain.health.watchdog import hang_markers
from lmtrain.preemption.policy import EndFacts
from lmtrain.preemption.slurm_facts import SLURM_QUERY_TIMEOUT_S

log = logging.getLogger("lmtrain.preemption")
EXCLUDE_WAIT_S = 20.0  # for a requeued job to be pending, before its ExcNodeList is set


def bad_node_facts(plan: Any, env: Any, attempt: int, facts: EndFacts, info: dict[str, str] | None, *,
                   hung: bool) -> None:
    """Rank 0: the nodes this attempt's failure points at (DOWN now; the nodes of hung ranks
    when not every rank hung), what the job already excludes, and the partition's nodes."""
    bad = []
    for entry in facts.nodes_down:  # "n2" (DOWN now) or "n[1-2] (NODE_FAIL)" (accounting: the job's nodes)
        names = expand_hostlist(entry.removesuffix(" (NODE_FAIL)"))
        if len(names) == 1:  # of a NODE_FAIL of several nodes, which one failed is unknown
            bad += names
    if hung:
        per_node = max(1, plan.topology.tasks_per_node)
        ranks = {int(m["rank"]) for m in hang_markers(RunLayout.of_plan(plan), attempt) if "rank" in m}
        if ranks and len(ranks) < env.world_size:
            bad += [env.nodes[r // per_node] for r in sorted(ranks) if r // per_node < len(env.nodes)]
    # nodes that failed the preflight, unless every node of a several-node attempt did (the setup)
    if facts.preflight and (len(facts.preflight) < len(env.nodes) or len(env.nodes) == 1):
        bad += list(facts.preflight)
    facts.bad_nodes = sorted(set(bad))
    if not facts.bad_nodes or info is None:
        return
    excluded = info.get("ExcNodeList", "")
    facts.excluded = [] if excluded in ("", "(null)") else expand_hostlist(excluded)
    try:
        part = next((p for p in slurm.partitions(timeout=SLURM_QUERY_TIMEOUT_S) if p.name == info.get("Partition")),
                    None)
        facts.partition_nodes = expand_hostlist(part.nodes) if part is not None else None
    except Exception as exc:
        log.warning("could not list the partition's nodes: %s", exc)

def exclude_nodes(plan: Any, env: Any, attempt: int, nodes: list[str]) -> None:
    """Rank 0, after the requeue: keep the pending job off ``nodes`` (the decision's), and say so in the ledger."""
    if not nodes or env.launcher != "slurm":
        return
    ledger = Ledger(plan.paths.ledger)
    fields = {"attempt": attempt, "job_id": env.job_id, "nodes": nodes}
    deadline = time.monotonic() + EXCLUDE_WAIT_S
    while True:  # ExcNodeList changes only while the job is pending: wait for the requeue to land
        try:
            state = slurm.job_state(env.job_id, timeout=SLURM_QUERY_TIMEOUT_S)
            if slurm.state_word(state) in ("PENDING", "REQUEUE_HOLD", "REQUEUED") or time.monotonic() > deadline:
                slurm.exclude_nodes(env.job_id, nodes, timeout=SLURM_QUERY_TIMEOUT_S)
                log.info("job %s keeps off %s from now on (ExcNodeList)", env.job_id, ",".join(nodes))
                ledger.write(LedgerNote(event="nodes_excluded", time=time.time(), fields=fields))
                return
        except Exception as exc:
            if time.monotonic() > deadline:
                log.error("could not keep job %s off %s: %s", env.job_id, ",".join(nodes), exc)
                ledger.write(LedgerNote(event="exclude_failed", time=time.time(),
                                        fields={**fields, "detail": str(exc)[:500]}))
                return
        time.sleep(0.5)
