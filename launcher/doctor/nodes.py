"""`lmlaunch doctor SPEC --on-nodes [--exclude-bad]`: ask the nodes themselves.

One short job (srun, one task per node, the run's partition, account, QOS, node count, GRES and
the profile's setup lines, so it lands on the kind of nodes the run would get) runs
``python -m lmtrain.health.node_probe`` on every node (``lmcore.node_facts`` is what comes back).
Pure ``judge_*`` functions then compare each node's GEMM, memory and write figures with the
median of the nodes, check the ``*_SOCKET_IFNAME`` interfaces exist on each node, and hold the
all-reduce bandwidth to the profile's ``min_allreduce_busbw_gbps``. The probe ignores the
user's excluded nodes: it is how an excluded node is judged again.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.doctor.checks import FAIL, OK, WARN, Check
from launcher.runs import snapshot
from launcher.submit.shell import shell_quote
from lmcore.errors import SlurmUnavailable, UserError
from lmcore.job import site_options
from lmcore.job.container import ContainerPlan, wrap
from lmcore.job.plan import LaunchPlan
from lmcore.node_facts import MARK, NodeFacts, ifname_verdicts
from lmcore.slurm import client as slurm

# A node below half the median sets the pace of every synchronous step (the others wait at each
# all-reduce); on identical nodes these one-second figures vary by well under 20% (n1/n2 of the
# local cluster, measured together: 101 vs 103 GFLOP/s, 31 vs 34 GB/s).
SLOW_FACTOR = 0.5
# A node's write+fsync is judged with a wider margin: the filesystem is usually shared, and one
# node's write can catch another job's burst even when the nodes take turns (the local cluster's
# two nodes on one disk, best of 3 each, measured 237 against 649 MB/s under the test suite's load).
# A node at a quarter of the median is still named.
WRITE_SLOW_FACTOR = 0.25
# figure -> (what it is, unit, status of a node below factor x median, factor). A slow disk is a
# warning: its cause is usually the shared filesystem, not the node.
FIGURES = {
    "gemm_gflops": ("GEMM", "GFLOP/s", FAIL, SLOW_FACTOR),
    "mem_gbps": ("memory copy", "GB/s", FAIL, SLOW_FACTOR),
    "write_mbps": ("checkpoint write+fsync", "MB/s", WARN, WRITE_SLOW_FACTOR),
}
PROBE_TIME_LIMIT_MIN = 5  # srun --time: the probe itself takes seconds
PROBE_TIMEOUT_S = 900.0  # queue wait included
PROBE_CODE = "code"  # in the work directory: this lmlaunch's packages, for a probe in a container
NODE_LINE = "LMLAUNCH_PROBE_NODE "  # the task's shell names its node before python starts
_LABEL = re.compile(r"^\s*(\d+): (.*)$")


# --------------------------------------------------------------------------- pure judgements
def judge_vs_median(figure: str, per_node: Mapping[str, float | None], factor: float | None = None) -> list[Check]:
    """Each node's ``figure`` against ``factor`` (default: the figure's own) x the median of the
    nodes that measured it."""
    what, unit, status, own = FIGURES[figure]
    factor = own if factor is None else factor
    values = {n: v for n, v in per_node.items() if v is not None}
    if not values:
        return []
    median = statistics.median(values.values())
    out = []
    for node, v in sorted(values.items()):
        fig = {"node": node, figure: v, "median": round(median, 3), "factor": factor, "nodes": len(values)}
        if v < factor * median:
            out.append(Check(f"{what} {node}", status, f"{node}: {what} {v:,.1f} {unit} is below {factor} x the median "
                             f"{median:,.1f} {unit} of {len(values)} nodes", fig))
        else:
            out.append(Check(f"{what} {node}", OK, f"{node}: {what} {v:,.1f} {unit} (median {median:,.1f})", fig))
    return out


def judge_interfaces(facts: NodeFacts) -> list[Check]:
    out = []
    for v in ifname_verdicts(facts.ifname_env, facts.interfaces):
        fig = {"node": facts.node, "var": v.var, "value": v.value, "selected": list(v.selected),
               "missing": list(v.missing), "interfaces": list(facts.interfaces)}
        out.append(Check(f"{v.var} {facts.node}", OK if v.ok else FAIL, f"{facts.node}: {v.why}", fig))
    return out


def judge_allreduce(facts: Sequence[NodeFacts], min_busbw_gbps: float) -> Check:
    """The allocation's all-reduce (every rank reports the same; rank 0's is taken)."""
    ar = next((f.allreduce for f in sorted(facts, key=lambda f: f.rank) if f.allreduce is not None), None)
    if ar is None:
        return Check("all-reduce", FAIL, "no node reported an all-reduce")
    fig = {"backend": ar.backend, "world_size": ar.world_size, "bytes": ar.bytes, "seconds": ar.seconds,
           "busbw_gbps": ar.busbw_gbps, "min_busbw_gbps": min_busbw_gbps}
    if ar.skipped:
        return Check("all-reduce", WARN if ar.world_size < 2 else FAIL, f"{ar.backend} all-reduce: {ar.skipped}", fig)
    if ar.error or ar.busbw_gbps is None or ar.seconds is None:
        return Check("all-reduce", FAIL, f"{ar.backend} all-reduce over {ar.world_size} nodes failed: {ar.error}", fig)
    size = f"{ar.backend} all-reduce of {ar.bytes / 2**20:.0f} MiB over {ar.world_size} nodes"
    if min_busbw_gbps and ar.busbw_gbps < min_busbw_gbps:
        return Check("all-reduce", FAIL, f"{size}: bus bandwidth {ar.busbw_gbps:.2f} GB/s is below the profile's "
                     f"min_allreduce_busbw_gbps {min_busbw_gbps:g}", fig)
    return Check("all-reduce", OK, f"{size}: bus bandwidth {ar.busbw_gbps:.2f} GB/s "
                 f"({ar.seconds * 1e3:.1f} ms; profile minimum {min_busbw_gbps:g})", fig)


def judge_nodes(facts: Sequence[NodeFacts], allocated: Sequence[str], min_busbw_gbps: float,
                silent: Mapping[str, str] | None = None) -> list[Check]:
    """Every node check of one probe. ``allocated``: the nodes the job got; ``silent``: node -> the
    last line it printed, for nodes that gave no figures."""
    by_node = {f.node: f for f in facts}
    out = []
    for node in allocated:
        if node not in by_node:
            last = (silent or {}).get(node) or "(no output)"
            out.append(Check(f"probe {node}", FAIL, f"{node}: the probe gave no figures; its last line: {last}",
                             {"node": node}))
    for figure in FIGURES:
        out += judge_vs_median(figure, {f.node: getattr(f, figure) for f in facts})
    for f in sorted(facts, key=lambda f: f.node):
        for figure, err in sorted(f.errors.items()):
            what = FIGURES.get(figure, (figure, "", FAIL, SLOW_FACTOR))[0]
            out.append(Check(f"{what} {f.node}", FAIL, f"{f.node}: {what} failed: {err}", {"node": f.node}))
        out += judge_interfaces(f)
    out.append(judge_allreduce(facts, min_busbw_gbps))
    return out


def bad_nodes(checks: Sequence[Check], probed: Sequence[str]) -> dict[str, str]:
    """node -> reason, for the failed per-node checks a node does not share with every other
    probed node: a failure all nodes share (an interface name no node has) is the setup's, not a
    node's, and excluding every node would help nobody."""
    failed = [c for c in checks if c.status == FAIL and "node" in c.figures]
    kinds: dict[str, set[str]] = {}
    for c in failed:
        kinds.setdefault(c.name.rsplit(" ", 1)[0], set()).add(c.figures["node"])
    out: dict[str, list[str]] = {}
    for c in failed:
        kind, node = c.name.rsplit(" ", 1)[0], c.figures["node"]
        if len(probed) > 1 and kinds[kind] >= set(probed):
            continue
        out.setdefault(node, []).append(c.message.removeprefix(f"{node}: "))
    return {n: "; ".join(r) for n, r in sorted(out.items())}


# --------------------------------------------------------------------------- the probe job (I/O)
@dataclass(frozen=True)
class ProbeRun:
    job_name: str
    job_id: str
    allocated: list[str]  # in task order
    facts: list[NodeFacts]
    silent: dict[str, str]  # node -> last line, for nodes without figures
    seconds: float


def probe_command(plan: LaunchPlan, workdir: Path) -> str:
    """What every task runs: the profile's setup, the plan's environment (not PYTHONPATH: the
    probe is this lmlaunch's code, not an earlier run's snapshot), then the probe."""
    skip = {"PYTHONPATH", "LMLAUNCH_RUN_DIR"}
    box = ContainerPlan.from_json(plan.container) if plan.container else None
    # in a container the probe runs in it, with this lmlaunch's code copied beside its work
    # directory (the image and a mounted venv know nothing of this checkout); setup lines are the
    # host's, and pyxis starts this very shell inside the container
    setup = [] if box is not None else list(plan.setup)
    lines = [*setup, *(f"export {k}={shell_quote(v)}" for k, v in sorted(plan.env.items()) if k not in skip)]
    lines.append(f'echo "{NODE_LINE}${{SLURMD_NODENAME:-$(hostname)}} $SLURM_JOB_ID"')
    inner = ["-m", "lmtrain.health.node_probe", "--workdir", str(workdir), "--checkpoint-dir", plan.paths.checkpoint_dir]
    if box is None:
        args = [*shlex.split(plan.python), *inner]
    else:
        lines.append(f"export PYTHONPATH={shell_quote(str(workdir / PROBE_CODE))}")
        args = wrap(box, inner)
    lines.append("exec " + " ".join(shlex.quote(a) for a in args))
    return "\n".join(lines)


def srun_args(plan: LaunchPlan, job_name: str, workdir: Path) -> list[str]:
    s = plan.slurm
    args = [f"--job-name={job_name}", f"--partition={s.partition}", f"--nodes={s.nodes}",
            "--ntasks-per-node=1", f"--cpus-per-task={s.cpus_per_task}", f"--time={PROBE_TIME_LIMIT_MIN}",
            "--label", "--kill-on-bad-exit=0", f"--chdir={workdir}"]
    for flag, value in (("account", s.account), ("qos", s.qos), ("constraint", s.constraint),
                        ("gres", s.gres), ("mem", s.mem)):
        if value:
            args.append(f"--{flag}={value}")
    if s.exclusive:
        args.append("--exclusive")
    # the site's sbatch options that srun takes too (a reservation, a hint): the probe runs where the job
    # would (no mail about the probe)
    site = {k: v for k, v in s.site_options.items() if k in site_options.SRUN_OPTIONS and not k.startswith("mail-")}
    return slurm.srun_command([*args, *site_options.as_args(site), *plan.srun_args],
                              ["bash", "-c", probe_command(plan, workdir)])


def parse_output(text: str) -> tuple[list[str], list[NodeFacts], dict[str, str], str]:
    """srun --label output -> (nodes in task order, facts, last line of each silent node, job id)."""
    nodes: dict[int, str] = {}
    job_id = ""
    facts: list[NodeFacts] = []
    last: dict[int, str] = {}
    for line in text.splitlines():
        m = _LABEL.match(line)
        if not m:
            continue
        task, body = int(m.group(1)), m.group(2)
        if body.startswith(NODE_LINE):
            node, _, job_id = body.removeprefix(NODE_LINE).strip().partition(" ")
            nodes[task] = node
        elif body.startswith(MARK):
            facts.append(NodeFacts.from_json(json.loads(body.removeprefix(MARK))))
        elif body.strip():
            last[task] = body.strip()
    reported = {f.node for f in facts}
    silent = {nodes[t]: last.get(t, "") for t in nodes if nodes[t] not in reported}
    return [nodes[t] for t in sorted(nodes)], facts, silent, job_id


def run_probe(plan: LaunchPlan, runs_root: Path, job_name: str | None = None) -> ProbeRun:
    """Run the probe job and wait for it (srun); its work directory (the rendezvous file) lives
    under the runs root, which every node sees, and is removed afterwards."""
    name = job_name or f"{plan.slurm.job_name}-node-probe"
    workdir = runs_root / ".node-probe" / f"{name}-{secrets.token_hex(3)}"
    workdir.mkdir(parents=True, mode=0o700)
    if plan.container:
        for rel, src in snapshot.source_files(snapshot.code_packages()).items():
            dst = workdir / PROBE_CODE / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    started = time.time()
    try:
        proc = slurm.run(srun_args(plan, name, workdir), timeout=PROBE_TIMEOUT_S, check=False)
    except SlurmUnavailable as exc:
        if "did not answer within" not in exc.message:
            raise
        ids = slurm.jobs_submitted_since(name, started, timeout=10)
        if ids:
            slurm.cancel(ids)
        raise UserError(f"the node probe job '{name}' did not finish within {PROBE_TIMEOUT_S:.0f} s "
                        f"(queued behind other jobs? `squeue -n {name}`); it was cancelled") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    allocated, facts, silent, job_id = parse_output(proc.stdout + "\n" + proc.stderr)
    if not allocated:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(f"the node probe job '{name}' did not start: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return ProbeRun(name, job_id, allocated, facts, silent, round(time.time() - started, 1))


def node_table(facts: Sequence[NodeFacts]) -> list[str]:
    """One line per node with every figure (the text report)."""
    out = []
    for f in sorted(facts, key=lambda f: f.node):
        def fmt(v: float | None, unit: str) -> str:
            return "failed" if v is None else f"{v:,.1f} {unit}"
        out.append(f"      {f.node}: {f.device}; GEMM {fmt(f.gemm_gflops, 'GFLOP/s')}, memory copy "
                   f"{fmt(f.mem_gbps, 'GB/s')}, write+fsync {fmt(f.write_mbps, 'MB/s')} ({f.write_path})")
    return out
