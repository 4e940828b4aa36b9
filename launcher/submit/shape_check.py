"""Before a job is queued: whether the cluster can ever run it.

SLURM queues a job that asks for more nodes than its partition holds, or more CPUs on a node than
any node has, and leaves it pending for ever (``PartitionConfig``). At scale that is an easy mistake
(``resources.nodes: 512`` on a partition of 256; ``tasks_per_node: 8`` x ``cpus_per_task: 16`` on
96-CPU nodes).

The partition's nodes and their CPUs come from one ``sinfo``, kept ``FACTS_TTL_S`` in the lmlaunch
home's cache (one submission after another asks nothing more of the controller:
tests/integration/test_load_status.py). A shape they cannot hold is asked again of fresh facts and
then of the controller itself (``sbatch --test-only`` on the job's exact script). Only a shape the
controller also refuses is refused, with SLURM's words, the shape and the partition's facts;
nothing is queued. Any other answer (a busy controller, a timeout) leaves the decision to sbatch.

A run with an evaluator alongside is one heterogeneous job: every refusal of it names eval.alongside.

The dry run asks the controller itself (:func:`dry_run_answer`: ``sbatch --test-only`` on the
script submit would send, where the controller answers and has the job's partition): what it refuses (a shape, an account, a
QOS, a reservation, a GRES) is refused as submit would be (exit 5, REFUSED), what it accepts is
said with its start estimate. A refusal that only nodes out of service now explain (DOWN, DRAINED,
not responding: the shape fits the partition with them) is not a refusal: sbatch queues such a job
and it waits for them (``ReqNodeNotAvail``), so the dry run says that, naming the nodes.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from launcher.runs.home import lmlaunch_home
from launcher.spec.profile_draft import gpus_of
from lmcore.errors import ExitCode, UserError
from lmcore.job.plan import LaunchPlan
from lmcore.run import rundir
from lmcore.slurm import client as slurm, way as slurm_way
from lmcore.slurm.batch_job import BatchJob

# What SLURM says of a job no node or partition of the cluster can hold (22.05 to 26.05)
IMPOSSIBLE = ("Requested node configuration is not available", "Node count specification invalid",
              "More processors requested than permitted", "Requested partition configuration not available",
              "Invalid generic resource (gres) specification")


def judge(plan: LaunchPlan, job: BatchJob) -> None:
    """Raise UserError (exit 5, REFUSED) when the controller says the job's script can never run."""
    text = job.text
    if plan.evaluator:
        _check_heterogeneous_job(plan, job)
        return
    if not slurm_way.way().tests_scripts:  # slurmrestd: its controller judges the job when it is submitted
        return
    p = plan.slurm
    if _fits(p, _facts(p.partition, fresh=False)) or _fits(p, _facts(p.partition, fresh=True)):
        return
    try:
        ok, message = slurm.test_only("sbatch", [], script=text)
    except Exception:  # the controller did not answer in time: sbatch itself will say
        return
    if ok or not any(words in message for words in IMPOSSIBLE):
        return
    raise _shape_refused(p, message)


def _shape_refused(p: Any, message: str) -> UserError:
    facts = _facts(p.partition, fresh=False) or {}
    return UserError(
        f"resources: the cluster cannot run this job as asked (sbatch --test-only: {message}): "
        f"nodes({p.nodes}) x tasks_per_node({p.ntasks_per_node}) x cpus_per_task({p.cpus_per_task})"
        f"{f', gpus_per_node({p.gpus_per_node})' if p.gpus_per_node else ''}{f', mem({p.mem}) a node' if p.mem else ''} "
        f"on partition '{p.partition}', "
        f"which has {len(facts.get('cpus') or [])} node(s) of {_cpus_text(facts)} CPUs"
        f"{f', less those the job excludes ({p.exclude}: `lmlaunch doctor --on-nodes` recorded them)' if p.exclude else ''}. "
        f"`sinfo -p {p.partition} -o '%D %c %G'` shows its nodes; nothing was submitted", exit_code=ExitCode.REFUSED)


# Which keys of the spec a refusal's words concern (SLURM 22.05 to 26.05 say these in sbatch's
# error, lower-cased here)
KEYS_BY_WORDS = (("reservation", "slurm.sbatch.reservation"), ("account", "resources.account"),
                 ("qos", "resources.qos"), ("partition", "resources.partition"), ("feature", "resources.constraint"),
                 ("generic resource", "resources.gpus_per_node"), ("time limit", "resources.time"),
                 ("memory", "resources.mem"))


def keys_of(message: str) -> str:
    """``; it concerns KEY, ...`` for the spec keys SLURM's refusal names, else nothing."""
    words = message.lower()
    keys = [key for said, key in KEYS_BY_WORDS if said in words]
    return f"; it concerns {', '.join(keys)}" if keys else ""


FACTS_TTL_S = 600.0


def _fits(p: Any, facts: dict[str, Any] | None) -> bool:
    """Whether ``nodes`` nodes of the partition each hold ``tasks_per_node x cpus_per_task`` CPUs
    (None facts: unknown, taken as fitting)."""
    if facts is None:
        return True
    need = p.ntasks_per_node * p.cpus_per_task
    return sum(1 for cpus in facts["cpus"] if cpus >= need) >= p.nodes


def _cpus_text(facts: dict[str, Any]) -> str:
    cpus = sorted(set(facts.get("cpus") or []))
    return "?" if not cpus else str(cpus[0]) if len(cpus) == 1 else f"{cpus[0]}-{cpus[-1]}"


def _facts(partition: str, *, fresh: bool) -> dict[str, Any] | None:
    """The partition's nodes' CPUs (``{"cpus": [...]}``), from the cache unless ``fresh`` or stale;
    None when SLURM did not say."""
    path = lmlaunch_home(None) / "cache" / "partition-facts.json"
    key = f"{os.environ.get('SLURM_CONF', '')}|{partition}"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    if not fresh and isinstance(entry, dict) and time.time() - float(entry.get("time", 0)) < FACTS_TTL_S:
        return entry
    try:
        cpus = [n.cpus for n in slurm.nodes() if partition in n.partitions]
    except Exception:  # sinfo failed: nothing judged here
        return None
    if not cpus:
        return None
    entry = {"time": time.time(), "cpus": cpus}
    try:
        from lmcore.atomic import write_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**(cached if isinstance(cached, dict) else {}), key: entry}))
    except OSError:
        pass  # asked again next time
    return entry


def _check_heterogeneous_job(plan: LaunchPlan, job: BatchJob) -> None:
    """A run with an evaluator alongside is one heterogeneous job: the controller judges it first
    (``sbatch --test-only``: an evaluator larger than its partition, a cluster that refuses
    heterogeneous jobs), and a refusal names eval.alongside with SLURM's words; nothing is queued. A
    refusal that nodes out of service now explain is left to sbatch (it queues the job to wait, or
    refuses what can never run)."""
    slurm_way.way().check_carries(lambda: job, "eval.alongside")
    code = rundir.RunLayout.of_plan(plan).code
    if code.is_dir() and not (code / "lmtrain" / "evaluator" / "main.py").is_file():
        raise UserError(f"eval.alongside: the run's code snapshot ({code}) predates the evaluator: resume with "
                        "--new-code, or score its checkpoints after with `lmlaunch eval`", exit_code=2)
    ok, message = slurm.test_only("sbatch", [], script=job.text)
    if not ok and not waits_for_nodes(plan.slurm, message):
        raise UserError(f"eval.alongside: SLURM refuses the heterogeneous job (trainer + evaluator): {message}",
                        exit_code=ExitCode.REFUSED)


def dry_run_answer(plan: LaunchPlan, text: str) -> str:
    """The dry run's line on the cluster: what ``sbatch --test-only`` says of the job's script where
    the controller answers (a refusal raised as submit raises it: UserError, REFUSED), else why it
    was not asked. Nothing is queued."""
    if not slurm_way.way().tests_scripts:
        return "the cluster: not asked by the dry run (slurmrestd judges the job when it is submitted)"
    if not slurm.ping(timeout=5.0):
        return "the cluster: not asked (its controller does not answer `scontrol ping`); submit asks it"
    if _facts(plan.slurm.partition, fresh=False) is None:  # another cluster's profile, or a partition gone
        return (f"the cluster: not asked (the SLURM that answers here lists no partition '{plan.slurm.partition}': "
                "not this profile's cluster?)")
    try:
        ok, message = slurm.test_only("sbatch", [], script=text)
    except Exception as exc:  # a timeout: said, and submit asks again
        return f"the cluster: sbatch --test-only gave no answer ({type(exc).__name__}: {str(exc)[:200]})"
    waiting = None if ok else waits_for_nodes(plan.slurm, message)
    if waiting:
        return f"the cluster would queue it to wait (sbatch --test-only: {message}): {waiting}"
    if not ok and not plan.evaluator and any(words in message for words in IMPOSSIBLE):
        raise _shape_refused(plan.slurm, message)
    if not ok:
        what = "eval.alongside: SLURM refuses the heterogeneous job (trainer + evaluator)" if plan.evaluator \
            else "the cluster refuses the job"
        raise UserError(f"{what} (sbatch --test-only: {message}){keys_of(message)}; submit would queue nothing",
                        exit_code=ExitCode.REFUSED)
    return f"the cluster would take it (sbatch --test-only: {message})"


# sinfo's short states (%t, its suffixes *~#!%$@^-+ stripped) of a node that runs no new job now
# but may return: a job that needs it is queued and waits (ReqNodeNotAvail)
OUT_OF_SERVICE = ("down", "drain", "drng", "fail", "maint", "boot", "reboot", "futr", "inval", "unk", "pow")


def _out_of_service(state: str) -> bool:
    return state.endswith("*") or state.rstrip("*~#!%$@^-+").startswith(OUT_OF_SERVICE)


def waits_for_nodes(p: Any, refusal: str) -> str | None:
    """Why a job the controller refused (``refusal``: SLURM's words) would still be queued: the
    refusal is one of a shape no node can hold (IMPOSSIBLE), and the nodes out of service that the
    job needs, named with their state and reason, explain it: its shape fits the partition with
    them (CPUs, and GPUs where it asks for some) and not without. Else None."""
    from hostlist import expand_hostlist  # SLURM hostlist notation: n[1-3,7]

    if not any(words in refusal for words in IMPOSSIBLE):
        return None

    try:
        listed = [n for n in slurm.nodes() if p.partition in n.partitions]
    except Exception:  # sinfo failed: the refusal stands as SLURM said it
        return None
    excluded = set(expand_hostlist(p.exclude)) if p.exclude else set()
    need_cpus = p.ntasks_per_node * p.cpus_per_task

    def holds(n: Any) -> bool:
        gpus = gpus_of(n.gres)
        return n.cpus >= need_cpus and (not p.gpus_per_node or (gpus is not None and gpus[1] >= p.gpus_per_node))

    fitting = [n for n in listed if n.name not in excluded and holds(n)]
    away = [n for n in fitting if _out_of_service(n.state)]
    if len(fitting) < p.nodes or not away or len(fitting) - len(away) >= p.nodes:
        return None
    named = ", ".join(f"{n.name} ({n.state}{f': {n.reason}' if n.reason and n.reason != 'none' else ''})" for n in away)
    return (f"it needs {p.nodes} node(s) and {len(fitting) - len(away)} of partition '{p.partition}' can run it now; "
            f"out of service: {named}. Submitted, it waits for them (squeue's reason: ReqNodeNotAvail); "
            "`sinfo -R` says why they are out")
