"""lmlaunch cluster up [--preempt-user-signal | --no-preempt-user-signal] | down | status"""

from __future__ import annotations

import argparse

from launcher.context import Context
from launcher.localcluster import cluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="install (as root) and start the cluster; reports it when already up")
    sig = up.add_mutually_exclusive_group()
    sig.add_argument(
        "--preempt-user-signal",
        dest="preempt_user_signal",
        action="store_true",
        default=None,
        help="SlurmctldParameters=preempt_send_user_signal: preempted jobs also get their --signal",
    )
    sig.add_argument(
        "--no-preempt-user-signal",
        dest="preempt_user_signal",
        action="store_false",
        help="preempted jobs get only SIGTERM (then SIGKILL after GraceTime); the default",
    )
    sub.add_parser("down", help="stop the daemons that `up` started (and the test workers' clusters)")
    sub.add_parser("status", help="daemons, nodes and partitions")


def run(args: argparse.Namespace, ctx: Context) -> int:
    def say(line: str) -> None:
        ctx.out(f"[cluster] {line}")

    if args.action == "up":
        was_up = cluster.up(say, preempt_send_user_signal=args.preempt_user_signal)
        st = cluster.status()
        ctx.out(("local SLURM cluster already running" if was_up else "local SLURM cluster is up") + f" ({st.state_dir})")
        _print_nodes(ctx, st)
        return 0
    if args.action == "down":
        stopped = cluster.down(say)
        ctx.out("stopped: " + ", ".join(stopped) if stopped else "nothing of the local cluster was running")
        return 0
    st = cluster.status()
    ctx.out(f"state directory: {st.state_dir}")
    for name, pid in st.daemons.items():
        ctx.out(f"  {name:<10} {'pid ' + str(pid) if pid else 'not running'}")
    if st.settings is not None:
        ctx.out(f"  preempt_send_user_signal: {'on' if st.settings.preempt_send_user_signal else 'off'}")
    workers = cluster.worker_layouts()
    if workers:  # the test suite's parallel workers' clusters (launcher/localcluster/workers.py)
        ctx.out("worker clusters: " + ", ".join(
            f"{w.root.name} {'up' if cluster.is_up(w) else 'down'}" for w in workers) + " (`cluster down` stops them)")
    if not st.controller:
        ctx.out("controller: not answering (start it with `lmlaunch cluster up`)")
        return 3
    _print_nodes(ctx, st)
    if st.problem:
        ctx.out(f"problem: {st.problem}")
        return 1
    return 0


def _print_nodes(ctx: Context, st) -> None:
    ctx.out("nodes:")
    for n in st.nodes:
        extra = f"  ({n.reason})" if n.reason and n.reason != "none" else ""
        ctx.out(f"  {n.name:<4} {n.state:<10} cpus={n.cpus:<3} partitions={','.join(n.partitions)}{extra}")
    ctx.out("partitions:")
    for p in st.partitions:
        ctx.out(
            f"  {p.name + ('*' if p.default else ''):<6} {p.available:<5} time_limit={p.time_limit:<10} "
            f"nodes={p.nodes}  alloc/idle/other/total={p.state_summary}"
        )
