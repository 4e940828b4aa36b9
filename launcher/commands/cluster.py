"""lmlaunch cluster up [--slurm VERSION] [--preempt-user-signal | --no-preempt-user-signal]
[--accounting | --no-accounting] [--min-job-age S] [--nodes N] [--topology KIND:GxN] [--gpus [TYPE:]N] [--workers N]
[--s3] | down | status | env"""

from __future__ import annotations

import argparse
import shlex

from launcher.context import Context
from launcher.localcluster import cluster, workers
from launcher.localcluster.config import (
    MAX_NODES,
    MAX_WORKER_SLOTS,
    MIN_JOB_AGE_FLOOR,
    SLURM_RELEASES,
    Layout,
    is_native,
    native_version,
    primary_root,
)
from lmcore.errors import UserError


def _version_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slurm", metavar="VERSION", choices=sorted(SLURM_RELEASES), default=None,
                   help="which SLURM: this machine's own (the default) or the other Debian release's, run "
                        f"from a Debian root made by debootstrap ({', '.join(f'{v}: {r}' for v, r in SLURM_RELEASES.items())})")


def _min_job_age(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value < MIN_JOB_AGE_FLOOR:
        raise argparse.ArgumentTypeError(f"at least {MIN_JOB_AGE_FLOOR} seconds (SLURM's recommended minimum), not {value}")
    return value


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
    acct = up.add_mutually_exclusive_group()
    acct.add_argument("--accounting", dest="accounting", action="store_true", default=None,
                      help="slurmdbd on MariaDB: sacct and sacctmgr work (the default)")
    acct.add_argument("--no-accounting", dest="accounting", action="store_false",
                      help="no slurmdbd, as on sites without accounting: sacct fails, squeue is all there is")
    up.add_argument("--min-job-age", type=_min_job_age, default=None, metavar="SECONDS",
                    help=f"how long finished jobs stay in squeue (MinJobAge; default 300, at least {MIN_JOB_AGE_FLOOR})")
    up.add_argument("--nodes", type=int, default=None, metavar="N",
                    help=f"virtual nodes n1..nN (1 to {MAX_NODES}; default: what the last `up` had, else 2), e.g. "
                         "3 for a job with a spare node")
    up.add_argument("--topology", default=None, metavar="KIND:GxN",
                    help="the network SLURM is told of: tree:2x2 (2 leaf switches of 2 nodes, topology/tree), block:2x2 "
                         "(2 blocks of 2 nodes, topology/block, SLURM 24.11), KIND:N (--nodes cut into groups of N) "
                         "or none; default: what the last `up` had. Sets --nodes when it is not given")
    up.add_argument("--gpus", default=None, metavar="[TYPE:]N",
                    help="N GPUs on every node that SLURM schedules for real (GRES; fake devices: jobs train on CPU "
                         "behind SLURM's binding), e.g. 4 or a100:4 (type h100 when not given), or none; default: what "
                         "the last `up` had, else none")
    up.add_argument("--workers", type=int, default=0, metavar="N",
                    help="also start the worker clusters 1..N that parallel test workers claim "
                         "(launcher/localcluster/workers.py); scripts/test.sh starts them before pytest")
    up.add_argument("--s3", action="store_true",
                    help="also start the local object store: Ceph's RADOS Gateway, a real S3 server on "
                         "127.0.0.1:7480 with a user and the bucket 'lmlaunch' (keys in STATE/s3/credentials.json, "
                         "mode 600; installs Ceph's packages as root when missing); `cluster down` stops it")
    _version_arg(up)
    _version_arg(sub.add_parser("down", help="stop the daemons that `up` started (and the test workers' clusters)"))
    _version_arg(sub.add_parser("status", help="daemons, nodes and partitions"))
    sub.add_parser("image", help="install podman (as root) and build the task image that container jobs on the local "
                                 "cluster run in (offline: debootstrap, then podman import)")
    _version_arg(sub.add_parser(
        "env", help="the shell lines that point SLURM commands (and lmlaunch) at one of the local clusters: "
                    "eval \"$(lmlaunch cluster env --slurm 24.11)\""))


def run(args: argparse.Namespace, ctx: Context) -> int:
    def say(line: str) -> None:
        ctx.out(f"[cluster] {line}")

    if args.action == "image":
        from launcher.localcluster.image import ensure_image

        ctx.out(f"task image ready: {ensure_image(say)} (container: {{runtime: podman, image: ..., python: auto}})")
        return 0
    version = args.slurm
    if version is not None and is_native(version):
        version = None
    layout = Layout.default() if version is None else Layout(primary_root(version))
    if args.action == "env":
        if not layout.slurm_conf.exists():
            raise UserError(f"no local SLURM {args.slurm or native_version() or ''} cluster here yet: "
                            f"`lmlaunch cluster up{' --slurm ' + args.slurm if args.slurm else ''}` starts it", exit_code=1)
        for key, value in cluster.environ_of(layout).items():
            ctx.out(f"export {key}={shlex.quote(value)}")
        return 0
    if args.action == "up":
        if args.nodes is not None and not 1 <= args.nodes <= MAX_NODES:
            raise UserError(f"--nodes {args.nodes}: the local cluster runs 1 to {MAX_NODES} virtual nodes")
        was_up = cluster.up(say, preempt_send_user_signal=args.preempt_user_signal, accounting=args.accounting,
                            min_job_age=args.min_job_age, version=version, nodes=args.nodes, topology=args.topology,
                            gpus=args.gpus)
        _up_workers(min(args.workers, MAX_WORKER_SLOTS), version, say)
        if args.s3:
            from launcher.localcluster import object_store

            object_store.up(say)
        st = cluster.status(layout)
        ctx.out(("local SLURM cluster already running" if was_up else "local SLURM cluster is up") + f" ({st.state_dir})")
        _print_nodes(ctx, st)
        return 0
    if args.action == "down":
        stopped = cluster.down(say, version=version)
        if version is None:  # the machine's own cluster's down: its object store too (one a machine)
            from launcher.localcluster import object_store

            object_store.down(lambda line: stopped.append(line.removeprefix("stopped ")))
        ctx.out("stopped: " + ", ".join(stopped) if stopped else "nothing of the local cluster was running")
        return 0
    return _status(ctx, layout, version)


def _status(ctx: Context, layout: Layout, version: str | None) -> int:
    """`cluster status`: the daemons, the object store, the worker clusters, the nodes; its exit code."""
    st = cluster.status(layout)
    ctx.out(f"state directory: {st.state_dir}")
    for name, pid in st.daemons.items():
        ctx.out(f"  {name:<10} {'pid ' + str(pid) if pid else 'not running'}")
    if st.settings is not None:
        ctx.out(f"  preempt_send_user_signal: {'on' if st.settings.preempt_send_user_signal else 'off'}")
        ctx.out(f"  accounting: {'slurmdbd' if st.settings.accounting else 'off'}, MinJobAge {st.settings.min_job_age} s")
        ctx.out(f"  topology: {st.settings.topology or 'none'}")
        ctx.out(f"  GPUs a node: {st.settings.gpus or 'none'}")
    _print_object_store(ctx)
    worker_layouts = cluster.worker_layouts(version)
    if worker_layouts:  # the test suite's parallel workers' clusters (launcher/localcluster/workers.py)
        ctx.out("worker clusters: " + ", ".join(
            f"{w.root.name} {'up' if cluster.is_up(w) else 'down'}" for w in worker_layouts) + " (`cluster down` stops them)")
    if not st.controller:
        ctx.out("controller: not answering (start it with `lmlaunch cluster up`)")
        return 3
    _print_nodes(ctx, st)
    if st.problem:
        ctx.out(f"problem: {st.problem}")
        return 1
    return 0


def _print_object_store(ctx: Context) -> None:
    """A line for the object store, once `up --s3` made it."""
    from launcher.localcluster import object_store

    st = object_store.status()
    if not st.made:
        return
    ctx.out(f"  object store: {'S3 answering at ' + object_store.endpoint() if st.answers else 'not answering'} "
            f"({sum(st.running.values())} of {len(st.running)} daemons running; keys in {st.credentials}; "
            "`cluster up --s3` starts it)")


def _print_nodes(ctx: Context, st) -> None:
    ctx.out("nodes:")
    for n in st.nodes:
        extra = f"  ({n.reason})" if n.reason and n.reason != "none" else ""
        gres = f" gres={n.gres}" if n.gres and n.gres != "(null)" else ""
        ctx.out(f"  {n.name:<4} {n.state:<10} cpus={n.cpus:<3} partitions={','.join(n.partitions)}{gres}{extra}")
    ctx.out("partitions:")
    for p in st.partitions:
        ctx.out(
            f"  {p.name + ('*' if p.default else ''):<6} {p.available:<5} time_limit={p.time_limit:<10} "
            f"nodes={p.nodes}  alloc/idle/other/total={p.state_summary}"
        )


def _up_workers(count: int, version: str | None, say) -> None:
    """The worker clusters 1..count that parallel test workers claim, each started while its claim is
    held here; one a running session holds is its own (its nodes, GPUs) and left as it is."""
    for k in range(1, count + 1):
        held = workers.claim_slot(k, version)
        if held is None:
            say(f"w{k}: claimed by a running session: left as it is")
            continue
        try:
            cluster.up(cluster.tagged(say, held.layout.root.name), layout=held.layout, ports=held.ports,
                       system_conf=False, accounting=True, min_job_age=300, version=version)
        finally:
            held.release()
