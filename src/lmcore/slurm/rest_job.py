"""A rendered batch job as slurmrestd's job description (pure; no I/O).

slurmrestd runs the script it is given but does not read its ``#SBATCH`` lines (a script with
``--nodes=2 --job-name=x`` submitted alone ran as a 1-node job named "(null)" on 26.05.5): what
sbatch reads from them must be sent as fields of the job description (``job_desc_msg`` in the
server's OpenAPI schema). The job's options come from the renderer's model
(lmcore.slurm.batch_job.BatchJob: the same (option, value) pairs its header was written from), never
from the script read back, and each becomes its field, so that the REST path submits the same
script, with the same options, as the sbatch path.

An option with no field (a SPANK plugin's, or one sbatch handles on the client side such as
``--wrap`` or ``--parsable``) is an error naming it: the REST path never drops an option.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmcore.slurm.batch_job import BatchJob

# the options that take no value (or an optional one): an SBATCH_ variable naming one, set to 1, yes or true,
# is the flag
FLAGS = {"requeue", "no-requeue", "exclusive", "hold", "contiguous", "overcommit", "reboot", "oversubscribe",
         "spread-job", "use-min-nodes", "no-kill", "oom-kill-step"}


class RestJobError(ValueError):
    """An option the job description cannot carry, or a value it cannot read."""


def _no_val(number: int) -> dict[str, Any]:
    return {"set": True, "infinite": False, "number": number}


def minutes(text: str) -> dict[str, Any]:
    """sbatch --time's forms (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; UNLIMITED) in whole minutes,
    seconds rounded up as SLURM does."""
    t = text.strip().lower()
    if t in ("unlimited", "infinite", "-1"):
        return {"set": True, "infinite": True, "number": 0}
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if m is None:
        raise RestJobError(f"{text!r} is not a SLURM time (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days_t, a_t, b_t, c_t = m.groups()
    a, b, c = int(a_t), int(b_t or 0), int(c_t or 0)
    if days_t is not None:  # D-H[:M[:S]]
        secs = int(days_t) * 86400 + a * 3600 + b * 60 + c
    elif c_t is not None:  # H:M:S
        secs = a * 3600 + b * 60 + c
    elif b_t is not None:  # M:S
        secs = a * 60 + b
    else:
        secs = a * 60
    if secs == 0:  # sbatch(1) --time: "A time limit of zero requests that no time limit be imposed"
        return {"set": True, "infinite": True, "number": 0}
    return _no_val(-(-secs // 60))


def megabytes(text: str) -> dict[str, Any]:
    """sbatch --mem's forms (a number with K, M, G or T; M without) in MB."""
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if m is None:
        raise RestJobError(f"{text!r} is not a memory size (a whole number with K, M, G or T)")
    n, unit = int(m.group(1)), m.group(2) or "M"
    return _no_val({"K": -(-n // 1024), "M": n, "G": n * 1024, "T": n * 1024 * 1024}[unit])


def _integer(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()):
        raise RestJobError(f"{text!r} is not a whole number")
    return int(text)


def _signal(text: str) -> dict[str, Any]:
    """--signal=[{R|B}:]<sig>[@sig_time] (sbatch(1)); sig_time defaults to 60 s."""
    m = re.fullmatch(r"(?:([RB]+):)?([A-Z0-9]+)(?:@(\d+))?", text.strip().upper())
    if m is None:
        raise RestJobError(f"{text!r} is not [R|B:]SIGNAL[@SECONDS]")
    flags = [{"B": "BATCH_JOB", "R": "RESERVATION_JOB"}[c] for c in (m.group(1) or "")]
    sig = m.group(2) if m.group(2).isdigit() or m.group(2).startswith("SIG") else "SIG" + m.group(2)
    return {"kill_warning_signal": sig, "kill_warning_delay": {"set": True, "infinite": False,
            "number": int(m.group(3) or 60)}, "kill_warning_flags": flags}


def _gres(text: str) -> str:
    """--gres=gpu:8[,other:1] as TRES per node: gres/gpu:8 (sbatch's own translation)."""
    return ",".join(part if part.startswith("gres/") else "gres/" + part for part in text.split(","))


def _exclusive(text: str) -> dict[str, Any]:
    word = {"": "none", "true": "none", "user": "user", "mcs": "mcs", "topo": "topo"}.get(text.strip().lower())
    if word is None:
        raise RestJobError(f"{text!r}: --exclusive takes user, mcs or topo, or no value")
    return {"shared": [word]}


def _switches(text: str) -> dict[str, Any]:
    """--switches=count[@max-time]."""
    count, _, wait = text.partition("@")
    out: dict[str, Any] = {"required_switches": _no_val(_integer(count))}
    if wait:
        out["wait_for_switch"] = minutes(wait)["number"] * 60
    return out


def _gres_flags(text: str) -> dict[str, Any]:
    flags = {"enforce-binding": "GRES_BINDING_ENFORCED", "disable-binding": "GRES_BINDING_DISABLED"}
    out = [flags[w] for w in text.split(",") if w in flags]
    if len(out) != len(text.split(",")):
        raise RestJobError(f"{text!r}: --gres-flags takes enforce-binding or disable-binding here")
    return {"flags": out}


def _field(name: str, conv: Callable[[str], Any] = str) -> Callable[[str], dict[str, Any]]:
    return lambda v: {name: conv(v)}


def _flag(name: str, value: Any) -> Callable[[str], dict[str, Any]]:
    return lambda v: {name: value}


def _requeue(text: str) -> dict[str, Any]:
    if text in ("", "true"):
        return {"requeue": True}
    if text == "expedite":  # sbatch(1) --requeue[=expedite]
        return {"requeue": True, "flags": ["EXPEDITED_REQUEUE"]}
    raise RestJobError(f"{text!r}: --requeue takes no value or expedite")


def _open_mode(text: str) -> dict[str, Any]:
    if text not in ("append", "truncate"):
        raise RestJobError(f"{text!r}: --open-mode is append or truncate")
    return {"open_mode": [text.upper()]}


_MAIL = {"TIME_LIMIT": "TIME=100%", "TIME_LIMIT_90": "TIME=90%", "TIME_LIMIT_80": "TIME=80%",
         "TIME_LIMIT_50": "TIME=50%", "INVALID_DEPEND": "INVALID_DEPENDENCY"}


def _mail_type(text: str) -> dict[str, Any]:
    """sbatch's --mail-type words as the API's (ALL: BEGIN, END, FAIL, INVALID_DEPEND, REQUEUE, STAGE_OUT)."""
    words = [w.upper() for w in text.split(",")]
    if "NONE" in words:
        return {"mail_type": []}
    if "ALL" in words:
        words = [w for w in words if w != "ALL"] + ["BEGIN", "END", "FAIL", "INVALID_DEPEND", "REQUEUE", "STAGE_OUT"]
    known = {"BEGIN", "END", "FAIL", "REQUEUE", "STAGE_OUT", "ARRAY_TASKS", *_MAIL}
    bad = [w for w in words if w not in known]
    if bad:
        raise RestJobError(f"{', '.join(bad)}: not a --mail-type (allowed: NONE, ALL, {', '.join(sorted(known))})")
    return {"mail_type": sorted({_MAIL.get(w, w) for w in words})}


# sbatch's long option -> the fields it sets in the job description (slurmrestd's job_desc_msg).
OPTIONS: dict[str, Callable[[str], dict[str, Any]]] = {
    "job-name": _field("name"), "partition": _field("partition"), "account": _field("account"),
    "qos": _field("qos"), "reservation": _field("reservation"), "comment": _field("comment"),
    "constraint": _field("constraints"), "prefer": _field("prefer"), "licenses": _field("licenses"),
    "wckey": _field("wckey"), "network": _field("network"), "dependency": _field("dependency"),
    "array": _field("array"), "mail-user": _field("mail_user"), "distribution": _field("distribution"),
    "cluster-constraint": _field("cluster_constraint"), "clusters": _field("clusters"),
    "container": _field("container"), "mcs-label": _field("mcs_label"),
    "output": _field("standard_output"), "error": _field("standard_error"), "input": _field("standard_input"),
    "chdir": _field("current_working_directory"),
    "nodes": _field("nodes"), "ntasks": _field("tasks", _integer), "ntasks-per-node": _field("tasks_per_node", _integer),
    "ntasks-per-core": _field("tasks_per_core", _integer), "ntasks-per-socket": _field("tasks_per_socket", _integer),
    "ntasks-per-gpu": _field("ntasks_per_tres", _integer),
    # sbatch sends --cpus-per-task as TRES per task too (TresPerTask=cpu=N in the job record)
    "cpus-per-task": lambda v: {"cpus_per_task": _integer(v), "tres_per_task": f"cpu={_integer(v)}"},
    "cpus-per-gpu": _field("cpus_per_tres", lambda v: f"gres/gpu:{_integer(v)}"),
    "mincpus": _field("minimum_cpus_per_node", _integer), "threads-per-core": _field("threads_per_core", _integer),
    "sockets-per-node": _field("sockets_per_node", _integer), "cores-per-socket": _field("cores_per_socket", _integer),
    "core-spec": _field("core_specification", _integer), "thread-spec": _field("thread_specification", _integer),
    "nice": _field("nice", _integer), "priority": _field("priority", lambda v: _no_val(_integer(v))),
    "time": _field("time_limit", minutes), "time-min": _field("time_minimum", minutes),
    "mem": _field("memory_per_node", megabytes), "mem-per-cpu": _field("memory_per_cpu", megabytes),
    "mem-per-gpu": _field("memory_per_tres", lambda v: f"gres/gpu:{megabytes(v)['number']}"),
    "tmp": _field("temporary_disk_per_node", lambda v: megabytes(v)["number"]),
    "gres": _field("tres_per_node", _gres), "gpus-per-node": _field("tres_per_node", lambda v: _gres(f"gpu:{v}")),
    "gpus": _field("tres_per_job", lambda v: _gres(f"gpu:{v}")),
    "gpus-per-task": _field("tres_per_task", lambda v: _gres(f"gpu:{v}")),
    "gpus-per-socket": _field("tres_per_socket", lambda v: _gres(f"gpu:{v}")),
    "gres-flags": _gres_flags, "segment": _field("segment_size", lambda v: _no_val(_integer(v))),
    "switches": _switches, "signal": _signal, "open-mode": _open_mode, "mail-type": _mail_type,
    "exclude": _field("excluded_nodes", lambda v: v.split(",") if "[" not in v else [v]),
    "nodelist": _field("required_nodes", lambda v: v.split(",") if "[" not in v else [v]),
    "requeue": _requeue, "no-requeue": _flag("requeue", False), "exclusive": _exclusive,
    "oversubscribe": _flag("shared", ["oversubscribe"]), "hold": _flag("hold", True),
    "contiguous": _flag("contiguous", True), "overcommit": _flag("overcommit", True), "reboot": _flag("reboot", True),
    "kill-on-invalid-dep": lambda v: {"flags": ["KILL_INVALID_DEPENDENCY" if v in ("", "yes") else "NO_KILL_INVALID_DEPENDENCY"]},
    "spread-job": _flag("flags", ["SPREAD_JOB"]), "use-min-nodes": _flag("flags", ["PREFER_MINIMUM_NODE_COUNT"]),
    "wait-all-nodes": _field("wait_all_nodes", lambda v: v in ("1", "")),
    "delay-boot": _field("delay_boot", lambda v: minutes(v)["number"] * 60),
    "no-kill": _flag("kill_on_node_fail", False),
    "oom-kill-step": _field("oom_kill_step", lambda v: 0 if v == "0" else 1),
    # no field: sbatch puts it in the job's environment (SLURM_GPU_BIND), where each srun reads it
    "gpu-bind": lambda v: {},
}
NO_VAL16 = 0xFFFE  # SLURM's "not set" for a 16-bit field: the cluster's default applies
# What sbatch sends for an option it was not given, where slurmrestd's parser would put another
# value for an absent field (seen comparing the two job records on 26.05.5: slurmrestd made an
# absent oom_kill_step 0, overriding the cluster's default, where sbatch leaves it unset).
UNSET = {"oom_kill_step": NO_VAL16}
# What sbatch does on the submitting side, with no field to carry it.
CLIENT_SIDE = {"wrap", "parsable", "quiet", "verbose", "test-only", "wait", "ignore-pbs", "get-user-env",
               "export-file", "nodefile", "batch", "bb", "bbf", "propagate", "uid", "gid", "power", "profile",
               "acctg-freq", "cpu-freq", "gpu-freq", "mem-bind", "hint", "extra-node-info",
               "begin", "deadline", "export"}


# What sbatch puts in the job's environment from its options (sbatch(1) OUTPUT ENVIRONMENT
# VARIABLES; seen by diffing a job's `env` submitted by sbatch and through slurmrestd on 26.05.5).
_OPTION_ENV = {"ntasks-per-node": "SLURM_NTASKS_PER_NODE", "mem": "SLURM_MEM_PER_NODE", "mem-per-cpu": "SLURM_MEM_PER_CPU",
               "mem-per-gpu": "SLURM_MEM_PER_GPU", "gpus": "SLURM_GPUS", "gpus-per-node": "SLURM_GPUS_PER_NODE",
               "gpus-per-task": "SLURM_GPUS_PER_TASK", "gpus-per-socket": "SLURM_GPUS_PER_SOCKET",
               "cpus-per-gpu": "SLURM_CPUS_PER_GPU", "distribution": "SLURM_DISTRIBUTION",
               "threads-per-core": "SLURM_THREADS_PER_CORE", "ntasks-per-core": "SLURM_NTASKS_PER_CORE",
               "ntasks-per-socket": "SLURM_NTASKS_PER_SOCKET", "ntasks-per-gpu": "SLURM_NTASKS_PER_GPU",
               "network": "SLURM_NETWORK", "gpu-bind": "SLURM_GPU_BIND"}
# Never put in the job's environment by the REST path: the token it was submitted with
NOT_SENT = frozenset({"SLURM_JWT"})
# sbatch sets these for MPI launchers started inside the job unless they are set (23.11 and later)
_MPI_ENV = {"HYDRA_BOOTSTRAP": "slurm", "HYDRA_LAUNCHER_EXTRA_ARGS": "--external-launcher",
            "I_MPI_HYDRA_BOOTSTRAP": "slurm", "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS": "--external-launcher",
            "OMPI_MCA_plm_slurm_args": "--external-launcher", "PRTE_MCA_plm_slurm_args": "--external-launcher"}


def sbatch_environment(options: Sequence[tuple[str, str]], environment: Mapping[str, str], cwd: str,
                       host: str, nice: int) -> dict[str, str]:
    """The environment sbatch would send: the submitting one (--export=ALL) plus what sbatch adds
    from its options (SLURM_NTASKS from --nodes x --ntasks-per-node, SLURM_CPUS_PER_TASK, ...)
    and about the submission (SLURM_SUBMIT_DIR, SLURM_SUBMIT_HOST, SLURM_PRIO_PROCESS)."""
    env = {k: v for k, v in environment.items() if k not in NOT_SENT}
    for name, value in _MPI_ENV.items():
        env.setdefault(name, value)
    given = dict(options)
    for name, var in _OPTION_ENV.items():
        if name in given:
            env[var] = str(megabytes(given[name])["number"]) if name.startswith("mem") else given[name]
    tasks = given.get("ntasks")
    if tasks is None and given.get("ntasks-per-node", "").isdigit() and given.get("nodes", "").isdigit():
        tasks = str(int(given["nodes"]) * int(given["ntasks-per-node"]))
    if tasks is not None:
        env["SLURM_NTASKS"] = env["SLURM_NPROCS"] = tasks
    if "cpus-per-task" in given:
        env["SLURM_CPUS_PER_TASK"] = given["cpus-per-task"]
        env["SLURM_TRES_PER_TASK"] = f"cpu={given['cpus-per-task']}"
    env.update(SLURM_SUBMIT_DIR=cwd, SLURM_SUBMIT_HOST=host, SLURM_PRIO_PROCESS=str(nice))
    return env


# sbatch(1) INPUT ENVIRONMENT VARIABLES: what sbatch reads from its environment, over the script's
# #SBATCH lines and under its command line. Those with an option here are applied as sbatch would.
INPUT_VARIABLES = {"SBATCH_ACCOUNT": "account", "SBATCH_PARTITION": "partition", "SBATCH_QOS": "qos",
                   "SBATCH_TIMELIMIT": "time", "SBATCH_RESERVATION": "reservation", "SBATCH_CONSTRAINT": "constraint",
                   "SBATCH_WCKEY": "wckey", "SBATCH_REQUEUE": "requeue", "SBATCH_NO_REQUEUE": "no-requeue",
                   "SBATCH_EXCLUSIVE": "exclusive", "SBATCH_GRES": "gres", "SBATCH_GPUS_PER_NODE": "gpus-per-node",
                   "SBATCH_MEM_PER_CPU": "mem-per-cpu", "SBATCH_MEM_PER_GPU": "mem-per-gpu", "SBATCH_NETWORK": "network",
                   "SBATCH_CLUSTERS": "clusters", "SBATCH_DISTRIBUTION": "distribution", "SBATCH_OPEN_MODE": "open-mode",
                   "SBATCH_SIGNAL": "signal", "SBATCH_SEGMENT_SIZE": "segment", "SBATCH_JOB_NAME": "job-name"}
# sbatch's own input variables that carry no job option (how sbatch itself behaves)
_CLIENT_VARIABLES = {"SBATCH_DEBUG", "SBATCH_EXPORT", "SBATCH_GET_USER_ENV", "SBATCH_IGNORE_PBS", "SBATCH_WAIT",
                     "SBATCH_EXPORT_FILE", "SBATCH_HINT", "SBATCH_CPU_FREQ_REQ", "SBATCH_PROFILE"}


def input_variables(environment: Mapping[str, str]) -> list[tuple[str, str]]:
    """The options sbatch would take from ``environment``'s SBATCH_ variables; one it would read
    that the REST path cannot carry is refused, naming it."""
    out = []
    for name in sorted(k for k in environment if k.startswith("SBATCH_")):
        option = INPUT_VARIABLES.get(name)
        if option is not None:
            value = environment[name]
            out.append((option, "" if option in FLAGS and value.lower() in ("", "1", "yes", "true") else value))
        elif name in _CLIENT_VARIABLES:
            raise RestJobError(f"${name} is set: sbatch would read it, and the REST path does not; unset it, or "
                               "submit with sbatch")
    return out


def job_description(batch: BatchJob, *, environment: Mapping[str, str], cwd: str, host: str, nice: int = 0,
                    extra: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """The request body of ``POST /slurm/<version>/job/submit`` that runs ``batch`` as sbatch
    would: its header's options (then the environment's SBATCH_ variables and ``extra``, as
    sbatch's command line, winning) as fields, the environment sbatch would send
    (:func:`sbatch_environment`) and the working directory."""
    options = [*batch.options, *input_variables(environment), *extra]
    env = sbatch_environment(options, environment, cwd, host, nice)
    job: dict[str, Any] = {"environment": [f"{k}={v}" for k, v in sorted(env.items())],
                           "current_working_directory": cwd}
    for name, value in options:
        convert = OPTIONS.get(name)
        if convert is None:
            why = ("sbatch handles it on the submitting side" if name in CLIENT_SIDE
                   else "a SPANK plugin's option or one slurmrestd does not take")
            raise RestJobError(f"--{name}: slurmrestd's job description has no field for it ({why}); "
                               "submit this job with sbatch (the profile's submit.via: sbatch)")
        try:
            fields = convert(value)
        except (RestJobError, KeyError, ValueError) as exc:
            raise RestJobError(f"--{name}={value}: {exc}") from None
        for key, v in fields.items():
            if key == "flags":
                v = sorted(set(job.get(key, [])) | set(v))
            elif key in ("tres_per_task", "tres_per_node") and key in job:  # e.g. --cpus-per-task and --gpus-per-task
                v = ",".join(sorted({*job[key].split(","), v}))
            job[key] = v
    for key, unset in UNSET.items():
        job.setdefault(key, unset)
    return {"script": batch.text, "job": job}
