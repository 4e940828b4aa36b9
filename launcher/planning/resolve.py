"""From CLI arguments to a validated spec, profile and plan (the shared front of validate,
submit and run). Reads files and the environment; the planning itself stays pure in
lmcore.job.plan."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from launcher.planning import runtime_stack
from launcher.planning.data_check import (
    data_vocab_checks,
    mixture_notes,
    position_checks,
    store_indexes,
    store_path_checks,
)
from launcher.planning.evaluator import task_problems
from launcher.planning.memory_check import with_memory
from launcher.planning.memory_inputs import model_facts
from launcher.planning.model_check import check_model, pretrained_pipeline_problems, split_of
from launcher.planning.planner import make_plan
from launcher.runs.registry import lmlaunch_home
from launcher.spec import excluded_nodes
from launcher.spec.jobfile import load_job_with_origin
from launcher.spec.profiles import Profile, check_slurm_path, expand_path, load_profile
from launcher.spec.validation import located
from lmcore.errors import SpecError, UserError
from lmcore.job.plan import LaunchPlan
from lmcore.job.spec import JobSpec


@dataclass(frozen=True)
class Resolved:
    spec: JobSpec
    profile: Profile
    plan: LaunchPlan


def runs_root_for(profile: Profile, environ: Mapping[str, str] | None = None) -> str:
    """The absolute runs root: LMLAUNCH_RUNS_ROOT, else the profile's runs_root.

    ``~`` (and in a profile's runs_root ``$VARS``) is expanded from ``environ``; an unset variable, a relative result
    or a character SLURM cannot take in an --output path is a clear error.
    """
    env = os.environ if environ is None else environ
    if env.get("LMLAUNCH_RUNS_ROOT"):
        # The shell expanded $VARS in the variable already; a '$' left in it is literal.
        what = "LMLAUNCH_RUNS_ROOT"
        root = env["LMLAUNCH_RUNS_ROOT"]
        if root == "~" or root.startswith("~/"):
            root = expand_path(root.replace("$", "\0"), env, what).replace("\0", "$")
    else:
        what = f"profile '{profile.name}' runs_root"
        root = expand_path(profile.runs_root, env, what)
    if not root.startswith("/"):
        cwd = (env.get("PWD") if environ is not None else None) or os.getcwd()
        root = str(PurePosixPath(cwd) / root)
    root = os.path.normpath(root)
    check_slurm_path(root, what)
    return root


def home_runs_root(spec: JobSpec, profile: Profile, env: Mapping[str, str]) -> str:
    """Where the run's directory is on this machine. On a cluster reached over SSH in a run over
    several clusters (its profile's login section), that of the first named cluster reached from
    here: the run's home, which its copy there (launcher.runs.far_copy) is kept in step with."""
    if profile.login is None or not spec.clusters or env.get("LMLAUNCH_FORWARDED") == "1":
        return runs_root_for(profile, env)
    for name in spec.clusters:
        other = load_profile(name, env)
        if other.login is None:
            return runs_root_for(other, env)
    raise SpecError([f"clusters: every cluster named ({', '.join(spec.clusters)}) is reached over SSH (its profile's "
                     "login section); a run over several clusters keeps its run directory on this machine: name one "
                     "reached from here too, or run it on one with `lmlaunch --remote NAME submit ...`"])


def excluded_nodes_path(profile: str, environ: Mapping[str, str] | None = None) -> Path:
    """The user's record of nodes excluded from submissions to ``profile``
    (``launcher.spec.excluded_nodes``): beside the run registry, in $LMLAUNCH_HOME."""
    return lmlaunch_home(environ) / "excluded-nodes" / f"{profile}.json"


def host_python_dirs(python: str) -> tuple[str, ...]:
    """Where the tasks' interpreter ``python`` lives: for the one running lmlaunch, its venv and its
    base install; for another, the directory above its bin/. What a container whose python is
    ``auto`` mounts to run it."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        dirs = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    else:
        dirs = {os.path.dirname(os.path.dirname(python))} if python.startswith("/") else set()
    return tuple(sorted(d for d in dirs if d not in ("/usr", "/", "")))


def _planned(spec: JobSpec, profile: Profile, env: Mapping[str, str], python: str | None) -> LaunchPlan:
    """make_plan with what it needs read here: the runs root, the nodes the user's record excludes,
    the interpreters the tasks and the evaluator run and where the tasks' lives."""
    excluded = excluded_nodes.load(excluded_nodes_path(profile.name, env))
    interpreter = profile.python_command(python or sys.executable)
    return make_plan(spec, profile, runs_root=home_runs_root(spec, profile, env), python=interpreter,
                     exclude=excluded_nodes.reasons(excluded), host_python_dirs=host_python_dirs(interpreter),
                     eval_python=eval_interpreter(profile, python or sys.executable))


def eval_interpreter(profile: Profile, interpreter: str) -> str:
    """The evaluator's interpreter command (the profile's ``eval_python``): as written; for ``auto``
    the environment ``<venv>-eval`` beside ``interpreter``'s when there is one (scripts/setup.sh
    makes it), else ``interpreter``; none: the tasks' interpreter."""
    if profile.eval_python is None:
        return profile.python_command(interpreter)
    if profile.eval_python != "auto":
        return profile.eval_python
    venv = Path(interpreter).parent.parent
    beside = venv.with_name(venv.name + "-eval") / "bin" / "python"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else interpreter


def _with_eval_tasks(spec: JobSpec, plan: LaunchPlan) -> LaunchPlan:
    """``eval.alongside``'s tasks and task directories checked against the task files here (lm-eval's
    in the evaluator's environment)."""
    problems, notes = task_problems(spec, plan.evaluator["python"] if plan.evaluator else None)
    if problems:
        raise SpecError(problems)
    return dataclasses.replace(plan, notes=(*plan.notes, *notes)) if notes else plan


def _profile_of(spec: JobSpec, cluster: str | None, origin: Any, env: Mapping[str, str]) -> Profile:
    """The spec's profile; an unknown name is said at the key or option that named it."""
    try:
        return load_profile(spec.cluster, env)
    except SpecError as exc:
        if exc.source is not None:  # the profile file itself is broken
            raise
        where = "--cluster" if cluster else (origin.locate(("cluster",)) or "cluster")
        raise SpecError([f"{where}: {exc.problems[0].removeprefix('cluster: ')}"], exit_code=exc.exit_code) from None


def _profile_gpus(spec: JobSpec, profile: Profile) -> tuple[JobSpec, str | None]:
    """A spec that leaves ``resources.gpus_per_node`` out runs on the GPUs of its profile's nodes (one
    task each), said in a note: on a GPU cluster it is never planned as a CPU job holding GPU nodes
    and using none of their GPUs (``gpus_per_node: 0`` asks for that)."""
    r = spec.resources
    if "gpus_per_node" in r.model_fields_set or profile.gpus_per_node == 0:
        return spec, None
    gpus = profile.gpus_per_node
    if r.tasks_per_node not in (None, gpus):
        raise SpecError([f"resources.tasks_per_node({r.tasks_per_node}) with resources.gpus_per_node left out: "
                         f"profile '{profile.name}' has {gpus} GPUs per node, one task each; leave tasks_per_node "
                         f"out, or set resources.gpus_per_node (0: a CPU job of tasks_per_node tasks)"])
    spec = spec.model_copy(update={"resources": r.model_copy(update={"gpus_per_node": gpus})})
    return spec, (f"resources.gpus_per_node: {gpus}, the GPUs per node of profile '{profile.name}' (the spec "
                  f"leaves it out; gpus_per_node: 0 plans a CPU job)")


def _model_against_data(spec: JobSpec, profile: Profile, plan: LaunchPlan, stores: list[Any], env: Mapping[str, str],
                        *, force: bool, source: str, check_data: bool) -> LaunchPlan:
    """A model that builds against the data, root cause first: the sequence length against its
    positions; then will it fit (a GPU job that does not is refused, with what would make it fit);
    then the stores readable here against its vocabulary and document separator."""
    try:
        facts = model_facts(spec, env, gpu=plan.topology.accelerator == "gpu")
    except Exception:  # what with_memory says (a model the trace cannot follow)
        facts = None
    problems, notes = position_checks(spec.data.seq_len, facts.positions if facts else {})
    if problems:
        raise SpecError(problems)
    plan = with_memory(spec, profile, plan, env, force=force, source=source)
    if facts is not None and facts.vocab_size and check_data:
        more, also = data_vocab_checks(stores, facts.vocab_size, facts.eos_token_ids)
        if more:
            raise SpecError(more)
        notes = [*notes, *also]
    return dataclasses.replace(plan, notes=(*plan.notes, *notes))


def cluster_argument(cluster: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``--cluster a,b`` (several) as the override ``clusters=[a,b]`` and no one cluster; one name
    (or none) as it is."""
    if cluster and "," in cluster:
        return None, [*overrides, f"clusters=[{cluster}]"]
    return cluster, list(overrides)


def _load_spec(spec_path: str, overrides: list[str], cluster: str | None, several: bool) -> tuple[JobSpec, Any]:
    """The spec with its overrides, on ``cluster`` when one is named; one naming several clusters
    on its first (refused unless the caller plans it on the others too: ``several``)."""
    cluster, overrides = cluster_argument(cluster, overrides)
    spec, origin = load_job_with_origin(spec_path, overrides)
    if cluster and spec.clusters and cluster in spec.clusters:  # one of its clusters: it keeps the others
        return spec.model_copy(update={"cluster": cluster}), origin
    if cluster:
        return spec.model_copy(update={"cluster": cluster, "clusters": None, "move": None}), origin
    if spec.clusters:
        if not several:
            where = origin.locate(("clusters",)) or "clusters"
            raise SpecError([f"{where}: this command plans a run on one cluster, and the spec names "
                             f"{len(spec.clusters)} ({', '.join(spec.clusters)}): choose one with --cluster NAME "
                             "(submit and validate take several)"], source=str(spec_path))
        spec = spec.model_copy(update={"cluster": spec.clusters[0]})
    return spec, origin


def _credentials_problems(plan: LaunchPlan, profile: str) -> list[str]:
    """A bucket's credentials file, where the nodes' path can be read from here: one the attempt
    would refuse (missing, readable by others, not the JSON it must be) refused now, naming the key."""
    path = plan.paths.checkpoint_store_credentials
    if not path:
        return []
    from lmcore.objects.credentials import Credentials

    try:
        Credentials.read(Path(path))
    except UserError as exc:
        return [f"profile '{profile}' object_store_credentials (for checkpoint.dir {plan.paths.checkpoint_store}): {exc}"]
    return []


def resolve(
    spec_path: str,
    overrides: list[str] | None = None,
    cluster: str | None = None,
    environ: Mapping[str, str] | None = None,
    python: str | None = None,
    *,
    force: bool = False,
    check_data: bool = True,
    several: bool = False,
    data_later: bool = False,
) -> Resolved:
    """Load and validate the spec (with overrides), its profile, and plan the launch (excluding
    the nodes the user's record for the profile names); the model section is checked against the
    installed transformers (launcher.planning.model_check) and its memory planned (launcher.planning.memory_check:
    a GPU job that does not fit is refused unless ``force``); the stores readable here are checked
    against the model's vocabulary and each other, and each store's path (``check_data``: doctor
    judges them itself; ``data_later``: an earlier job may make a store missing now, which is then a
    note); ``data.seq_len`` against the model's positions (launcher.planning.data_check).

    A spec naming several clusters (``clusters``, or ``--cluster a,b``) is planned here on the
    first; ``several``: the caller plans it on the others too (launcher.planning.clusters: submit
    and validate), else it is refused, with how to name one.

    Every problem names the spec file and, where it can, the line or override it came from.
    """
    env = os.environ if environ is None else environ
    spec, origin = _load_spec(spec_path, overrides or [], cluster, several)
    try:
        profile = _profile_of(spec, cluster, origin, env)
        spec, gpus_note = _profile_gpus(spec, profile)
        plan = _with_eval_tasks(spec, _planned(spec, profile, env, python))
        if gpus_note:
            plan = dataclasses.replace(plan, notes=(gpus_note, *plan.notes))
        stores = store_indexes(spec)
        plan = dataclasses.replace(plan, notes=(*plan.notes, *mixture_notes(spec, plan, stores)))
        if check_data:
            seen_here = profile.login is None and profile.submit.via != "rest"
            problems, notes = store_path_checks(stores, seen_here=seen_here, later=data_later)
            problems += _credentials_problems(plan, profile.name) if seen_here else []
            if problems:
                raise SpecError(problems)
            plan = dataclasses.replace(plan, notes=(*plan.notes, *notes))
        staged = pretrained_pipeline_problems(spec.model, plan.parallelism)
        if staged:
            raise SpecError(staged)
        unchecked = check_model(spec.model, env, split=split_of(plan.topology), pipeline=plan.parallelism.pipeline,
                                schedule=plan.parallelism.schedule)
        if unchecked is not None:
            plan = dataclasses.replace(plan, notes=(*plan.notes, unchecked))
        if runtime_stack.missing() is None:  # the model was built here: its vocabulary and positions
            plan = _model_against_data(spec, profile, plan, stores, env, force=force, source=str(spec_path),
                                       check_data=check_data)
    except SpecError as exc:
        if exc.source is not None:
            raise
        raise SpecError([located(p, origin) for p in exc.problems], source=str(spec_path),
                        exit_code=exc.exit_code) from None
    return Resolved(spec=spec, profile=profile, plan=plan)
