"""A cluster profile read off a live cluster (`lmlaunch profile init`): what SLURM knows, written
as a commented YAML profile. Pure: the facts (``scontrol show partition/node/config``, the user's
default account) come in as the parsed key -> value records ``lmcore.slurm.client`` returns.

What SLURM knows is filled in, each with where it came from: the partitions with their MaxTime,
the default one (Default=YES), which are preemptible (a lower PriorityTier under
preempt/partition_prio, or PreemptMode not OFF under preempt/qos) with their GraceTime, the
preemptible and the high-priority partitions, the GPUs per node and their GRES name, CPUs and
memory per GPU, whether the user signal is sent on preemption (SlurmctldParameters), the default
account. What only the user knows is written as a choice with the reason (runs_root, setup lines,
the interpreter, the fabric's NCCL variables), and what the cluster lacks (accounting, a short
MinJobAge) is said in a comment.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lmcore.job.spec import format_minutes, parse_slurm_time
from lmcore.slurm import versions

UNLIMITED_TIME = "365-00:00:00"  # what a profile writes for MaxTime=UNLIMITED (max_time must be a time)


@dataclass(frozen=True)
class ClusterFacts:
    """What `profile init` read: scontrol's records, as key -> value."""

    partitions: Sequence[Mapping[str, str]]
    nodes: Sequence[Mapping[str, str]]
    config: Mapping[str, str]
    default_account: str | None = None
    accounting: bool = True  # sacct answers
    topology: Sequence[Mapping[str, str]] = ()  # scontrol show topology: switches or blocks
    problems: list[str] = field(default_factory=list)  # what could not be read, for the header
    slurm_conf: str | None = None  # the SLURM_CONF `profile init` ran with (this machine's way to the cluster)
    slurm_bin: str | None = None  # where its sbatch was, when not a system directory
    nvidia_here: bool = False  # this machine has an NVIDIA driver with GPUs (/proc/driver/nvidia/gpus)


@dataclass(frozen=True)
class PartitionDraft:
    name: str
    max_time: str
    why_time: str
    preemptible: bool
    grace_seconds: int | None
    tier: int
    default: bool
    up: bool
    nodes: str
    size: int | None = None  # the nodes a job may have here: TotalNodes, or MaxNodes when lower


def _int(value: str | None, default: int = 0) -> int:
    m = re.match(r"\d+", value or "")
    return int(m.group()) if m else default


def _max_time(raw: str) -> tuple[str, str]:
    if raw in ("UNLIMITED", "INFINITE", ""):
        return UNLIMITED_TIME, f"MaxTime={raw or 'unset'}: no limit; written as a year"
    try:
        return format_minutes(parse_slurm_time(raw)), f"MaxTime={raw}"
    except ValueError:
        return UNLIMITED_TIME, f"MaxTime={raw} is not a time lmlaunch reads; written as a year"


def partitions(facts: ClusterFacts) -> list[PartitionDraft]:
    """Every partition, with preemptibility derived from the cluster's preemption settings."""
    ptype = facts.config.get("PreemptType", "preempt/none")
    cluster_mode = facts.config.get("PreemptMode", "OFF").upper()
    tiers = [_int(p.get("PriorityTier"), 1) for p in facts.partitions]
    out = []
    for p, tier in zip(facts.partitions, tiers):
        mode = p.get("PreemptMode", cluster_mode).upper()
        if ptype == "preempt/partition_prio":
            preemptible = not mode.startswith("OFF") and any(t > tier for t in tiers)
        elif ptype == "preempt/qos":
            preemptible = not mode.startswith("OFF") and not cluster_mode.startswith("OFF")
        else:
            preemptible = False
        max_time, why = _max_time(p.get("MaxTime", ""))
        grace = _int(p.get("GraceTime"), 0) if preemptible else None
        out.append(PartitionDraft(
            name=p.get("PartitionName", "?"), max_time=max_time, why_time=why, preemptible=preemptible,
            grace_seconds=grace, tier=tier, default=p.get("Default") == "YES", up=p.get("State") == "UP",
            nodes=p.get("Nodes", ""), size=_size(p),
        ))
    return out


def _size(p: Mapping[str, str]) -> int | None:
    """TotalNodes, or MaxNodes (a per-job limit) when lower; None when SLURM did not say."""
    total = _int(p.get("TotalNodes"), 0)
    limit = _int(p.get("MaxNodes"), 0)  # UNLIMITED reads as 0
    sizes = [n for n in (total, limit) if n > 0]
    return min(sizes) if sizes else None


def gpus_of(gres: str) -> tuple[str, int] | None:
    """('gpu' or 'gpu:TYPE', count) from a node's Gres (``gpu:h100:8(S:0-1),shard:8``)."""
    for item in gres.split(","):
        m = re.fullmatch(r"(gpu)(?::([A-Za-z0-9_.-]+))?:(\d+)(?:\(.*\))?", item.strip())
        if m:
            name = m.group(1) + (f":{m.group(2)}" if m.group(2) else "")
            return name, int(m.group(3))
    return None


def _mem(mb: int) -> str:
    return f"{mb // 1024}G" if mb >= 1024 and mb % 1024 == 0 else f"{mb}M"


def draft(name: str, facts: ClusterFacts, *, when: str) -> str:
    """The profile's YAML text, commented."""
    parts = partitions(facts)
    if not parts:
        raise ValueError("the cluster has no partition (scontrol show partition printed none)")
    usable = [p for p in parts if p.up] or parts
    default = next((p for p in usable if p.default), usable[0])
    cfg = facts.config
    version = cfg.get("SLURM_VERSION", "?")
    cluster = cfg.get("ClusterName", "?")
    node_names = set(_expand_simple(default.nodes))
    nodes = [n for n in facts.nodes if n.get("NodeName") in node_names] or list(facts.nodes)
    y: list[str] = [
        f"# Cluster profile '{name}', read off the live cluster by `lmlaunch profile init` on {when}:",
        f"# SLURM {version}, cluster '{cluster}'. Each value says where it came from;",
        "# the lines marked CHOOSE are yours to set (SLURM cannot know them). Check it: lmlaunch doctor SPEC",
        *(f"# NOTE: {p}" for p in facts.problems),
        "description: " + _quote(f"Read off cluster {cluster} (SLURM {version}) on {when}"),
        (f"slurm_version: {_quote(version)}  # scontrol show config: SLURM_VERSION (doctor says when it changes)"
         if versions.release(version) else "# slurm_version: not read (scontrol show config gave no SLURM_VERSION)"),
        *(f"# NOTE: {note}" for note in [versions.untested_note(version)] if note),
        *_partition_lines(parts, usable, default, cfg),
    ]
    if facts.default_account:
        y.append(f"account: {facts.default_account}  # your DefaultAccount (sacctmgr show user)")
    else:
        y.append("# account: CHOOSE  # no DefaultAccount was found" + ("" if facts.accounting else " (no accounting)"))
    loopback = bool(nodes) and all(n.get("NodeAddr", "").startswith("127.") for n in nodes)
    y += _node_lines(nodes, default.name)
    y += _simulated_lines(nodes, loopback, facts.nvidia_here)
    y += _choices_and_environment(cfg, loopback)
    y += network_lines(cfg.get("TopologyPlugin", ""), facts.topology)
    y += _client_lines(facts)
    if not facts.accounting:
        y.append("# Accounting: sacct does not answer here. lmlaunch reads states from squeue and the run directory; "
                 "what only sacct knows (a finished job's exit state) is reported as unknown.")
    min_age = _int(cfg.get("MinJobAge"), -1)
    if 0 <= min_age < 60:
        y.append(f"# MinJobAge={cfg.get('MinJobAge')}: finished jobs leave squeue within a minute.")
    return "\n".join(y) + "\n"


def _client_lines(facts: ClusterFacts) -> list[str]:
    """How this machine reached the cluster when `profile init` read it: its SLURM_CONF and its
    commands' directory, so that a run with this profile asks this cluster whatever the shell then
    points at (one login machine, several clusters)."""
    if not (facts.slurm_conf or facts.slurm_bin):
        return []
    y = ["submit:  # this machine's way to this cluster (the shell `profile init` ran in)"]
    if facts.slurm_conf:
        y.append(f"  slurm_conf: {_quote(facts.slurm_conf)}  # $SLURM_CONF")
    if facts.slurm_bin:
        y.append(f"  slurm_bin: {_quote(facts.slurm_bin)}  # where sbatch was found (not a system directory)")
    return y


def _partition_lines(parts: list[PartitionDraft], usable: list[PartitionDraft], default: PartitionDraft,
                     cfg: Mapping[str, str]) -> list[str]:
    """The partitions, the default one, and the preemptible and high-priority pair a preemption
    rehearsal uses (the lowest preemptible tier, the highest tier above it)."""
    preemptible = [p for p in usable if p.preemptible]
    low = min(preemptible, key=lambda p: (p.tier, not p.default), default=None)
    high = max(usable, key=lambda p: p.tier) if low is not None else None
    if high is not None and low is not None and high.tier <= low.tier:
        high = None
    y = ["partitions:"]
    for p in parts:
        fields = [f"max_time: {_quote(p.max_time)}"] + ([f"nodes: {p.size}"] if p.size else [])
        if p.preemptible:
            fields.append("preemptible: true")
            fields.append(f"grace_seconds: {p.grace_seconds}")
        state = "" if p.up else ", DOWN or INACTIVE now"
        y.append(f"  {p.name}: {{{', '.join(fields)}}}  # {p.why_time}, PriorityTier={p.tier}, nodes {p.nodes}{state}")
    y.append(f"default_partition: {default.name}  # {'Default=YES' if default.default else 'no partition has Default=YES: the first one'}")
    if low is not None:
        y.append(f"preemptible_partition: {low.name}  # the lowest PriorityTier ({low.tier}) that can be preempted")
    else:
        y.append(f"# no preemptible partition: PreemptType={cfg.get('PreemptType', '?')}, PreemptMode={cfg.get('PreemptMode', '?')}")
    if high is not None:
        y.append(f"high_priority_partition: {high.name}  # the highest PriorityTier ({high.tier})")
    return y


def _node_lines(nodes: list[Mapping[str, str]], partition: str) -> list[str]:
    """GPUs, CPUs and memory per task, from the default partition's nodes (the smallest of them)."""
    gpu_counts = Counter(g for g in (gpus_of(n.get("Gres", "")) for n in nodes) if g is not None)
    cpus = min((_int(n.get("CPUTot")) for n in nodes), default=0) or 1
    mem_mb = min((_int(n.get("RealMemory")) for n in nodes), default=0)
    node_mem = [f"mem_per_node: {_mem(mem_mb)}  # the smallest RealMemory of the nodes of '{partition}'"] if mem_mb else []
    if not gpu_counts:
        return [f"gpus_per_node: 0  # no GPU Gres on the nodes of '{partition}'",
                "cpus_per_gpu: 1  # CPU tasks get one core each; raise it for threaded data loading",
                f"max_tasks_per_node: {cpus}  # the smallest CPUTot of the nodes of '{partition}'", *node_mem]
    (gres, gpus), seen = gpu_counts.most_common(1)[0]
    y = [f"gpus_per_node: {gpus}  # Gres of {seen} of the {len(nodes)} nodes of '{partition}'",
         f"gres_name: {_quote(gres)}",
         f"cpus_per_gpu: {max(1, cpus // gpus)}  # CPUTot {cpus} / {gpus} GPUs"]
    if mem_mb:
        y += [f"mem_per_gpu: {_mem(mem_mb // gpus)}  # RealMemory {mem_mb} MB / {gpus} GPUs", *node_mem]
    y.append(f"max_tasks_per_node: {gpus}  # one task per GPU")
    kind = gres.partition(":")[2]
    memory = gpu_memory_of(kind)
    if memory:
        y.append(f"gpu_memory: {memory}  # one {kind}'s memory (the GPU type in Gres): validate refuses a job whose "
                 "planned peak does not fit")
    else:
        y.append(f"# gpu_memory: 80G  # CHOOSE: one GPU's memory ({'type ' + kind + ' is not one lmlaunch knows; ' if kind else 'the Gres names no type; '}"
                 "nvidia-smi --query-gpu=memory.total --format=csv on a node): set, validate refuses a job whose "
                 "planned peak does not fit")
    return y


# One GPU's memory by the type a site's gres.conf gives it (lower case; a size in the name wins:
# a100_80g, a100-40gb). Types sold in one size only; the others need the size in their name.
GPU_MEMORY = {"h100": "80G", "h200": "141G", "gh200": "96G", "b200": "180G", "gb200": "186G", "l40s": "48G",
              "l40": "48G", "l4": "24G", "a10": "24G", "a30": "24G", "mi300x": "192G", "mi250x": "128G", "mi250": "128G"}


def gpu_memory_of(kind: str) -> str | None:
    """A GPU type's memory (``a100_80g``: 80G; ``h100``: 80G), None when the type does not tell."""
    name = kind.lower()
    sized = re.search(r"(\d+)\s*g(?:b)?$", name)
    if sized and int(sized.group(1)) >= 8:
        return f"{int(sized.group(1))}G"
    return GPU_MEMORY.get(name)


def _simulated_lines(nodes: list[Mapping[str, str]], loopback: bool, nvidia_here: bool) -> list[str]:
    """A cluster whose nodes are this machine (NodeAddr on loopback), which has no NVIDIA GPU, has
    simulated GPUs (`lmlaunch cluster up --gpus`): its jobs train on CPU behind SLURM's binding."""
    if not loopback or nvidia_here or not any(gpus_of(n.get("Gres", "")) for n in nodes):
        return []
    return ["gpus_simulated: true  # the nodes are this machine (NodeAddr 127.*), which has no NVIDIA GPU: SLURM "
            "schedules and binds the GPUs in Gres, the ranks train on CPU"]


def _choices_and_environment(cfg: Mapping[str, str], loopback: bool) -> list[str]:
    """What SLURM cannot know (runs root, interpreter, setup), the preemption signal setting, and
    the environment the nodes' addresses call for."""
    sends_signal = "preempt_send_user_signal" in cfg.get("SlurmctldParameters", "")
    y = [
        "# CHOOSE: a directory every node sees (a shared filesystem), ~ and $VARS expanded",
        "runs_root: ~/.lmlaunch/runs",
        "# CHOOSE: the tasks' interpreter. auto: the one running lmlaunch (its venv on a filesystem the nodes share);",
        "# else a command found after the setup lines, e.g. python",
        "python: auto",
        "# setup:  # CHOOSE: shell lines the job runs first, e.g. module load cuda; source VENV/bin/activate",
        f"sends_user_signal_on_preemption: {'true' if sends_signal else 'false'}  "
        f"# SlurmctldParameters={cfg.get('SlurmctldParameters', '(null)')}",
    ]
    if "enable_expedited_requeue" in cfg.get("SlurmctldParameters", ""):  # SLURM 26.05's sbatch --requeue=expedite
        y.append("expedited_requeue: true  # SlurmctldParameters has enable_expedited_requeue: a requeued job is "
                 "eligible again at once")
    if loopback:
        y += ["env:",
              "  GLOO_SOCKET_IFNAME: {value: lo, why: \"every node's NodeAddr is on loopback (127.0.0.1): gloo must bind lo\"}"]
    else:
        y += ["# env:  # CHOOSE: the fabric's variables, each with its reason (see cluster_profiles/h100-ib.yaml), e.g.",
              "#   NCCL_SOCKET_IFNAME: {value: \"=ib0\", why: \"bootstrap over IPoIB\"}"]
    return y


def live_network(plugin: str, records: Sequence[Mapping[str, str]]) -> tuple[str, list[tuple[str, str]], list[int]]:
    """(tree | block | none, its leaf switches or base blocks as (name, nodes), the block sizes) from
    TopologyPlugin and `scontrol show topology`."""
    kind = {"topology/tree": "tree", "topology/block": "block"}.get(plugin, "none")
    if kind == "tree":
        groups = [(r.get("SwitchName", "?"), r.get("Nodes", "")) for r in records if r.get("Level") == "0" and r.get("Nodes")]
    elif kind == "block":
        groups = [(r.get("BlockName", "?"), r.get("Nodes", "")) for r in records if r.get("BlockName") and r.get("Nodes")]
    else:
        groups = []
    sizes = sorted({_int(r.get("BlockSize")) for r in records if _int(r.get("BlockSize"))}) if kind == "block" else []
    return kind, groups, sizes


def network_lines(plugin: str, records: Sequence[Mapping[str, str]]) -> list[str]:
    """The profile's ``network`` section: SLURM's topology (leaf switches or base blocks, the block
    sizes), and what SLURM cannot know as choices."""
    kind, groups, sizes = live_network(plugin, records)
    choices = ["  # nvlink: {nodes_per_domain: 18}  # CHOOSE: multi-node NVLink domains (GB200/GB300 NVL72), which SLURM does not know",
               "  # hca_by_gpu: [mlx5_0, mlx5_1]  # CHOOSE: the HCA nearest each GPU (nvidia-smi topo -m): each rank's NCCL_IB_HCA"]
    if kind == "none":
        return ["network:  # TopologyPlugin=" + (plugin or "(null)") + ": SLURM knows no switches or blocks here",
                "  topology: none", *choices]
    if not groups:
        return [f"network:  # TopologyPlugin={plugin} but `scontrol show topology` listed no "
                f"{'leaf switch' if kind == 'tree' else 'block'}", "  topology: none", *choices]
    word = "leaf switches (Level=0)" if kind == "tree" else "base blocks"
    y = [f"network:  # TopologyPlugin={plugin}; its {word} from `scontrol show topology`",
         f"  topology: {kind}", "  groups:"]
    y += [f"    {_quote(name)}: {_quote(nodes)}" for name, nodes in groups]
    if sizes:
        y.append(f"  block_sizes: [{', '.join(str(s) for s in sizes)}]  # BlockSize of the blocks and their aggregates")
    return y + choices


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _expand_simple(nodelist: str) -> list[str]:
    """n[1-2],gpu[01-03,07] -> names (SLURM's common forms; python-hostlist handles the rest)."""
    import hostlist  # python-hostlist: SLURM's hostlist syntax

    try:
        return list(hostlist.expand_hostlist(nodelist)) if nodelist else []
    except hostlist.BadHostlist:
        return []
