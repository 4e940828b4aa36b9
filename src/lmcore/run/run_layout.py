"""Where each file of a run directory lives: the one speller of its paths (docs/run-directory.md),
as submitit's ``JobPaths`` is of its folder. Pure of everything but ``pathlib`` and ``json``;
:mod:`lmcore.run.rundir` (the records written there) re-exports these names."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEDGER = "attempts.jsonl"
METRICS = "metrics"
HEARTBEAT = f"{METRICS}/heartbeat.jsonl"
RANK_TIMES = f"{METRICS}/rank-times.json"  # the ranks' newest step timing and the slow ones (lmtrain.health.straggler_watch)
PLAN = "plan.json"
DONE = "DONE"
CANCELLED = "CANCELLED"
RESTART_IN_PLACE = "RESTART_IN_PLACE"  # rank 0's decision, for the batch script's restart loop (launcher.submit.script)
# set by that loop for ranks it starts again after srun failed and rank 0 never decided: srun's exit
# status (the next attempt's start gate records the missing end line from it)
UNDECIDED_VAR = "LMLAUNCH_UNDECIDED_END"
# set by each task's agent (lmtrain.task.agent) for the training process it forks: how many times the
# ranks restarted in this srun step before it (0: the step's first); part of the rendezvous key
GENERATION_VAR = "LMLAUNCH_STEP_GENERATION"
# set by the batch script (launcher.submit.script.setup_lines), once each time it runs (a requeue runs it again):
# part of the rendezvous key, so that a job of another cluster with the same job id (a run over several
# clusters shares its run directory) never reads this one's rendezvous, gate or verdict files
BATCH_VAR = "LMLAUNCH_BATCH"
CHECKPOINTS = "checkpoints"  # the default checkpoint directory; the plan may name another
LOGS = "logs"
CODE_DIR = "code"  # the code snapshot every attempt imports (launcher.runs.snapshot, PYTHONPATH in the plan)
# in code/: the same files in one zip, each module with its bytecode, first on PYTHONPATH: a process's imports
# open one file, not a few hundred (docs/scale.md); code/ keeps them unpacked for people, diffs and data files
CODE_ZIP = "lmlaunch-code.zip"
SUBMITIT = "submitit"  # submitit's folder: the pickled task, the job script, the batch script's and tasks' output
# in submitit/: srun's output of a job's tasks on node N, stdout and stderr (srun --output and --error with %n,
# ext "out"), each line marked with its task, "R: " (srun --label); the batch script's own is "<job>_0_log.<ext>"
SUBMITIT_NODE_LOG = "{job}_node-{node}_log.{ext}"
SUBMITIT_TASK_LOG = "{job}_{rank}_log.{ext}"  # a task's own file: a run written before (and task 0's, as the batch's)
SPEC_YAML = "spec.yaml"
MOVER_LOCK = "mover.lock"  # `lmlaunch move --watch` of a run over several clusters: one watcher at a time
MOVER_LOG = "mover.log"  # logs/: what it saw and did
COPY_ID = "copy-id"  # this run directory's own id: its copy on a cluster over SSH carries it (launcher.runs.far_copy)
DEEPSPEED_JSON = "deepspeed.json"
REPORT = "report.png"  # `lmlaunch report`'s default output
WANDB_ID = "wandb_id"  # the W&B run id every attempt logs into (lmtrain.observe.loggers)
TENSORBOARD = "tensorboard"  # TensorBoard's event files (lmtrain.observe.loggers), under version_0
CSV = "csv"  # the CSV logger's metrics (lmtrain.observe.loggers), under version_0
PREPARATION = "preparation.json"  # `data prepare --on-cluster`: what its tasks prepare (lmtrain.data.prepare.array_task)
PREPARATION_JOBS = "preparation-jobs.json"  # {"arrays": [...], "assemble": id}, written after the submission
ENVIRONMENT = "environment.json"  # logs/attempt-<N>/: what the attempt ran on (lmtrain.observe.environment_record)
HANG_MARKER = "hang-rank-{rank}.json"  # logs/attempt-<N>/: a rank's hang report (lmtrain.health.watchdog)
LAST_WORDS = "exit-{node}.jsonl"  # logs/attempt-<N>/: how the node's ranks ended badly, a line each (lmtrain.preemption.first_death)
LAST_WORDS_OF_A_RANK = "exit-rank-{rank}.json"  # beside them: a rank's of a run written before they were per node
PROFILE_REQUEST = "profile-request.json"  # `lmlaunch profile`: the ranks poll it at logging steps (lmtrain.observe.profiling)
NODE_TIMING = "timing-node-{node}.jsonl"  # logs/attempt-<N>/: the step timing of a node's ranks per logging interval (lmtrain.observe.timing_lines)
TASK_RECORD = "tasks/{job_id}-{restart_count}/node-{node}.jsonl"  # logs/: where a task runs, its pid (lmcore.run.task_records; lmlaunch stacks)
TASK_RECORD_OF_A_RANK = "rank-{rank}.json"  # beside them: a record of a run written before the records were per node


# --------------------------------------------------------------------------- markers and paths
def unzipped(path: str | Path) -> Path:
    """A path inside the code snapshot's zip (a module's ``__file__`` imported from it), as the
    snapshot's directory holds it on disk; any other path as it is. For files read or run by path
    (data beside a module, a script), which a zip cannot give."""
    parts = Path(path).parts
    if CODE_ZIP not in parts:
        return Path(path)
    i = len(parts) - 1 - parts[::-1].index(CODE_ZIP)
    return Path(*parts[:i], *parts[i + 1:])


def read_done_step(run_dir: str | Path) -> tuple[bool, int | None]:
    """(DONE exists, the step it names)."""
    try:
        text = (Path(run_dir) / DONE).read_text().strip()
    except FileNotFoundError:
        return False, None
    except OSError:
        return True, None
    return True, int(text) if text.isdigit() else None


def is_cancelled(run_dir: str | Path) -> bool:
    return (Path(run_dir) / CANCELLED).exists()


def attempt_logs_dir(run_dir: str | Path, attempt: int) -> Path:
    return RunLayout.of(run_dir).attempt_logs(attempt)


@dataclass(frozen=True)
class RunLayout:
    """Where each file of a run directory lives (docs/run-directory.md): the one place that spells
    those paths, as submitit's ``JobPaths`` is for its folder. ``logs`` and ``checkpoints`` are
    where the plan put them (:meth:`of_plan`), else the defaults."""

    run_dir: Path
    logs: Path
    checkpoint_dir: Path | None = None  # None: the plan's, read from plan.json when asked

    @classmethod
    def of(cls, run_dir: str | Path) -> RunLayout:
        return cls(Path(run_dir), Path(run_dir) / LOGS)

    @classmethod
    def of_plan(cls, plan: Any) -> RunLayout:
        """From a :class:`lmcore.job.plan.LaunchPlan` (its ``paths``)."""
        p = plan.paths
        return cls(Path(p.run_dir), Path(p.logs_dir), Path(p.checkpoint_dir))

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or checkpoint_dir_of(self.run_dir)

    @property
    def default_checkpoints(self) -> Path:
        """The checkpoint directory a spec without ``checkpoint.dir`` gets (read nothing)."""
        return self.run_dir / CHECKPOINTS

    @property
    def plan(self) -> Path:
        return self.run_dir / PLAN

    @property
    def spec_yaml(self) -> Path:
        return self.run_dir / SPEC_YAML

    @property
    def deepspeed_json(self) -> Path:
        return self.run_dir / DEEPSPEED_JSON

    @property
    def ledger(self) -> Path:
        return self.run_dir / LEDGER

    @property
    def heartbeat(self) -> Path:
        return self.run_dir / HEARTBEAT

    @property
    def submitit(self) -> Path:
        return self.run_dir / SUBMITIT

    def submitit_node_logs(self, job: str, ext: str) -> list[Path]:
        """srun's ``.out`` or ``.err`` files of job ``job``'s tasks, one per node, by node index."""
        prefix, suffix = f"{job}_node-", f"_log.{ext}"
        found = []
        for p in self.submitit.glob(SUBMITIT_NODE_LOG.format(job=job, node="*", ext=ext)):
            index = p.name[len(prefix):-len(suffix)]
            if index.isdigit():
                found.append((int(index), p))
        return [p for _, p in sorted(found)]

    @property
    def code(self) -> Path:
        """The code snapshot every attempt imports (launcher.runs.snapshot)."""
        return self.run_dir / CODE_DIR

    @property
    def code_zip(self) -> Path:
        """The code snapshot's files in one zip, what the tasks import (``PYTHONPATH``)."""
        return self.code / CODE_ZIP

    @property
    def report(self) -> Path:
        return self.run_dir / REPORT

    @property
    def wandb_id(self) -> Path:
        return self.run_dir / WANDB_ID

    @property
    def preparation(self) -> Path:
        """A `data prepare --on-cluster` run: what its tasks prepare."""
        return self.run_dir / PREPARATION

    @property
    def preparation_jobs(self) -> Path:
        return self.run_dir / PREPARATION_JOBS

    def preparation_script(self, name: str) -> Path:
        """A preparation's job scripts: prepare-array[-K].sh, prepare-assemble.sh."""
        return self.run_dir / name

    @property
    def done(self) -> Path:
        return self.run_dir / DONE

    @property
    def cancelled(self) -> Path:
        return self.run_dir / CANCELLED

    @property
    def mover_lock(self) -> Path:
        """Held by the one watcher that moves a run over several clusters (`lmlaunch move --watch`)."""
        return self.run_dir / MOVER_LOCK

    @property
    def copy_id(self) -> Path:
        """This run directory's own id (made at its first copy to a cluster over SSH): a copy there
        without it, or with another, is another run's of the same name."""
        return self.run_dir / COPY_ID

    @property
    def mover_log(self) -> Path:
        """What that watcher saw and did, with times."""
        return self.logs / MOVER_LOG

    @property
    def restart_request(self) -> Path:
        """Rank 0's request that the batch script start the ranks again in this allocation (restart
        in place): written after the attempt's end line, removed by the script before it restarts."""
        return self.run_dir / RESTART_IN_PLACE

    @property
    def rendezvous(self) -> Path:
        """Rank 0's answers for an attempt's ranks: rendezvous, start gate, verified checkpoint."""
        return self.run_dir / "rendezvous"

    def rendezvous_file(self, key: str) -> Path:
        return self.rendezvous / f"{key}.json"

    def verdict_file(self, key: str) -> Path:
        """Rank 0's agent's word to the others when the ranks of one start (``key``) ended: ``restart``
        (a proposal: end the training process and say so in :meth:`ready_dir`), then ``fork`` (every
        agent is ready: fork the next in this srun step) or ``exit`` (end the step: the batch script
        decides)."""
        return self.rendezvous / f"{key}.next"

    def agent_beat_file(self, key: str) -> Path:
        """Rank 0's agent's beat during the ranks' start ``key`` (lmtrain.task.verdicts): rewritten
        every second while it lives, read by the others while they wait for its verdict."""
        return self.rendezvous / f"{key}.rank0-agent"

    def ready_dir(self, key: str) -> Path:
        """One empty file per rank whose agent ended its training process for a restart rank 0's
        agent proposed (``restart`` in the verdict file) and is ready to fork the next."""
        return self.rendezvous / f"{key}.ready"

    def gate_file(self, key: str) -> Path:
        return self.rendezvous / f"{key}.gate.json"

    def verify_file(self, key: str, attempt: int) -> Path:
        return self.rendezvous / f"{key}-attempt-{attempt}.verify"

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs / f"attempt-{attempt}"

    def attempts_logged(self) -> list[tuple[int, Path]]:
        """Every attempt's log directory, by attempt number."""
        out = []
        try:
            for p in self.logs.iterdir():
                m = re.fullmatch(r"attempt-(\d+)", p.name)
                if m and p.is_dir():
                    out.append((int(m.group(1)), p))
        except OSError:
            return []
        return sorted(out)

    @property
    def local_logs(self) -> Path:
        """``run --local``: each rank's own stdout and stderr (lmtrain.local.launch)."""
        return self.logs / "local"

    def rank_log(self, attempt: int, rank: int | str) -> Path:
        """A rank's own log: a data preparation's array task, and a training run written before the
        ranks' logs were per node (:meth:`node_log`)."""
        return self.attempt_logs(attempt) / f"rank-{rank}.log"

    def node_log(self, attempt: int, node: int) -> Path:
        """The log of node ``node``'s ranks (SLURM's node index in the step), every line marked with
        its rank (lmcore.run.rank_logs): one file per node."""
        return self.attempt_logs(attempt) / f"node-{node}.log"

    def environment(self, attempt: int) -> Path:
        return self.attempt_logs(attempt) / ENVIRONMENT

    def last_words(self, attempt: int, node: str) -> Path:
        """The last words of the ranks on node ``node`` (its name; a character a file name should
        not hold made ``_``): one file per node, a line per rank that died."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_"
        return self.attempt_logs(attempt) / LAST_WORDS.format(node=safe)

    def stacks(self, attempt: int, rank: int | str) -> Path:
        """A hung rank's Python stacks (lmtrain.health.watchdog, ``lmlaunch stacks``)."""
        return self.attempt_logs(attempt) / f"stacks-rank-{rank}.txt"

    def hang_marker(self, attempt: int, rank: int | str) -> Path:
        return self.attempt_logs(attempt) / HANG_MARKER.format(rank=rank)

    @property
    def rank_times(self) -> Path:
        """Rank 0's summary of every rank's newest step timing (lmtrain.health.straggler_watch)."""
        return self.run_dir / RANK_TIMES

    @property
    def profile_request(self) -> Path:
        """`lmlaunch profile`'s request to the running ranks (lmtrain.observe.profiling)."""
        return self.run_dir / PROFILE_REQUEST

    def profile_dir(self, attempt: int, request_id: str) -> Path:
        """One profile's traces and top-operator tables, per rank (lmtrain.observe.profiling)."""
        return self.attempt_logs(attempt) / f"profile-{request_id}"

    def node_timing(self, attempt: int, node: int | str) -> Path:
        """The step timing of node ``node``'s ranks (SLURM's node index in the step), a line per rank per
        logging interval, each appended by its rank (lmtrain.observe.timing_lines): one file per node."""
        return self.attempt_logs(attempt) / NODE_TIMING.format(node=node)

    def task_record(self, job_id: str, restart_count: int, node: int) -> Path:
        """The records of node ``node``'s tasks (SLURM's node index in the step) of one start of a
        job, a line per task, each appended by its task: one file per node."""
        return self.logs / TASK_RECORD.format(job_id=job_id, restart_count=restart_count, node=node)

    @property
    def task_records(self) -> Path:
        """Where every task's record lives (lmcore.run.task_records; lmlaunch stacks)."""
        return self.logs / TASK_RECORD.split("/", 1)[0]


def environment_records(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every attempt's environment record, by attempt number (unreadable ones left out)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted((Path(run_dir) / LOGS).glob(f"attempt-*/{ENVIRONMENT}")):
        n = path.parent.name.removeprefix("attempt-")
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if n.isdigit() and isinstance(d, dict):
            out[int(n)] = d
    return out


def checkpoint_dir_of(run_dir: str | Path) -> Path:
    """Where the run's checkpoints are: the plan's ``paths.checkpoint_dir``, else the default. A
    checkpoint directory inside the run directory is taken relative to where the run directory is
    now (a copied or moved run directory reads its own checkpoints, not the original's)."""
    run_dir = Path(run_dir)
    try:
        paths = json.loads((run_dir / PLAN).read_text())["paths"]
        d = paths["checkpoint_dir"]
        if isinstance(d, str) and d:
            planned_run_dir = paths.get("run_dir")
            if isinstance(planned_run_dir, str) and planned_run_dir:
                try:
                    return run_dir / Path(d).relative_to(planned_run_dir)
                except ValueError:
                    pass  # a checkpoint.dir of its own, outside the run directory
            return Path(d)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return run_dir / CHECKPOINTS
