"""A search's driver (``lmlaunch sweep SPEC SEARCH.yaml`` with ``search: optuna``; ``lmlaunch sweep
resume NAME``): it asks the study for trials, submits each as a run of its own
(``<search>.<number>``), and ends each trial in the study when its run ends, as its ledger says
(completed with the objective from the run's own logs, pruned, or failed). The decisions are
:func:`launcher.search.policy.next_steps`'; this module is their I/O.

The search lives in its directory ``<runs root>/<search>/``: ``search.json`` (the spec, overrides,
profile, storage and the search file as validated: what ``resume`` needs), ``driver.log`` (what the
driver said, with times), ``driver.lock`` (held by the one live driver: a second one is refused;
a killed driver's lock goes with its process). The study, in the profile's ``sweep_storage``, is
the truth about trials: the driver can be killed at any moment and resumed without losing or
repeating one. ``lmlaunch cancel SEARCH`` cancels every trial's job and marks the directory
CANCELLED: the driver then ends what ended and stops.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.context import Context
from launcher.planning import transport
from launcher.planning.resolve import Resolved
from launcher.runs import far_copy, registry as runs
from launcher.search.plan import (
    LOCK,
    LOG,
    STATE,
    SearchState,
    check_corners,
    find,
    pointer_file,
    render_dry_run,
    spread_over,
    trial_resolved,
)
from launcher.search.policy import Step, TrialFacts, next_steps, objective
from launcher.submit.submission import submit_plan
from lmcore import jsonlines
from lmcore.errors import SlurmUnavailable, SpecError, UserError
from lmcore.run import rundir
from lmcore.search import study
from lmcore.search.search_spec import SearchFile
from lmcore.search.study_storage import StorageRef
from lmcore.slurm import client as slurm

POLL_S = float(os.environ.get("LMLAUNCH_SEARCH_POLL_S", "3"))


# --------------------------------------------------------------------------- planning (nothing submitted)
def storage_of(resolved: Resolved, source: str, local_cluster: Callable[[], StorageRef] | None = None) -> StorageRef:
    """The profile's sweep_storage as the driver and the trials open it. ``local_cluster`` answers
    for a profile whose studies live in the local cluster's MariaDB (``local_cluster: true``): the
    command hands it in (launcher.localcluster is the commands' to import, never the search's)."""
    s = resolved.profile.sweep_storage
    if s is None:
        raise SpecError([f"cluster profile {resolved.profile.name} names no sweep_storage: a search keeps its study "
                         f"in a database (sweep_storage: {{url: ..., password_file: ...}}) or a journal file on the "
                         f"shared filesystem (sweep_storage: {{journal: PATH}})"], source=source)
    if s.local_cluster:
        if local_cluster is None:
            raise UserError(f"cluster profile {resolved.profile.name} keeps its searches in the local cluster's "
                            f"database (sweep_storage: {{local_cluster: true}}), which this command cannot reach")
        return local_cluster()
    if s.journal:
        return StorageRef("journal", str(Path(os.path.expandvars(s.journal)).expanduser().absolute()))
    return StorageRef("rdb", s.url or "", str(Path(s.password_file).expanduser()) if s.password_file else None)


# --------------------------------------------------------------------------- the driver
class Driver:
    def __init__(self, directory: Path, state: SearchState, ctx: Context, *, poll_s: float = POLL_S) -> None:
        self.dir, self.state, self.ctx, self.poll_s = directory, state, ctx, poll_s
        self.search = state.search_file()
        self.env = ctx.environ or None
        self.quiet = Context(stdout=open(os.devnull, "w"), stderr=ctx.stderr, environ=ctx.environ, python=ctx.python)

    def say(self, line: str) -> None:
        self.ctx.out(line)
        with (self.dir / LOG).open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def run(self) -> int:
        lock = (self.dir / LOCK).open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            raise UserError(f"search '{self.search.name}' already has a live driver ({lock.read().strip() or 'pid ?'}): "
                            f"`tail -f {self.dir / LOG}` follows it") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        lock.flush()
        try:
            st = study.load_study(self.search, self.state.ref())
            self.say(f"search '{self.search.name}': {self.search.trials} trials, at most {self.search.max_parallel} "
                     f"at once, {self.search.objective.direction} {self.search.objective.metric} "
                     f"({self.search.objective.at}); study in {self.state.ref().describe()}")
            while True:
                stopping = self._cancelled()
                facts = self._facts(st)
                plan = next_steps(facts, total=self.search.trials, max_parallel=self.search.max_parallel,
                                  stopping=stopping)
                if stopping:
                    self._cancel_jobs(facts)
                for s in plan.steps:
                    if s.kind in ("ask", "submit") and self._cancelled():
                        break  # cancelled while this round ran: nothing more is submitted
                    self._take(st, s)
                if plan.done:
                    break
                time.sleep(self.poll_s)
            self._summary(st)
            return 0
        finally:
            lock.close()
            self.quiet.stdout.close()

    def _cancelled(self) -> bool:
        return rundir.RunLayout.of(self.dir).cancelled.exists()

    def _cancel_jobs(self, facts: list[TrialFacts]) -> None:
        """The search is cancelled: a trial job still queued or running (one submitted while the
        cancel ran) is cancelled too."""
        live = [self.search.run_name(t.number) for t in facts if t.job_active]
        recs = [rec for name in live if (rec := runs.load_record(name, self.env)) and rec.job_ids]
        for target, members in transport.by_cluster(recs, self.env):  # each trial on its own cluster
            ids = [recs[i].job_ids[-1] for i in members]
            try:
                with transport.through(target, exactly=True):
                    slurm.cancel(ids)
            except UserError as exc:
                self.say(f"cancelling jobs {', '.join(ids)} failed: {exc.message}")

    # -- facts -------------------------------------------------------------------------------
    def _facts(self, st: Any) -> list[TrialFacts]:
        trials = st.get_trials(deepcopy=False)
        records = {r.name: r for r in runs.sweep_records(self.search.name, self.env)}
        live = [r for t in trials if t.state.name in ("RUNNING", "WAITING")
                and (r := records.get(self.search.run_name(t.number))) is not None and r.job_ids]
        jobs: dict[tuple[str, str], Any] = {}  # (trial, job id): two clusters' job ids may meet
        answered = True
        for target, members in transport.by_cluster(live, self.env):  # each trial asked on its own cluster
            try:
                with transport.through(target, exactly=True):
                    found = {j.job_id: j for j in slurm.squeue([j for i in members for j in live[i].job_ids])}
            except (SlurmUnavailable, UserError):
                answered = False
                continue
            jobs.update({(live[i].name, k): v for i in members for k, v in found.items() if k in live[i].job_ids})
        for live_rec in live:
            far_copy.refresh(live_rec)  # a trial on a cluster over SSH: its ledger and metrics brought back
        out = []
        for t in trials:
            name = self.search.run_name(t.number)
            rec = records.get(name) or runs.load_record(name, self.env)
            if t.state.name not in ("RUNNING", "WAITING"):
                out.append(TrialFacts(t.number, t.state.name, True, False))
                continue
            if rec is None or not rec.job_ids:
                out.append(TrialFacts(t.number, t.state.name, False, None))
                continue
            active = any(slurm.is_active(jobs[rec.name, j].state) for j in rec.job_ids if (rec.name, j) in jobs) \
                if answered else None
            end, values = self._run_end(Path(rec.run_dir))
            out.append(TrialFacts(t.number, t.state.name, True, active, end.get("reason"), end.get("detail"),
                                  objective(values, at=self.search.objective.at,
                                            direction=self.search.objective.direction),
                                  cancelled=rec.state == "cancelled"))
        return out

    def _run_end(self, run_dir: Path) -> tuple[dict[str, Any], list[float]]:
        """The run's last ledger end line, and the objective metric's logged values, in order."""
        layout = rundir.RunLayout.of(run_dir)
        ends = [e for e in jsonlines.read_jsonl(layout.ledger) if e.get("event") == "end"]
        metric = self.search.objective.metric
        event = "val" if metric == "val_loss" else "step"
        values = [v for b in jsonlines.read_jsonl(layout.heartbeat)
                  if b.get("event") == event and (v := study.finite(b.get(metric))) is not None]
        return (ends[-1] if ends else {}), values

    # -- steps -------------------------------------------------------------------------------
    def _take(self, st: Any, s: Step) -> None:
        from optuna.trial import TrialState

        if s.kind == "ask":
            dists = {k: study.distribution(v) for k, v in self.search.params.items()}
            trial = st.ask(dists)
            trial.set_user_attr(study.RUN_ATTR, self.search.run_name(trial.number))
            self._submit(st, trial.number, dict(trial.params))
            return
        number = s.number
        assert number is not None  # every other step names its trial
        if s.kind == "submit":
            frozen = _trial(st, number)
            self._submit(st, frozen.number, dict(frozen.params))
        elif s.kind == "complete":
            study.tell(st, number, s.value)
            best = st.best_trial.number == number
            self.say(f"trial {number} ({self.search.run_name(number)}): complete, {self.search.objective.metric} "
                     f"{s.value:.6g}" + (" (best so far)" if best else ""))
        elif s.kind == "prune":
            self._why(st, number, s.why)
            study.tell(st, number, state=TrialState.PRUNED)
            self.say(f"trial {number} ({self.search.run_name(number)}): {s.why}")
        elif s.kind == "fail":
            self._why(st, number, s.why)
            study.tell(st, number, state=TrialState.FAIL)
            self.say(f"trial {number} ({self.search.run_name(number)}): failed: {s.why}")

    def _why(self, st: Any, number: int, why: str) -> None:
        st._storage.set_trial_user_attr(study.trial_id(st, number), study.WHY_ATTR, why[:1000])

    def _submit(self, st: Any, number: int, params: dict[str, Any]) -> None:
        """Trial ``number``'s run submitted, exactly once: a job SLURM already holds under its name
        (a driver killed between sbatch and the registry) is adopted, not submitted again."""
        from optuna.trial import TrialState

        name = self.search.run_name(number)
        rec = runs.load_record(name, self.env)
        if rec is None or not rec.job_ids:
            started = _trial(st, number).datetime_start
            since = started.timestamp() if started else time.time() - 86400
            try:
                found = slurm.jobs_submitted_since(name, since)
            except SlurmUnavailable:
                return  # the next round tries again
            try:
                r = trial_resolved(self.state, number, params, self.ctx)
                if found:
                    rec = runs.RunRecord(name=name, profile=r.plan.profile, run_dir=r.plan.paths.run_dir,
                                         spec_path=self.state.spec, job_ids=[found[0]], submitted_at=[time.time()],
                                         max_steps=r.plan.trainer.max_steps)
                    self.say(f"trial {number} ({name}): adopted job {found[0]} (submitted before the driver stopped)")
                else:
                    submit_plan(r, self.quiet, new=Path(r.plan.paths.run_dir).exists(), spec_path=self.state.spec)
                    rec = runs.load_record(name, self.env)
            except SlurmUnavailable:
                return
            except UserError as exc:  # these values the spec refuses: the trial fails, the search goes on
                self._why(st, number, f"not submitted: {exc.message}")
                study.tell(st, number, state=TrialState.FAIL)
                self.say(f"trial {number} ({name}): failed: not submitted: {exc.message}")
                return
            assert rec is not None
            shown = ", ".join(f"{k}={_show(v)}" for k, v in params.items())
            where = f" on {rec.profile_of(rec.job_ids[-1])}" if spread_over(r, self.state.cluster) else ""
            self.say(f"trial {number} ({name}): job {rec.job_ids[-1]}{where}: {shown}")
        if rec.sweep != self.search.name or rec.point != params:
            rec.sweep, rec.point = self.search.name, params
            runs.save_record(rec, self.env)

    def _summary(self, st: Any) -> None:
        trials = st.get_trials(deepcopy=False)
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
        line = f"search '{self.search.name}' done: {len(trials)} trials (" + ", ".join(
            f"{n} {s}" for s, n in sorted(counts.items())) + ")"
        done = [t for t in trials if t.state.name == "COMPLETE"]
        if done:
            best = st.best_trial
            line += (f"; best: trial {best.number} ({self.search.run_name(best.number)}), "
                     f"{self.search.objective.metric} {best.value:.6g}")
        self.say(line)
        self.say(f"next: lmlaunch sweep results {self.search.name}; lmlaunch report {self.search.name}")


def _trial(st: Any, number: int) -> Any:
    return st._storage.get_trial(study.trial_id(st, number))


def _show(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# --------------------------------------------------------------------------- the commands' halves
def start(spec: str, file: str, overrides: list[str], cluster: str | None, search: SearchFile, ctx: Context, *,
          detach: bool, dry_run: bool, json_out: bool, local_cluster: Callable[[], StorageRef] | None = None) -> int:
    first = check_corners(spec, overrides, cluster, search, ctx, file)
    ref = storage_of(first, file, local_cluster) if not dry_run or first.profile.sweep_storage is None or \
        not first.profile.sweep_storage.local_cluster else StorageRef("rdb", "(the local cluster's MariaDB)")
    directory = Path(first.plan.paths.run_dir).parent / search.name
    if dry_run:
        return render_dry_run(search, ref, directory, first, ctx, json_out, spread_over(first, cluster))
    if rundir.RunLayout.of(directory).plan.exists():
        raise UserError(f"{directory} is the run directory of a run named '{search.name}': give the search another name")
    if (directory / STATE).exists():
        raise UserError(f"search '{search.name}' exists ({directory}): `lmlaunch sweep resume {search.name}` continues "
                        f"it; give a new search another name")
    study.create_study(search, ref)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    state = SearchState(search.name, str(Path(spec).absolute()), str(Path(file).absolute()), list(overrides), cluster,
                        ref.to_json(), search.model_dump(mode="json", by_alias=True, exclude_none=True))
    (directory / STATE).write_text(json.dumps(dataclasses.asdict(state), indent=2) + "\n")
    pointer = pointer_file(search.name, ctx)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(f"{directory}\n")
    return resume(search.name, ctx, detach=detach, directory=directory)


def resume(name: str, ctx: Context, *, detach: bool, directory: Path | None = None) -> int:
    directory = directory or find(name, ctx)
    state = SearchState.read(directory)
    if detach:
        log = (directory / LOG).open("a")
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from launcher.cli import main; sys.exit(main())", "sweep", "resume",
             name], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **(ctx.environ or {})})
        ctx.out(f"search '{name}': driver started in the background (pid {proc.pid}); it writes {directory / LOG}")
        ctx.out(f"next: lmlaunch status {name}; lmlaunch sweep results {name}; lmlaunch cancel {name}")
        return 0
    return Driver(directory, state, ctx).run()


# --------------------------------------------------------------------------- results
def trial_rows(name: str, ctx: Context) -> tuple[list[dict[str, Any]], str | None] | None:
    """A search's trials in order (sweep_rows.search_rows) and its best trial's run; None: ``name``
    is no search."""
    from launcher.monitor import sweep_rows

    try:
        directory = find(name, ctx)
    except UserError:
        return None
    state = SearchState.read(directory)
    search = state.search_file()
    st = study.load_study(search, state.ref())
    trials = [{"number": t.number, "state": t.state.name, "value": t.value, "params": dict(t.params),
               "steps": sorted(t.intermediate_values), "why": t.user_attrs.get(study.WHY_ATTR)}
              for t in st.get_trials(deepcopy=False)]
    rows = sweep_rows.search_rows(trials, search.run_name, list(search.params), search.objective.direction)
    best = next((r["run"] for r in rows if r["best"]), None)
    return rows, best
