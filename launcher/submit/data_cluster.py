"""``lmlaunch data prepare ... --on-cluster``: the preparation as one throttled SLURM array and a
final step, registered as a run that ``status``, ``logs`` and ``cancel`` know.

- The input files are listed here, in the order a local preparation takes them, and cut into
  ``--tasks`` contiguous slices; array task K tokenizes slice K into one shard per file
  (lmtrain.data.prepare.array_task), in ``OUT.partial``. A task preempted or failed and requeued keeps the
  shards it finished (each shard is written atomically, with its record) and redoes the rest.
- ``--max-parallel`` throttles the array (``%K``). More tasks than one array may hold (the
  cluster's MaxArraySize, or ``--array-size`` for a site whose QOS caps a user's queued jobs
  lower) go into several arrays chained one after another (launcher.submit.arrays); array task k
  of the array that starts at task o is task o + k.
- The final step runs after every array succeeded (``afterok`` on each): it writes the index and
  renames ``OUT.partial`` to ``OUT``: the files a local ``data prepare`` of the same inputs
  writes, byte for byte.

Pure planning (:func:`slices`; the scripts: launcher.submit.script's ``array_script`` and
``assemble_script``, the one renderer) is separated from
the submission (:func:`submit_preparation`), which is the only I/O here: the scripts submitted
through launcher.submit.submission (the one submission path: the same client-side limit and
errors as a run's), the run directory and its registry record.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher.runs import registry as runs
from launcher.spec.profiles import Profile, load_profile
from launcher.submit import arrays, submission
from launcher.submit.script import ArrayJob, array_script, assemble_script
from lmcore.errors import UserError
from lmcore.job.spec import format_minutes, parse_slurm_time
from lmcore.run.rundir import RunLayout
from lmcore.slurm import client as slurm
from lmcore.text_rules import RUN_NAME, brief


def slices(n_files: int, tasks: int) -> list[tuple[int, int]]:
    """``tasks`` contiguous, non-empty slices of ``n_files`` (as even as they go)."""
    tasks = min(tasks, n_files)
    return [(k * n_files // tasks, (k + 1) * n_files // tasks) for k in range(tasks)]


def _partition(profile: Profile, chosen: str | None) -> str:
    name = chosen or profile.preemptible_partition or profile.default_partition
    if name not in profile.partitions:
        raise UserError(f"--partition {name}: not a partition of profile '{profile.name}'; "
                        f"allowed: {', '.join(profile.partitions)}")
    return name


def submit_preparation(inputs: Sequence[str], out: str, *, tokenizer: str | None, text_key: str, skip_bad: bool,
                       cluster: str, tasks: int, max_parallel: int, name: str | None, partition: str | None,
                       time_limit: str, environ: Mapping[str, str], array_size: int | None = None) -> dict[str, Any]:
    """Queue the preparation; what was queued (run, job ids, files, slices, where the result goes).
    On the profile's cluster: its own SLURM_CONF and commands, or its slurmrestd, where it names them."""
    from launcher.planning import transport

    profile = load_profile(cluster, environ)
    with transport.through(transport.profile_target(profile), exactly=True):
        return _submit_preparation(inputs, out, tokenizer=tokenizer, text_key=text_key, skip_bad=skip_bad,
                                   profile=profile, tasks=tasks, max_parallel=max_parallel, name=name,
                                   partition=partition, time_limit=time_limit, environ=environ, array_size=array_size)


def _submit_preparation(inputs: Sequence[str], out: str, *, tokenizer: str | None, text_key: str, skip_bad: bool,
                        profile: Profile, tasks: int, max_parallel: int, name: str | None, partition: str | None,
                        time_limit: str, environ: Mapping[str, str], array_size: int | None) -> dict[str, Any]:
    from launcher.planning import transport
    from launcher.planning.resolve import runs_root_for
    from lmtrain.data.prepare.corpus import Preparation, collect_inputs  # the standard library only: no numpy here

    minutes = _checked_options(tasks, max_parallel, time_limit, name)
    files = collect_inputs(inputs)
    tok = str(Path(tokenizer).expanduser().absolute()) if tokenizer else None
    if tok is not None and not Path(tok).is_dir():
        raise UserError(f"--tokenizer {tokenizer}: not a directory (the tasks load it from there)")
    prep = Preparation(files, tok, text_key, skip_bad)
    cut = slices(len(files), tasks)
    limit = arrays.max_array_size()
    if array_size is not None and not 1 <= array_size <= limit:
        raise UserError(f"--array-size {array_size}: must be 1..{limit} (the cluster's MaxArraySize: task ids "
                        f"0..{limit - 1})")
    size = array_size or limit
    part = _partition(profile, partition)
    if minutes > profile.partitions[part].max_minutes:
        raise UserError(f"--time {time_limit} = {minutes} min is above partition '{part}' max_time "
                        f"({profile.partitions[part].max_time})")
    target = Path(out).expanduser().absolute()
    run_name = name or f"prepare-{target.name}"
    run_dir = Path(runs_root_for(profile, environ)) / run_name
    layout = RunLayout.of(run_dir)
    if run_dir.exists() and not layout.preparation.exists():
        raise UserError(f"run '{run_name}' exists and is not a preparation ({run_dir}); choose --name")
    runs.prepare_run_dir(run_dir)
    layout.submitit.mkdir(exist_ok=True)
    staging = target.with_name(target.name + ".partial")
    spec = {"preparation": prep.to_json(), "out": str(target), "staging": str(staging), "slices": cut,
            "submitted": time.time()}
    layout.preparation.write_text(json.dumps(spec, indent=2) + "\n")
    job = ArrayJob(run_name, str(run_dir), part, format_minutes(minutes), profile.cpus_per_gpu,
                   profile.python_command(sys.executable), profile.account, profile.qos)
    parallel = min(max_parallel, len(cut), size)

    def submit(part: range, dependency: str | None) -> str:
        script = layout.preparation_script("prepare-array.sh" if len(cut) <= size else f"prepare-array-{part.start}.sh")
        return submission.submit_script(array_script(job, part, min(parallel, len(part))), script,
                                        dependency=dependency)

    array_ids = arrays.submit_chained(len(cut), size, submit)
    assemble_id = _submit_assemble(job, run_dir, array_ids)
    what = f"job {array_ids[0]}" if len(array_ids) == 1 else f"jobs {', '.join(array_ids)}"
    runs.save_record(runs.RunRecord(name=run_name, profile=profile.name, run_dir=str(run_dir), spec_path=None,
                                    job_ids=[*array_ids, assemble_id], submitted_at=[time.time()],
                                    max_steps=len(files), after=[f"the preparation array ({what})"],
                                    targets=transport.recorded(profile)), environ)
    return {"run": run_name, "run_dir": str(run_dir), "array_job": array_ids[0], "array_jobs": array_ids,
            "array_size": size, "assemble_job": assemble_id, "files": len(files), "tasks": len(cut),
            "max_parallel": parallel, "partition": part, "out": str(target), "staging": str(staging)}


def _checked_options(tasks: int, max_parallel: int, time_limit: str, name: str | None) -> int:
    """The options that reach the job scripts, held to the rules a job spec's name and time are
    held to; the time limit in minutes."""
    if tasks < 1 or max_parallel < 1:
        raise UserError(f"--tasks({tasks}) and --max-parallel({max_parallel}) must be >= 1")
    try:
        minutes = parse_slurm_time(time_limit)
    except ValueError as exc:
        raise UserError(f"--time {brief(time_limit)}: {exc}") from None
    try:
        if name is not None:
            RUN_NAME.check(name)
    except ValueError as exc:
        raise UserError(f"--name {exc}") from None
    return minutes


def _submit_assemble(job: ArrayJob, run_dir: Path, array_ids: list[str]) -> str:
    """The final step, after every array task succeeded; all or nothing: a failed submission
    cancels the arrays. The job ids go to the run directory."""
    try:
        assemble_id = submission.submit_script(
            assemble_script(job), RunLayout.of(run_dir).preparation_script("prepare-assemble.sh"),
            dependency=f"afterok:{':'.join(array_ids)}")
    except BaseException:
        slurm.cancel(array_ids)
        raise
    RunLayout.of(run_dir).preparation_jobs.write_text(json.dumps({"arrays": array_ids, "assemble": assemble_id}) + "\n")
    return assemble_id

