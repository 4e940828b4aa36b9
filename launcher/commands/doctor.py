"""lmlaunch doctor job.yaml [overrides...] [--cluster NAME] [--on-nodes [--exclude-bad]] [--json]:
preflight on the login node, and with --on-nodes on the nodes themselves."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from launcher.commands import add_spec_arguments, with_examples
from launcher.context import Context
from launcher.doctor import checks as doctor, nodes as doctor_nodes
from launcher.doctor.container import container_checks
from launcher.doctor.ops import jit_ops
from launcher.planning.resolve import excluded_nodes_path, resolve
from launcher.spec import excluded_nodes
from launcher.spec.profiles import Profile
from lmcore.errors import ExitCode, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    with_examples(
        p,
        'lmlaunch doctor jobs/tiny-cpu.yaml',
        'lmlaunch doctor jobs/tiny-cpu.yaml --on-nodes     # a probe job measures the nodes',
    )
    add_spec_arguments(p, "checkpoint.dir=/scratch/ckpt")
    p.add_argument("--json", action="store_true", help="every check with its figures, as JSON")
    p.add_argument("--on-nodes", action="store_true",
                   help="also run a short job on the run's kind of nodes: GEMM, memory copy and checkpoint-write "
                        "figures per node (against the median), the *_SOCKET_IFNAME interfaces, one all-reduce "
                        "over all of them; nodes that pass leave the excluded-nodes record")
    p.add_argument("--exclude-bad", action="store_true",
                   help="with --on-nodes: record the nodes that fail, so that the next `lmlaunch submit` to this "
                        "cluster profile excludes them (sbatch --exclude; the dry run shows why)")


def _on_nodes(args: argparse.Namespace, r: Any, ctx: Context, checks: list[doctor.Check]) -> dict[str, Any]:
    """The probe job, its checks (appended to ``checks``) and the excluded-nodes record."""
    profile: Profile = r.profile
    probe = doctor_nodes.run_probe(r.plan, Path(r.plan.paths.run_dir).parent)
    node_checks = doctor_nodes.judge_nodes(probe.facts, probe.allocated, profile.min_allreduce_busbw_gbps,
                                           probe.silent)
    checks += node_checks
    bad = doctor_nodes.bad_nodes(node_checks, probe.allocated)
    path = excluded_nodes_path(profile.name, ctx.environ or None)
    merged = excluded_nodes.merge(excluded_nodes.load(path), bad, probe.allocated, now=time.time(),
                                  job_id=probe.job_id, add=args.exclude_bad)
    excluded_nodes.save(path, merged.record)
    return {"job_name": probe.job_name, "job_id": probe.job_id, "seconds": probe.seconds,
            "allocated": probe.allocated, "nodes": {f.node: f.to_json() for f in probe.facts},
            "bad": bad, "record": str(path), "excluded": excluded_nodes.reasons(merged.record),
            "added": list(merged.added), "cleared": list(merged.cleared), "_facts": probe.facts}


def _record_lines(nodes: dict[str, Any], profile: str, exclude_bad: bool) -> list[str]:
    out = []
    for n in nodes["cleared"]:
        out.append(f"{n} passed: no longer excluded from submissions to profile '{profile}'")
    for n in nodes["added"]:
        out.append(f"{n} is now excluded from submissions to profile '{profile}' (sbatch --exclude): {nodes['bad'][n]}")
    if nodes["bad"] and not exclude_bad:
        out.append(f"to exclude {', '.join(nodes['bad'])} from the next submissions: add --exclude-bad")
    if nodes["excluded"]:
        out.append(f"excluded nodes ({nodes['record']}): {', '.join(nodes['excluded'])}; a node leaves the record "
                   f"when a later `doctor --on-nodes` probes it and it passes (or delete the file)")
    return out


def _gather(args: argparse.Namespace, ctx: Context, working: Any) -> tuple[Any, list[Any], dict[str, Any] | None]:
    """The plan and every check (with --on-nodes the probe job's too), each stage said on ``working``."""
    r = resolve(args.spec, args.overrides, args.cluster, ctx.environ, python=ctx.python, force=True,
                check_data=False)
    from launcher.submit.script import render_script  # the job script exactly as submit writes it

    working.update(f"doctor {args.spec}: SLURM, the partition, preemption, space, data, the runtime")
    # with --on-nodes the probe may clear or add excluded nodes: the script is judged after it
    checks = doctor.diagnose(r.plan, r.profile, ctx.environ or None,
                             job_script=None if args.on_nodes else render_script(r.plan))
    if r.plan.container and not any(c.name == "slurm" and c.status == doctor.FAIL for c in checks):
        working.update(f"doctor {args.spec}: the container's image and interpreter")
        checks += container_checks(r.plan)  # the image, its runtime, the interpreter inside
    if any(c.name == "runtime" and c.status == doctor.OK for c in checks):  # the tasks' interpreter imports it
        jit = jit_ops(r.plan, r.plan.job_spec().trainer.offload_optimizer)
        checks += [jit] if jit is not None else []
    nodes: dict[str, Any] | None = None
    if args.on_nodes:
        blocked = [c for c in checks if c.name in ("slurm", "partition") and c.status == doctor.FAIL]
        if blocked:
            checks.append(doctor.Check("nodes", doctor.FAIL, f"the node probe was not submitted: {blocked[0].message}"))
        else:
            working.update(f"doctor {args.spec}: the probe job on the nodes (queued, then measuring)")
            nodes = _on_nodes(args, r, ctx, checks)
            after = resolve(args.spec, args.overrides, args.cluster, ctx.environ, python=ctx.python, force=True,
                            check_data=False).plan
            checks += doctor.job_script_checks(after, render_script(after))
    return r, checks, nodes


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.exclude_bad and not args.on_nodes:
        raise UserError("--exclude-bad needs --on-nodes: nodes are judged only by the probe job it runs")
    with ctx.working(f"doctor {args.spec}: planning it", quiet=args.json) as working:
        r, checks, nodes = _gather(args, ctx, working)
    failed = [c for c in checks if c.status == doctor.FAIL]
    if args.json:
        body: dict[str, Any] = {"spec": args.spec, "run": r.plan.run_name, "ok": not failed,
                                "checks": doctor.to_json(checks)}
        if nodes is not None:
            body["on_nodes"] = {k: v for k, v in nodes.items() if not k.startswith("_")}
        ctx.out(json.dumps(body, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            ctx.out(f"{c.status:<4}  {c.name:<{width}}  {c.message}")
        if nodes is not None:
            ctx.out(f"node probe: job {nodes['job_id'] or '?'} ({nodes['job_name']}) on "
                    f"{', '.join(nodes['allocated'])}, {nodes['seconds']:.0f} s")
            for line in doctor_nodes.node_table(nodes["_facts"]):
                ctx.out(line)
            for line in _record_lines(nodes, r.profile.name, args.exclude_bad):
                ctx.out(line)
        ctx.out(f"{len(failed)} failed, {sum(c.status == doctor.WARN for c in checks)} warnings: "
                + ("fix the failures before submitting" if failed else "ready to submit"))
    return ExitCode.FAILURE if failed else 0
