"""Site options: the sbatch and srun options a cluster or a job needs that lmlaunch does not plan
itself (``--reservation``, ``--hint``, ``--mail-type``, ``--mpi``, a SPANK plugin's option, ...).

A profile and a job spec each may have ``slurm: {sbatch: {...}, srun: {...}}``: option long names
without the dashes to a value (``true`` for a flag; in a spec, ``null`` drops the profile's option).
They are rules, not shell: a name is a long option's name, a value one token of a conservative
alphabet (no spaces, quotes, ``$`` or line breaks), so nothing can bend the job script. An option
lmlaunch plans itself (nodes, tasks, time, signal, requeue, output, array, dependency, ...) is
refused naming the key that owns it. Whether the cluster takes the rest (a reservation that does
not exist, an option this SLURM version lacks) only the cluster knows: ``lmlaunch doctor`` runs the
exact job script through ``sbatch --test-only``. Pure: no I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

from lmcore.text_rules import TextRule

OPTION_NAME = TextRule(
    "an sbatch/srun option name",
    r"[a-z][a-z0-9]+(-[a-z0-9]+)*",
    "a long option's name without its leading dashes (lowercase letters, digits and single -, e.g. mail-type; "
    "not a short option's letter)",
    64,
)
OPTION_VALUE = TextRule(
    "an sbatch/srun option value",
    r"[A-Za-z0-9_.,:=@%+/*&|!\[\]~^-]+",
    "one word of letters, digits and _ . , : = @ % + / * & | ! [ ] ~ ^ - (no spaces, quotes or $)",
    1024,
)

# The long options of sbatch and srun as SLURM 22.05's manual pages list them; a name outside
# these is allowed (SPANK plugins add options: pyxis's --container-image) with a note, and the
# cluster judges it (doctor: sbatch --test-only).
SBATCH_OPTIONS = frozenset("""
account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint container
contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
distribution error exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind gpu-freq
gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags hint ignore-pbs input job-name
kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus
network nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu
ntasks-per-node ntasks-per-socket open-mode output overcommit oversubscribe parsable partition power prefer
priority profile propagate qos quiet reboot requeue reservation signal sockets-per-node spread-job switches
test-only thread-spec threads-per-core time time-min tmp uid use-min-nodes verbose wait wait-all-nodes
wckey wrap
""".split())
SRUN_OPTIONS = frozenset("""
accel-bind account acctg-freq bb bbf bcast bcast-exclude begin chdir cluster-constraint clusters comment
compress constraint container contiguous core-spec cores-per-socket cpu-bind cpu-freq cpus-per-gpu
cpus-per-task deadline delay-boot dependency disable-status distribution epilog error exact exclude
exclusive export extra-node-info gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task
gres gres-flags het-group hint immediate input job-name jobid kill-on-bad-exit label licenses mail-type
mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus mpi msg-timeout multi-prog network nice
no-allocate no-kill nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node
ntasks-per-socket open-mode output overcommit overlap oversubscribe partition power prefer preserve-env
priority profile prolog propagate pty qos quiet quit-on-interrupt reboot relative reservation resv-ports
send-libs signal slurmd-debug sockets-per-node spread-job switches task-epilog task-prolog test-only
thread-spec threads threads-per-core time time-min tmp uid unbuffered use-min-nodes verbose wait wckey x11
""".split())

_TOPOLOGY = "resources.nodes, resources.tasks_per_node and resources.gpus_per_node (the plan's topology)"
_GPUS = "resources.gpus_per_node (and the profile's gres_name)"
# Options lmlaunch plans itself, each with the key that owns it.
PLANNED_SBATCH: dict[str, str] = {
    **dict.fromkeys(("nodes", "ntasks", "ntasks-per-node", "ntasks-per-core", "ntasks-per-socket",
                     "ntasks-per-gpu"), _TOPOLOGY),
    **dict.fromkeys(("cpus-per-task", "cpus-per-gpu"), "resources.cpus_per_task"),
    **dict.fromkeys(("gres", "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket"), _GPUS),
    **dict.fromkeys(("mem", "mem-per-cpu", "mem-per-gpu"), "resources.mem"),
    **dict.fromkeys(("time", "time-min"), "resources.time"),
    "partition": "resources.partition (or resources.partition_kind)",
    "account": "resources.account (or the profile's account)",
    "qos": "resources.qos (or the profile's qos)",
    "constraint": "resources.constraint",
    "exclusive": "resources.exclusive (or the profile's exclusive)",
    "exclude": "`lmlaunch doctor --on-nodes --exclude-bad` (the profile's excluded nodes)",
    "job-name": "name",
    "signal": "preemption.warning_signal and preemption.warning_seconds",
    **dict.fromkeys(("requeue", "no-requeue"), "lmlaunch itself (every job requeues itself after its stop checkpoint)"),
    **dict.fromkeys(("output", "error", "input", "open-mode"), "lmlaunch itself (the run directory's logs)"),
    "chdir": "lmlaunch itself (the tasks start in the run directory)",
    "array": "`lmlaunch sweep` (one throttled array)",
    "dependency": "`lmlaunch submit --after` and pipelines",
    **dict.fromkeys(("export", "export-file", "get-user-env"), "env.vars, env.passthrough and the profile's env"),
    **dict.fromkeys(("wrap", "parsable", "test-only", "wait", "batch"), "lmlaunch itself (how it calls sbatch)"),
    "container": "the profile's container",
}
PLANNED_SRUN: dict[str, str] = {
    **{k: v for k, v in PLANNED_SBATCH.items() if k not in ("requeue", "no-requeue", "array", "wrap", "parsable", "batch")},
    "overlap": "`lmlaunch stacks` (it joins the running step with --overlap)",
    "unbuffered": "lmlaunch itself (the task's output)",
    "jobid": "lmlaunch itself (the tasks run in their own job)",
    **dict.fromkeys(("container-image", "container-mounts"), "the profile's container"),
    "multi-prog": "lmlaunch itself (every task runs the same entry)",
}
KNOWN = {"sbatch": SBATCH_OPTIONS, "srun": SRUN_OPTIONS}
PLANNED = {"sbatch": PLANNED_SBATCH, "srun": PLANNED_SRUN}

Value = str | bool | None


def check_name(kind: str, name: str) -> str:
    """An option name of ``kind`` ("sbatch" or "srun") a user may set: ValueError otherwise."""
    OPTION_NAME.check(name)
    owner = PLANNED[kind].get(name)
    if owner is not None:
        raise ValueError(f"lmlaunch plans --{name} itself; set it through {owner}")
    return name


def check_value(value: Any, *, may_drop: bool) -> Value:
    """An option's value: text of :data:`OPTION_VALUE`, a number (as text), ``true`` for a flag,
    ``null`` where ``may_drop`` (a spec dropping the profile's option); ValueError otherwise."""
    if value is None and may_drop:
        return None
    if value is True:
        return True
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{value!r} is not a value: give the option's value, true for a flag, or leave the option "
                         f"out" + ("; null drops the profile's option" if may_drop else ""))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return OPTION_VALUE.check(value)
    raise ValueError(f"expected text, a number or true, not {type(value).__name__}")


def _sbatch_name(name: str) -> str:
    return check_name("sbatch", name)


def _srun_name(name: str) -> str:
    return check_name("srun", name)


def _profile_value(value: Any) -> Value:
    return check_value(value, may_drop=False)


def _spec_value(value: Any) -> Value:
    return check_value(value, may_drop=True)


# The pydantic types of the options, each option checked where it stands (an error's key path ends
# at the option): a profile's, and a spec's (whose null drops the profile's option).
SbatchName = Annotated[str, AfterValidator(_sbatch_name)]
SrunName = Annotated[str, AfterValidator(_srun_name)]
ProfileValue = Annotated[str | bool, BeforeValidator(_profile_value)]
SpecValue = Annotated[str | bool | None, BeforeValidator(_spec_value)]
ProfileSbatch = dict[SbatchName, ProfileValue]
ProfileSrun = dict[SrunName, ProfileValue]
SpecSbatch = dict[SbatchName, SpecValue]
SpecSrun = dict[SrunName, SpecValue]


def merged(profile: Mapping[str, Value], spec: Mapping[str, Value]) -> dict[str, str | bool]:
    """The profile's options with the spec's over them (a spec's None drops the profile's)."""
    both: dict[str, Value] = {**profile, **spec}
    return {k: v for k, v in sorted(both.items()) if v is not None}


def as_args(options: Mapping[str, str | bool]) -> tuple[str, ...]:
    """``--name=value`` (``--name`` for a flag), sorted by name."""
    return tuple(f"--{k}" if v is True else f"--{k}={v}" for k, v in sorted(options.items()))


def unknown_notes(kind: str, options: Mapping[str, Any]) -> list[str]:
    """A note for each option that is not among SLURM 22.05's documented ones (a plugin's, a
    newer SLURM's, or a typo: the closest known name is offered)."""
    notes = []
    for name in sorted(options):
        if name not in KNOWN[kind]:
            close = difflib.get_close_matches(name, sorted(KNOWN[kind]), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            notes.append(f"slurm.{kind}.{name}: --{name} is not among {kind}'s documented options of SLURM "
                         f"22.05{hint}; a SPANK plugin's or a newer SLURM's option is fine: `lmlaunch doctor` "
                         f"has the cluster judge the job script (sbatch --test-only)")
    return notes
