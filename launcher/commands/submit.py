"""lmlaunch submit job.yaml [overrides...] [--cluster NAME] [--dry-run [--json]] [--new|--resume [--new-code]]"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from launcher.commands import add_spec_arguments, with_examples
from launcher.context import Context
from launcher.planning.memory_check import summary
from launcher.planning.placement import describe_layout
from launcher.planning.resolve import cluster_argument, resolve
from launcher.submit import dependencies
from launcher.submit.script import render_script
from launcher.submit.submission import submit_plan
from lmcore.text_rules import brief, escape_controls

if TYPE_CHECKING:
    from lmcore.job.plan import LaunchPlan


def add_arguments(p: argparse.ArgumentParser) -> None:
    with_examples(
        p,
        'lmlaunch submit jobs/tiny-cpu.yaml',
        'lmlaunch submit jobs/tiny-cpu.yaml --dry-run            # the batch script, nothing queued',
        'lmlaunch submit jobs/tiny-cpu.yaml trainer.max_steps=300 --resume',
        'lmlaunch submit jobs/tiny-cpu.yaml name=eval-1 --after tiny-cpu',
    )
    add_spec_arguments(p, "trainer.zero_stage=3")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan after every check submit makes, the controller's too where it answers "
                        "(sbatch --test-only: its start estimate, or its refusal: exit 5); nothing is queued")
    p.add_argument("--offline", action="store_true",
                   help="with --dry-run: ask the controller nothing (the plan and lmlaunch's own checks only)")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--new", action="store_true", help="start over if the run name exists (old run is archived)")
    g.add_argument("--resume", action="store_true", help="continue the existing run of this name")
    p.add_argument("--after", action="append", default=[], metavar="RUN[:ok|:any]|singleton",
                   help="start only after RUN's job completed successfully (:ok, the default) or ended (:any), "
                        "or (singleton) when no other job of this name runs; repeatable")
    p.add_argument("--new-code", action="store_true",
                   help="with --resume: run the current code instead of the run's code snapshot (says what changed)")


def render_dry_run(plan: LaunchPlan, script: str, environ: Mapping[str, str] | None = None) -> str:
    """The plan for people: topology arithmetic, the job script exactly as submitted, the task
    environment with the reason for each variable, DeepSpeed JSON, Trainer arguments, paths.

    Secrets passed by name are listed by name, with whether the submitting shell has them;
    their values are never read into the output.
    """
    lines = []
    t = plan.topology
    lines.append(f"# lmlaunch plan for run '{plan.run_name}' on cluster '{plan.profile}'")
    lines.append(
        f"# topology: {t.arithmetic()}"
    )
    if plan.memory:
        lines.append("# memory per rank (planned):")
        lines.extend(f"#{line}" for line in summary(plan.memory))
    for note in plan.notes:
        lines.append(f"# note: {note}")
    lines += _layout_lines(plan.placement)
    lines.append("")
    lines.append("## job script (as submitted)")
    lines.append(script.rstrip("\n"))
    lines.append("")
    lines += _env_lines(plan, environ)
    port = plan.rendezvous.get("master_port")
    if port:
        lines.append(f"MASTER_PORT=<{port}>")
    if plan.container is not None:
        c = plan.container
        lines += ["", f"## container: {c['runtime']} image {c['image']}, {c['python']} inside, working directory "
                      f"{c['workdir']} (the batch script stays on the host)"]
        lines += [f"mount {m['src']}" + (f" -> {m['dst']}" if m["dst"] != m["src"] else "")
                  + (f" ({m['mode']})" if m["mode"] else "") + f"    # {m['why']}" for m in c["mounts"]]
        lines += [f"flag {f['flag']}    # {f['why']}" for f in c["flags"]]
        lines.append("passed in from the task's environment: " + " ".join(c["env"]))
    if plan.deepspeed is not None:
        lines.append("")
        lines.append("## DeepSpeed config")
        lines.append(json.dumps(plan.deepspeed, indent=2, sort_keys=True))
    lines.append("")
    lines.append("## Trainer arguments (lightning.Trainer gets exactly these; the strategy object, loggers, callbacks")
    lines.append("## and enable_model_summary on rank 0 are built on the allocation; no validation split: validation off)")
    lines.append(json.dumps(plan.trainer.kwargs(), indent=2, sort_keys=True))
    lines.append("")
    lines.append("## Strategy, seed, gradient clipping (built on the allocation; the module clips)")
    lines.append(json.dumps(dataclasses.asdict(plan.training), indent=2, sort_keys=True))
    lines.append("")
    lines.append("## run directory")
    for k, v in plan.paths.__dict__.items():
        lines.append(f"{k}: {v}")
    # Values with line breaks were escaped above (and in the script by launcher.submit.shell.shell_quote); any
    # other control character left in a line (a terminal escape in a note or a path) shows escaped.
    return "\n".join(escape_controls(line) for line in "\n".join(lines).split("\n"))


def _env_lines(plan: LaunchPlan, environ: Mapping[str, str] | None) -> list[str]:
    """The task environment, each variable with its reason (a rank's own values by local rank)."""
    lines = ["## environment of every task"]
    for name in sorted(plan.env):
        lines.append(f"{name}={escape_controls(plan.env[name])}    # {plan.env_reasons.get(name, '')}")
    for name, spec in sorted(plan.rank_env.items()):
        key, said = ("by_gpu", "by the GPU on its node") if spec.get("by_gpu") else ("by_local_rank", "by local rank")
        by_rank = ", ".join(f"{i}: {v}" for i, v in enumerate(spec[key]))
        lines.append(f"{name}=<{said}: {by_rank}>    # {spec['why']}")
    for o in plan.env_overrides:
        lines.append(f"# override: {o.name}: profile {brief(o.profile_value, 200)} -> job {brief(o.job_value, 200)}")
    for name in plan.passthrough:
        state = "" if environ is None else (" (set here)" if environ.get(name) else " (NOT set in this shell)")
        lines.append(f"{name}=<passed through from the submitting shell{state}; value never written>")
    return lines


def _layout_lines(placement: dict[str, Any] | None) -> list[str]:
    """The dry run's rank layout: node slot -> ranks -> stages and replicas -> segment."""
    if not placement:
        return []
    return [f"# rank layout (network topology/{placement['topology']}, within: {placement['within']}; the node slots "
            "in the order SLURM lists the job's nodes):", *(f"#   {line}" for line in describe_layout(placement))]


def _placed(args: argparse.Namespace, ctx: Context, first: Any, overrides: list[str],
            dependency: str | None) -> tuple[Any, list[Any], list[str]]:
    """A run naming several clusters: the plan of the one where it starts soonest (each must be
    able to run it), with the clusters' answers and their lines."""
    from launcher.submit.start_estimates import place
    from lmcore.errors import UserError

    chosen, answers, lines = place(args.spec, overrides, first, ctx.environ, ctx.python, dependency, force=args.force)
    if chosen is None:
        if args.dry_run:
            ctx.out("\n".join(f"# {line}" for line in lines))
        raise UserError("no cluster the run names would take it; nothing was submitted:\n" + "\n".join(lines[1:-1]),
                        exit_code=2)
    return chosen, answers, lines


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.offline and not args.dry_run:
        from lmcore.errors import UserError

        raise UserError("--offline is a dry run's: `lmlaunch submit SPEC --dry-run --offline` (a submission asks the "
                        "controller in any case)")
    cluster, overrides = cluster_argument(args.cluster, args.overrides)
    r = resolve(args.spec, overrides, cluster, ctx.environ, python=ctx.python, force=args.force, several=True,
                data_later=bool(args.after))  # a run it waits for may prepare its data
    after = dependencies.parse(args.after, ctx.environ or None)
    placed: list[str] = []
    answers: list[Any] = []
    if r.spec.clusters and not cluster:  # several: the one where it starts soonest
        r, answers, placed = _placed(args, ctx, r, overrides, dependencies.planned(after))
    opening = _checked(args, r, ctx)  # what submit refuses, the dry run refuses too
    if args.dry_run:  # the dependency as it would be asked for (SLURM is not asked of it here)
        script = render_script(r.plan, dependencies.planned(after))
        cluster_said = _cluster_answer(r.plan, script, bool(after), bool(answers), args.offline)
        if args.json:
            chosen = {"clusters": [dataclasses.asdict(a) for a in answers], "chosen": r.profile.name} if answers else {}
            said = {"opening": opening} if opening else {}  # what --resume starts from
            ctx.out(json.dumps({"plan": r.plan.to_dict(), "script": script, "cluster": cluster_said, **said, **chosen},
                               indent=2, sort_keys=True))
        else:
            ctx.out("\n".join([*(f"# {line}" for line in placed), *(f"# {line}" for line in opening),
                               f"# {cluster_said}", render_dry_run(r.plan, script, ctx.environ)]))
        return 0
    for line in placed:
        ctx.out(line)
    code = submit_plan(r, ctx, new=args.new, resume=args.resume, new_code=args.new_code, spec_path=args.spec,
                       after=after)
    clusters = r.spec.clusters or []
    moves = bool(clusters) and (r.spec.move is not None or _over_ssh(clusters, ctx))
    if code == 0 and (moves or r.plan.slurm.spare_nodes):
        from launcher.submit.watcher import start_watcher  # the watcher (one per run): moves, copies back, requeues
        from lmcore.run.run_layout import RunLayout

        pid = start_watcher(r.plan.run_name, r.plan.paths.run_dir, ctx)
        does = "; ".join(
            ([f"moves it between {', '.join(clusters)} as its move section says" if r.spec.move is not None
              else "copies its files back from a cluster over SSH"] if moves else [])
            + (["requeues it if its batch script's node fails and nobody in the job could"]
               if r.plan.slurm.spare_nodes else []))
        ctx.out(f"note: a watcher (pid {pid}) {does}; it writes {RunLayout.of_plan(r.plan).mover_log} (again: "
                f"lmlaunch move {r.plan.run_name} --detach)")
    return code


def _cluster_answer(plan: LaunchPlan, script: str, after: bool, placed: bool, offline: bool) -> str:
    """What the controller says of the script (launcher.submit.shape_check.dry_run_answer); a refusal
    raises. Not asked under --offline, for a run placed among several clusters (their answers are
    printed) or one waiting for another run (its dependency names jobs the controller judges at
    submission)."""
    if offline:
        return "the cluster: not asked (--offline)"
    if placed:
        return "the cluster: chosen by the clusters' answers above"
    if after:
        return "the cluster: not asked by the dry run (--after: the dependency is judged when it is submitted)"
    from launcher.submit.shape_check import dry_run_answer

    return dry_run_answer(plan, script)


def _checked(args: argparse.Namespace, r: Any, ctx: Context) -> list[str]:
    """Every check submit makes before it changes anything, for the submission and its dry run
    alike: the run's name against what exists (--new, --resume: what it would resume from),
    spare nodes the cluster can hold, a container's image and interpreter (unless --force); in a
    dry run also a checkpoint.dir another run writes and a job the run still has in SLURM. What
    the run would start from, as notes."""
    from launcher.doctor.container import submit_notes, submit_problems
    from launcher.runs import registry as runs
    from launcher.submit import lifecycle
    from launcher.submit.in_place import spare_problems
    from lmcore.errors import SpecError

    record = runs.load_record(r.plan.run_name, ctx.environ or None)
    opening = lifecycle.plan_opening(r.plan, new=args.new, resume=args.resume, record=record, new_code=args.new_code)
    spares = spare_problems(r.plan)  # no --force: SLURM would never start it
    if spares:
        raise SpecError([*spares, "nothing was submitted"], source=args.spec)
    if not args.force:  # a container's image and interpreter, where this machine can try them
        problems = submit_problems(r.plan)
        if problems:
            raise SpecError([*problems, "nothing was submitted (`lmlaunch doctor SPEC` says more; --force submits "
                             "anyway)"], source=args.spec)
    untried = [] if args.force else submit_notes(r.plan)  # --force: the container is not tried here
    if args.dry_run:  # (submit makes these itself, with the controller's ping between them)
        from launcher.submit.submission import refuse_clashes

        refuse_clashes(r.plan, opening.record, args.resume, ctx.environ or None, ask_slurm=not args.offline)
    return [*opening.notes, *([opening.continuation] if opening.continuation else []), *untried]


def _over_ssh(clusters: list[str], ctx: Context) -> bool:
    from launcher.spec.profiles import load_profile

    return any(load_profile(name, ctx.environ).login is not None for name in clusters)
