"""`lmlaunch doctor SPEC`: what would go wrong after the queue, found before it, on the login node
in seconds and without an allocation.

Facts are gathered first (SLURM's configuration and partitions, accounting, the filesystems, the
data's metadata, the model's size, the run's own measured checkpoint times), then judged by pure
functions (``judge_*``), so every rule is tested on made-up facts and the whole on the local
cluster. Each check says ok / warn / fail with the figures it compared; any fail exits non-zero.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launcher.doctor.network_check import network_differences
from launcher.doctor.version_check import version_problems
from launcher.planning import runtime_stack
from launcher.spec.profile_draft import UNLIMITED_TIME, ClusterFacts, gpus_of, partitions as draft_partitions
from launcher.spec.profiles import Profile
from launcher.submit.in_place import asked_nodes
from launcher.submit.shape_check import waits_for_nodes
from lmcore import jsonlines
from lmcore.errors import UserError
from lmcore.job.plan import LaunchPlan
from lmcore.job.spec import parse_slurm_time
from lmcore.run import rundir
from lmcore.run.checkpoint_index import checkpoint_bytes
from lmcore.run.token_meta import read_index, tokenizer_identity
from lmcore.slurm import client as slurm

OK, WARN, FAIL = "ok", "warn", "fail"
ASSUMED_WRITE_BYTES_PER_S = 0.2e9  # when the run has no measured checkpoint yet (this machine kind: 0.19-0.23 GB/s)
RUNTIME_IMPORT_TIMEOUT_S = 180.0


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    message: str
    figures: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- pure judgements
def judge_space(where: str, path: str, free: int | None, writable: bool, error: str | None, need: int,
                what: str) -> Check:
    if error is not None or not writable:
        return Check(where, FAIL, f"{path}: cannot write there ({error or 'read-only'})", {"path": path})
    figures = {"path": path, "free_bytes": free, "needed_bytes": need}
    if free is not None and free < need:
        return Check(where, FAIL, f"{path}: {_gb(free)} free, {what} need {_gb(need)}", figures)
    return Check(where, OK, f"{path}: writable, {_gb(free)} free for {what} ({_gb(need)})", figures)


def judge_mixture(paths: list[str], metas: list[Any]) -> Check:  # one tokenizer (lmcore.run.token_meta) for all
    keys = [tokenizer_identity(m) for m in metas]
    bad = next((i for i, k in enumerate(keys) if k != keys[0]), None)
    if bad is not None:
        return Check("data mixture", FAIL, f"{paths[bad]} was tokenized with {keys[bad][:3]} (vocab_size, eos, "
                     f"tokenizer) but {paths[0]} with {keys[0][:3]}: the stores of a mixture must share one tokenizer")
    return Check("data mixture", OK, f"{len(paths)} stores, one tokenizer ({keys[0][2]}, vocab_size {keys[0][0]})")


def judge_data(path: str, meta: Mapping[str, Any] | None, error: str | None, model_vocab: int,
               tokens_needed: int) -> list[Check]:
    if meta is None:
        return [Check("data", FAIL, f"data.path {path}: {error}", {"path": path})]
    out = []
    vocab = int(meta.get("vocab_size", 0))
    if model_vocab and vocab > model_vocab:
        out.append(Check("data vocab", FAIL,
                         f"{path} was tokenized with vocab_size {vocab} but the model has vocab_size {model_vocab}: "
                         f"ids >= {model_vocab} would index past the embedding; use model.config.vocab_size={vocab} "
                         f"or data tokenized for this model", {"data_vocab": vocab, "model_vocab": model_vocab}))
    else:
        out.append(Check("data vocab", OK, f"data vocab_size {vocab} fits the model's {model_vocab}",
                         {"data_vocab": vocab, "model_vocab": model_vocab}))
    tokens = int(meta.get("num_tokens", 0))
    figures = {"tokens": tokens, "tokens_needed": tokens_needed}
    if tokens <= 0:
        out.append(Check("data size", FAIL, f"{path} holds no tokens", figures))
    elif tokens < tokens_needed:
        out.append(Check("data size", WARN, f"{path} holds {tokens:,} tokens; the run trains on {tokens_needed:,} "
                         f"(max_steps x global batch x seq_len): {tokens_needed / tokens:.1f} epochs", figures))
    else:
        out.append(Check("data size", OK, f"{path}: {tokens:,} tokens for {tokens_needed:,} trained "
                         f"({tokens_needed / tokens:.2f} epochs)", figures))
    return out


def judge_partition(plan: LaunchPlan, part: Mapping[str, str] | None) -> Check:
    name = plan.slurm.partition
    if part is None:
        return Check("partition", FAIL, f"partition '{name}' does not exist in this cluster (sinfo/scontrol)",
                     {"partition": name})
    problems = []
    if part.get("State", "UP") != "UP":
        problems.append(f"its State is {part.get('State')}")
    max_time = slurm.parse_duration(part.get("MaxTime"))
    if max_time is not None and plan.slurm.time_minutes * 60 > max_time:
        problems.append(f"resources.time {plan.slurm.time} is above its MaxTime {part.get('MaxTime')}")
    total = part.get("TotalNodes", "")
    if total.isdigit() and plan.slurm.nodes > int(total):
        problems.append(f"the job asks for {asked_nodes(plan)} and it has {total}")
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and plan.slurm.nodes > int(max_nodes):
        problems.append(f"the job asks for {plan.slurm.nodes} nodes and its MaxNodes is {max_nodes}")
    for what, mine, allowed in (("account", plan.slurm.account, part.get("AllowAccounts", "ALL")),
                                ("qos", plan.slurm.qos, part.get("AllowQos", "ALL"))):
        if mine and allowed != "ALL" and mine not in allowed.split(","):
            problems.append(f"{what} {mine} is not in its Allow{what.capitalize() if what == 'account' else 'Qos'}s={allowed}")
    figures = {"partition": name, "max_time": part.get("MaxTime"), "total_nodes": total, "state": part.get("State")}
    if problems:
        return Check("partition", FAIL, f"partition '{name}': " + "; ".join(problems), figures)
    return Check("partition", OK, f"partition '{name}' is UP; {plan.slurm.nodes} node(s) for {plan.slurm.time} fit "
                 f"(MaxTime {part.get('MaxTime')}, {total} nodes)", figures)


def judge_preemption(plan: LaunchPlan, profile: Profile, config: Mapping[str, str], part: Mapping[str, str] | None,
                     measured_s: float | None, estimated_s: float) -> list[Check]:
    """The cluster's preemption setup against the spec and the profile."""
    out: list[Check] = []
    name = plan.slurm.partition
    preemptible = profile.partitions[name].preemptible
    ptype = config.get("PreemptType", "preempt/none")
    mode = ((part or {}).get("PreemptMode") or config.get("PreemptMode") or "OFF").upper()
    params = config.get("SlurmctldParameters", "") or ""
    sends = "preempt_send_user_signal" in params
    figures = {"PreemptType": ptype, "PreemptMode": mode, "preempt_send_user_signal": sends,
               "GraceTime": (part or {}).get("GraceTime"), "JobRequeue": config.get("JobRequeue")}
    if preemptible and ptype.endswith("none"):
        out.append(Check("preemption", WARN, f"the profile marks partition '{name}' preemptible but the cluster has "
                         f"PreemptType={ptype}: nothing will preempt it", figures))
    elif "CANCEL" in mode and preemptible:
        out.append(Check("preemption", WARN, f"partition '{name}' has PreemptMode={mode}: SLURM cancels a preempted "
                         f"job instead of requeueing it; lmtrain requeues it itself (scontrol requeue from within "
                         f"the GraceTime, once its stop checkpoint is complete), so the stop checkpoint must finish "
                         f"within GraceTime (see the check below); a job killed before that is resumed with "
                         f"`lmlaunch submit SPEC --resume`", figures))
    elif "SUSPEND" in mode and preemptible:
        out.append(Check("preemption", WARN, f"partition '{name}' has PreemptMode={mode}: a preempted job is suspended "
                         f"(no signal, no checkpoint) and resumes in place later", figures))
    else:
        out.append(Check("preemption", OK, f"PreemptType={ptype}, PreemptMode={mode}", figures))
    if sends != profile.sends_user_signal_on_preemption:
        out.append(Check("preemption signal", WARN,
                         f"the cluster {'sends' if sends else 'does not send'} the user signal on preemption "
                         f"(SlurmctldParameters={params or '(null)'}) but profile '{profile.name}' says "
                         f"sends_user_signal_on_preemption: {str(profile.sends_user_signal_on_preemption).lower()}",
                         figures))
    grace_text = (part or {}).get("GraceTime")
    grace = float(grace_text) if grace_text and grace_text.isdigit() else None
    if preemptible and grace is not None:
        ckpt_s, how = (measured_s, "the run's own slowest stop checkpoint") if measured_s is not None else (
            estimated_s, f"estimated at {ASSUMED_WRITE_BYTES_PER_S / 1e9:.1f} GB/s")
        g = {"grace_seconds": grace, "checkpoint_seconds": round(ckpt_s, 1), "measured": measured_s is not None}
        if ckpt_s > grace:
            status = FAIL if measured_s is not None else WARN
            out.append(Check("grace time", status, f"GraceTime {grace:.0f} s but the checkpoint takes {ckpt_s:.0f} s "
                             f"({how}): you will lose work at preemption (raise GraceTime, or checkpoint less state)", g))
        elif plan.job_spec().checkpoint.async_save and 2 * ckpt_s > grace:
            # a stop first finishes a periodic save still being written in the background
            out.append(Check("grace time", WARN, f"GraceTime {grace:.0f} s covers the checkpoint's {ckpt_s:.1f} s ({how}) "
                             f"but not a preemption during a periodic background save, which the stop finishes "
                             f"before its own: up to {2 * ckpt_s:.0f} s (raise GraceTime, or checkpoint.async_save: "
                             f"false)", g))
        else:
            out.append(Check("grace time", OK, f"GraceTime {grace:.0f} s covers the checkpoint's {ckpt_s:.1f} s ({how})", g))
        if profile.partitions[name].grace_seconds not in (None, int(grace)):
            out.append(Check("grace time", WARN, f"profile '{profile.name}' says grace_seconds "
                             f"{profile.partitions[name].grace_seconds} for '{name}'; the cluster has {grace:.0f}", g))
    return out


def judge_profile(profile: Profile, facts: ClusterFacts) -> Check:
    """Where the profile disagrees with the live cluster: partitions it names that the cluster lacks,
    a max_time above MaxTime, preemptibility and GraceTime (derived as `profile init` derives them),
    the default partition, the GPUs per node."""
    live = {p.name: p for p in draft_partitions(facts)}
    differ: list[str] = []
    for name, mine in profile.partitions.items():
        theirs = live.get(name)
        if theirs is None:
            differ.append(f"partition '{name}' does not exist")
            continue
        if theirs.max_time != UNLIMITED_TIME and mine.max_minutes > parse_slurm_time(theirs.max_time):
            differ.append(f"'{name}' max_time {mine.max_time} is above its MaxTime {theirs.max_time}")
        if mine.preemptible != theirs.preemptible:
            differ.append(f"'{name}' preemptible: {str(mine.preemptible).lower()}, but the cluster "
                          f"{'can' if theirs.preemptible else 'cannot'} preempt it")
        elif mine.grace_seconds is not None and theirs.grace_seconds is not None and mine.grace_seconds != theirs.grace_seconds:
            differ.append(f"'{name}' grace_seconds {mine.grace_seconds}, GraceTime {theirs.grace_seconds}")
    default = next((p.name for p in live.values() if p.default), None)
    if default is not None and default != profile.default_partition:
        differ.append(f"default_partition {profile.default_partition}, the cluster's default is {default}")
    gpus = sorted({g[1] for g in (gpus_of(n.get("Gres", "")) for n in facts.nodes) if g is not None})
    if profile.gpus_per_node and gpus and profile.gpus_per_node > max(gpus):
        differ.append(f"gpus_per_node {profile.gpus_per_node}, the nodes have {', '.join(map(str, gpus))}")
    if profile.gpus_per_node and facts.nodes and not gpus:
        differ.append(f"gpus_per_node {profile.gpus_per_node}, but no node has a GPU Gres")
    differ += network_differences(profile, facts)
    figures = {"differences": differ}
    if differ:
        return Check("profile", WARN, f"profile '{profile.name}' disagrees with the live cluster: {'; '.join(differ)} "
                                      f"(`lmlaunch profile init NAME` reads one off the cluster)", figures)
    return Check("profile", OK, f"profile '{profile.name}' agrees with the live cluster (partitions, times, "
                                f"preemption, GPUs)", figures)


# --------------------------------------------------------------------------- facts (I/O)
def measured_checkpoint_seconds(run_dir: Path) -> float | None:
    """The slowest signal-to-complete-checkpoint time of the run's earlier attempts (the ledger),
    else its slowest periodic checkpoint (the heartbeat); None for a run that has none."""
    stops = [float(e["checkpoint_seconds"]) for e in jsonlines.read_jsonl(rundir.RunLayout.of(run_dir).ledger)
             if e.get("event") == "end" and isinstance(e.get("checkpoint_seconds"), (int, float))]
    if stops:
        return max(stops)
    saves = [float(b["seconds"]) for b in jsonlines.read_jsonl(rundir.RunLayout.of(run_dir).heartbeat)
             if b.get("event") == "checkpoint" and isinstance(b.get("seconds"), (int, float))]
    return max(saves) if saves else None


def probe_dir(path: Path) -> tuple[int | None, bool, str | None]:
    """(free bytes, writable, error) of ``path``, or of its nearest existing parent."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError as exc:
        return None, False, str(exc)
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".lmlaunch-doctor-"):
            pass
    except OSError as exc:
        return free, False, f"{exc.strerror or exc} ({p})"
    return free, True, None


def runtime_imports(plan: LaunchPlan) -> Check:
    """The tasks' interpreter, after the profile's setup lines, imports the runtime. Checked on
    this machine: the nodes must see the same filesystem (`doctor --on-nodes` would ask them)."""
    script = "\n".join([*plan.setup, f"{plan.python} -c 'import lmtrain.task.entry, torch, lightning, transformers'"])
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                              timeout=RUNTIME_IMPORT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Check("runtime", FAIL, f"`{plan.python}` did not import the runtime within {RUNTIME_IMPORT_TIMEOUT_S:.0f} s")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return Check("runtime", FAIL, f"`{plan.python}` after the profile's setup lines cannot import the runtime: {last}")
    return Check("runtime", OK, f"`{plan.python}` imports lmtrain, torch, lightning and transformers")


def diagnose(plan: LaunchPlan, profile: Profile, environ: Mapping[str, str] | None = None,
             job_script: str | None = None) -> list[Check]:
    """Every check on the login node; ``job_script``: the plan's job script as submit writes it,
    judged by the cluster (``sbatch --test-only``)."""
    if not slurm.ping():
        return [Check("slurm", FAIL, "the SLURM controller does not answer (`scontrol ping`); "
                      "local cluster: `lmlaunch cluster up`")]
    checks = [Check("slurm", OK, "the controller answers")]
    refused = slurm.accounting_answers()
    if refused is None:
        checks.append(Check("accounting", OK, "slurmdbd answers (sacct)"))
    else:
        checks.append(Check("accounting", FAIL, f"accounting does not answer: {refused} (lmlaunch reads "
                            f"requeues, node failures and history from sacct)"))
    config = slurm.config()
    try:
        part: dict[str, str] | None = slurm.partition_config(plan.slurm.partition)
    except UserError:
        part = None
    checks.append(judge_partition(plan, part))
    checks.append(judge_profile(profile, ClusterFacts(partitions=slurm.partition_configs(), nodes=slurm.node_configs(),
                                                      topology=slurm.topology_records(),
                                                      config=config)))
    versions = version_problems(profile, config)
    checks.append(Check("slurm version", WARN if versions else OK, "; ".join(versions) or
                        f"SLURM {config.get('SLURM_VERSION')}, a release lmlaunch is tested on"))
    checks += _association_checks(plan)
    if job_script is not None:
        checks += job_script_checks(plan, job_script)
    lacking = runtime_stack.missing()
    if lacking is not None:  # a CLI-only install: the model is checked where the training stack is
        checks.append(Check("model", WARN, f"not built here: {lacking} is not installed in this environment "
                                           f"({runtime_stack.INSTALL}); run doctor where the jobs run"))
        return checks
    return checks + _model_checks(plan, profile, config, part)


def _model_checks(plan: LaunchPlan, profile: Profile, config: Mapping[str, str],
                  part: Mapping[str, str] | None) -> list[Check]:
    """What needs the model's size (torch and transformers: this command only): the preemption's
    grace against the checkpoint, the room for checkpoints, the data, the memory, the runtime."""
    from lmtrain.model.causal_lm import parameter_count

    job = plan.job_spec()
    try:
        params, model_vocab = parameter_count(plan.spec["model"])
    except ValueError as exc:  # a model the spec describes but transformers cannot build as meant
        return [Check("model", FAIL, str(exc))]
    ck_bytes = checkpoint_bytes(params, plan.parallelism, plan.trainer.precision)
    run_dir = Path(plan.paths.run_dir)
    measured = measured_checkpoint_seconds(run_dir) if run_dir.is_dir() else None
    checks = judge_preemption(plan, profile, config, part, measured, ck_bytes / ASSUMED_WRITE_BYTES_PER_S)
    keep = job.checkpoint.keep_last + 1  # the kept ones and the one being written
    free, ok, err = probe_dir(Path(plan.paths.checkpoint_dir))
    checks.append(judge_space("checkpoint space", plan.paths.checkpoint_dir, free, ok, err, keep * ck_bytes,
                              f"{keep} checkpoints of {params / 1e6:,.1f}M parameters ({plan.parallelism.describe()}, "
                              f"AdamW: {_gb(ck_bytes)} each, estimated)"))
    if not Path(plan.paths.checkpoint_dir).resolve().is_relative_to(run_dir.parent.resolve()):
        free, ok, err = probe_dir(run_dir)
        checks.append(judge_space("runs root", str(run_dir.parent), free, ok, err, 50 * 2**20, "logs and metrics"))
    tokens_needed = plan.trainer.max_steps * plan.topology.global_batch_size * job.data.seq_len
    stores, metas = job.data.stores, []
    for store in stores:  # each store trains on its weight's share of the run's tokens
        meta, err = read_index(store.path)
        metas.append(meta)
        share = store.weight / sum(s.weight for s in stores)
        checks += judge_data(store.path, meta, err, model_vocab, round(tokens_needed * share))
    if len(stores) > 1 and all(metas):
        checks.append(judge_mixture([s.path for s in stores], metas))
    checks.append(judge_memory(plan, profile))
    if not plan.container:  # a container's interpreter: launcher.doctor.container
        checks.append(runtime_imports(plan))
    return checks


def judge_memory(plan: LaunchPlan, profile: Profile) -> Check:
    """The plan's per-rank peak (launcher.planning.memory) against the profile's gpu_memory."""
    from launcher.planning.memory import gb

    m = plan.memory
    if not m:
        why = next((n for n in plan.notes if n.startswith("memory not estimated")), "memory not estimated")
        return Check("memory", WARN, why)
    if m.get("fits") is None:
        what = "not a GPU job" if plan.topology.accelerator != "gpu" else f"profile '{profile.name}' has no gpu_memory"
        return Check("memory", OK, f"planned peak {gb(m['peak'])} per rank ({what}: not checked against a limit)", m)
    if m["fits"]:
        return Check("memory", OK, f"planned peak {gb(m['peak'])} per rank of {gb(m['usable'])} usable "
                                   f"({profile.gpu_memory} GPUs)", m)
    return Check("memory", FAIL, f"planned peak {gb(m['peak'])} per rank exceeds {gb(m['usable'])} usable of the "
                                 f"{profile.gpu_memory} GPUs: `lmlaunch validate SPEC` lists the changes that fit", m)


def job_script_checks(plan: LaunchPlan, job_script: str) -> list[Check]:
    """The cluster judges the exact job script (``sbatch --test-only``, site options included; nodes
    out of service a warning), and site srun options (``srun --test-only``) where there are some."""
    site = ", ".join(f"--{k}" for k in sorted(plan.slurm.site_options))
    ok, message = slurm.test_only("sbatch", [], script=job_script)
    what, hint = f" (with the site options {site})" if site else "", ""
    if not ok and plan.slurm.exclude:
        hint = (f"; the plan excludes {plan.slurm.exclude} (lmlaunch's record of bad nodes for this profile, see the "
                f"dry run's notes): a passing `lmlaunch doctor SPEC --on-nodes` clears a node that is well again")
    facts = {"accepted": ok, "site_options": dict(plan.slurm.site_options), "exclude": plan.slurm.exclude}
    waiting = None if ok else waits_for_nodes(plan.slurm, message)
    said = f"the cluster would queue the job script{what} to wait" if waiting else \
        f"{'the cluster accepts' if ok else 'the cluster refuses'} the job script{what}"
    out = [Check("job script", WARN if waiting else OK if ok else FAIL,  # nodes out of service: it would wait
                 f"{said} (sbatch --test-only): {message}{f': {waiting}' if waiting else hint}", facts)]
    own = [a for a in plan.srun_args if not a.startswith("--container-")]
    if own:
        s = plan.slurm
        ok, message = slurm.test_only("srun", [f"--partition={s.partition}", f"--nodes={s.nodes}",
                                               f"--ntasks-per-node={s.ntasks_per_node}", *own, "true"])
        out.append(Check("srun options", OK if ok else FAIL,
                         f"{'the cluster accepts' if ok else 'the cluster refuses'} the tasks' srun options "
                         f"{' '.join(own)} (srun --test-only): {message}", {"accepted": ok, "srun_args": own}))
    return out


def _association_checks(plan: LaunchPlan) -> list[Check]:
    out = []
    user = slurm.user_name()
    if plan.slurm.account:
        rows = slurm.sacctmgr(["-n", "-P", "show", "assoc", f"user={user}", f"account={plan.slurm.account}",
                               "format=Account"])
        out.append(Check("account", OK if rows.strip() else FAIL,
                         f"account {plan.slurm.account} " + ("has an association for " if rows.strip() else
                                                             "has no association for ") + f"user {user}"))
    if plan.slurm.qos:
        rows = slurm.sacctmgr(["-n", "-P", "show", "qos", f"name={plan.slurm.qos}", "format=Name"])
        out.append(Check("qos", OK if rows.strip() else FAIL,
                         f"QOS {plan.slurm.qos} " + ("exists" if rows.strip() else "does not exist in this cluster")))
    return out


def to_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
