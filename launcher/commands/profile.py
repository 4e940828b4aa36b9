"""lmlaunch profile init NAME [-o FILE] [--force]: a cluster profile read off the live cluster
(launcher.spec.profile_draft), written to ``$LMLAUNCH_HOME/profiles/NAME.yaml`` (found by
`--cluster NAME` and a spec's ``cluster: NAME``) or to FILE. The profile is validated before it is
written; an existing file is kept unless --force."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from launcher.commands import profile_run
from launcher.context import Context
from launcher.runs.home import user_profiles_dir
from launcher.spec.profile_draft import ClusterFacts, draft
from launcher.spec.profiles import REPO_PROFILES, load_profile_file
from lmcore.atomic import write_private
from lmcore.errors import SpecError, UserError
from lmcore.slurm import client as slurm, way as slurm_way
from lmcore.text_rules import PROFILE_NAME


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="write a cluster profile read off the live cluster (sinfo, scontrol, sacctmgr)")
    init.add_argument("name", help="the profile's name (a spec's cluster: NAME)")
    init.add_argument("-o", "--output", help="write it here instead of $LMLAUNCH_HOME/profiles/NAME.yaml")
    init.add_argument("--force", action="store_true", help="replace an existing profile file")
    steps = sub.add_parser("run", help="torch.profiler over a running job's next steps, per rank (also "
                                       "`lmlaunch profile RUN`)")
    profile_run.add_arguments(steps)


def read_facts(environ: dict[str, str] | None) -> ClusterFacts:
    """What the live cluster says, through the one SLURM client."""
    problems: list[str] = []
    if not slurm.ping():
        raise UserError("the SLURM controller does not answer (`scontrol ping`): `profile init` reads the live "
                        "cluster (local cluster: `lmlaunch cluster up`)")
    config = slurm.config()
    refused = slurm.accounting_answers()
    accounting = refused is None
    if refused is not None:
        problems.append(f"accounting does not answer ({refused.splitlines()[0][:160]})")
    account = None
    if accounting:
        user = slurm.user_name()
        try:
            rows = slurm.sacctmgr(["-n", "-P", "show", "user", user, "format=DefaultAccount"]).split()
            account = rows[0] if rows and rows[0] else None
        except UserError as exc:
            problems.append(f"sacctmgr did not say your default account ({exc.message.splitlines()[0][:160]})")
    conf, commands = client_side(environ) if slurm_way.way().reads_this_machines_config else (None, None)
    return ClusterFacts(partitions=slurm.partition_configs(), nodes=slurm.node_configs(), config=config,
                        default_account=account, accounting=accounting, problems=problems,
                        slurm_conf=conf, slurm_bin=commands, nvidia_here=_nvidia_here(),
                        topology=slurm.topology_records() if config.get("TopologyPlugin", "topology/none") != "topology/none" else ())


def _nvidia_here() -> bool:
    """Whether this machine has an NVIDIA driver with GPUs (the kernel module's list of them)."""
    from pathlib import Path

    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


SYSTEM_BIN = ("/usr/bin", "/bin", "/usr/local/bin", "/usr/sbin", "/sbin")


def client_side(environ: dict[str, str] | None) -> tuple[str | None, str | None]:
    """The SLURM_CONF and the non-system directory of sbatch this shell reaches the cluster with."""
    import os
    import shutil

    env = os.environ if environ is None else environ
    conf = env.get("SLURM_CONF") or None
    sbatch = shutil.which("sbatch", path=env.get("PATH"))
    where = os.path.dirname(sbatch) if sbatch else None
    return (os.path.abspath(conf) if conf else None), (where if where and where not in SYSTEM_BIN else None)


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.action == "run":
        return profile_run.run(args, ctx)
    try:
        PROFILE_NAME.check(args.name)
    except ValueError as exc:
        raise UserError(f"profile init: {exc}") from None
    target = Path(args.output) if args.output else user_profiles_dir(ctx.environ or None) / f"{args.name}.yaml"
    if target.suffix != ".yaml" or target.stem != args.name:
        raise UserError(f"profile init: the file must be named {args.name}.yaml (a profile's name is its file's stem), "
                        f"not {target.name}")
    if target.exists() and not args.force:
        raise UserError(f"{target} exists: lmlaunch keeps it. Replace it with --force, or choose another name")
    text = draft(args.name, read_facts(ctx.environ or None), when=time.strftime("%Y-%m-%d"))
    with tempfile.TemporaryDirectory() as tmp:  # what is written must load as a profile
        check = Path(tmp) / target.name
        check.write_text(text)
        try:
            load_profile_file(check)
        except SpecError as exc:
            raise UserError(f"profile init: the profile read off this cluster does not validate (a bug worth "
                            f"reporting, with this text):\n{exc}\n---\n{text}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    write_private(target, text)
    ctx.out(text.rstrip("\n"))
    shadow = " (it shadows the shipped profile of that name)" if (REPO_PROFILES / target.name).exists() and not args.output else ""
    ctx.out(f"\nwrote {target}{shadow}\n  set the CHOOSE lines, then: lmlaunch doctor SPEC --cluster {args.name}\n"
            f"  submit with it: lmlaunch submit SPEC --cluster {args.name} (or cluster: {args.name} in the spec)")
    return 0
