"""One run lifecycle for `submit` and `run --local` alike: a run is new, resumed (from its newest
complete checkpoint), or archived and started over (``--new``); `cancel` marks it so that no
attempt trains again, and a resume takes that mark away.

:func:`plan_opening` checks what the user asked for against what exists and says what resuming
means (nothing is changed yet); :meth:`Opening.apply` makes the run directory ready (archive,
registry entry, markers, spec.yaml / plan.json / deepspeed.json); :meth:`Opening.rollback`
undoes all of it when the submission that follows fails, so nothing is left half-done.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from launcher.runs import registry as runs, snapshot
from lmcore.atomic import write_private
from lmcore.errors import UserError
from lmcore.job.lr_schedule import extension_note
from lmcore.job.parallelism import Parallelism
from lmcore.job.plan import LaunchPlan
from lmcore.run import rundir
from lmcore.run.checkpoint_index import CompleteCheckpoint, ResumeChoice, choose_for_resume, newest_complete


@dataclass
class Opening:
    """What opening the plan's run directory will do (``apply``) and how to undo it (``rollback``)."""

    plan: LaunchPlan
    new: bool
    resume: bool
    record: runs.RunRecord | None  # the registry's entry of this run name (submit only)
    continuation: str | None  # resuming a finished run to a larger max_steps: what that means
    reshard: str | None  # resuming on another world size: what that means
    code_changes: list[str] | None = None  # resume with --new-code: what changed since the snapshot
    notes: list[str] = field(default_factory=list)
    _undo: list[Callable[[], object]] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return Path(self.plan.paths.run_dir)

    def apply(self, environ: Mapping[str, str] | None = None) -> None:
        """Archive (``new``) or reuse (``resume``) the run directory, take the CANCELLED mark
        away on a resume, and write the launch files; every step is recorded for ``rollback``."""
        plan, run_dir, undo = self.plan, self.run_dir, self._undo
        try:
            if self.new and run_dir.exists():
                archived = runs.archive_run_dir(run_dir)
                undo.append(functools.partial(os.rename, archived, run_dir))
                self.notes.append(f"previous run archived to {archived}")
                if self.record is not None:
                    (archived / "registry.json").write_text(json.dumps(self.record.to_dict(), indent=2, sort_keys=True) + "\n")
            if self.new and self.record is not None:
                rec = self.record
                runs.delete_record(rec.name, environ)
                undo.append(functools.partial(runs.save_record, rec, environ))
                self.record = None
            if runs.prepare_run_dir(run_dir):
                undo.append(lambda: runs.remove_tree(run_dir))
            else:
                self._keep_launch_files()
                self._take_away(rundir.CANCELLED, "the CANCELLED mark of the earlier job was removed: "
                                                  "this run may be requeued again")
                if self.continuation is not None:
                    self._take_away(rundir.DONE, self.continuation)
                if self.reshard is not None:
                    self.notes.append(self.reshard)
            self._snapshot_code()
            runs.write_launch_files(plan)
        except BaseException:
            self.rollback()
            raise

    def rollback(self) -> None:
        """Undo ``apply`` (best effort: the caller reports its own error, not the cleanup's)."""
        for step in reversed(self._undo):
            try:
                step()
            except OSError:
                pass
        self._undo.clear()

    def _keep_launch_files(self) -> None:
        p = self.plan.paths
        backups = {f: Path(f).read_bytes() for f in (p.spec_yaml, p.plan_json, p.deepspeed_json) if f and Path(f).exists()}
        submitit_dir = Path(p.submitit_dir)
        before = set(submitit_dir.iterdir()) if submitit_dir.is_dir() else set()

        def restore() -> None:
            for path, data in backups.items():
                Path(path).write_bytes(data)
            if submitit_dir.is_dir():
                for extra in set(submitit_dir.iterdir()) - before:
                    extra.unlink(missing_ok=True)

        self._undo.append(restore)

    def _snapshot_code(self) -> None:
        """A new run gets the code as it is now; a resumed one keeps its own unless --new-code."""
        code_dir = rundir.RunLayout.of(self.run_dir).code
        if self.resume and code_dir.is_dir() and self.code_changes is None:  # unchanged code (plan_opening compared it)
            if snapshot.add_zip(self.run_dir):  # a snapshot taken before the zip: its files zipped, as the plan imports
                self._undo.append(functools.partial(Path.unlink, rundir.RunLayout.of(self.run_dir).code_zip,
                                                    missing_ok=True))
            return  # the run keeps its snapshot
        if code_dir.is_dir():
            code = rundir.RunLayout.of(self.run_dir).code
            kept = code.with_name(f".{code.name}.undo")
            shutil.rmtree(kept, ignore_errors=True)
            code_dir.rename(kept)
            self._undo.append(functools.partial(_restore_dir, kept, code_dir))
        else:
            self._undo.append(functools.partial(shutil.rmtree, code_dir, True))
        snap = snapshot.take(self.run_dir)
        git = f", git {str(snap.git['commit'])[:12]}{' + uncommitted changes' if snap.git.get('dirty') else ''}" \
            if snap.git else ""
        if self.code_changes:
            shown = "; ".join(self.code_changes[:8]) + (f"; ... ({len(self.code_changes)} in all)"
                                                         if len(self.code_changes) > 8 else "")
            self.notes.append(f"--new-code: the run now runs the current code ({shown})")
        self.notes.append(f"code snapshot: {len(snap.files)} files, {snap.size / 1e6:.1f} MB{git} in {code_dir}; "
                          f"every attempt runs it")

    def _take_away(self, marker: str, note: str) -> None:
        path = self.run_dir / marker
        if path.exists():
            data = path.read_bytes()
            path.unlink()
            self._undo.append(lambda: path.write_bytes(data))
            self.notes.append(note)


def _restore_dir(kept: Path, code_dir: Path) -> None:
    shutil.rmtree(code_dir, ignore_errors=True)
    kept.rename(code_dir)


def plan_opening(
    plan: LaunchPlan, *, new: bool = False, resume: bool = False, record: runs.RunRecord | None = None,
    new_code: bool = False,
) -> Opening:
    """Check ``new`` / ``resume`` against what exists; nothing is changed yet.

    An existing run (its directory, or a registry entry) needs ``resume`` or ``new``; ``resume``
    needs the directory; resuming a finished run needs a larger max_steps; a checkpoint of
    another strategy cannot be resumed."""
    if new and resume:
        raise UserError("--new and --resume exclude each other: start over, or continue")
    name, run_dir = plan.run_name, Path(plan.paths.run_dir)
    exists = (run_dir.is_dir() and any(run_dir.iterdir())) or (run_dir.exists() and not run_dir.is_dir()) \
        or record is not None
    if exists and not (new or resume):
        jobs = f", jobs {', '.join(record.job_ids)}" if record and record.job_ids else ""
        raise UserError(
            f"run '{name}' already exists ({run_dir}{jobs}). Continue it from its checkpoints with "
            f"--resume, start over with --new (the old run directory is kept as {name}.archived-<time>), "
            f"or give this run another name (override: name=<new name>)"
        )
    if resume and not run_dir.is_dir():
        raise UserError(f"--resume: there is no run directory {run_dir} for run '{name}' to resume; start it without --resume")
    code_changes = None
    choice = choose_for_resume(plan.paths.checkpoint_dir) if resume else None
    chosen = choice.chosen if choice else None
    starting_point = resume_point(plan, choice) if choice else None
    if resume:
        old = snapshot.read(run_dir)
        if old is not None:
            changed = snapshot.changes(old, snapshot.current()[0])
            if changed and not new_code:
                shown = "\n  ".join(changed[:20]) + (f"\n  ... ({len(changed)} in all)" if len(changed) > 20 else "")
                raise UserError(
                    f"run '{name}' runs the code snapshot taken when it was submitted ({rundir.RunLayout.of(run_dir).code}); "
                    f"the code changed since:\n  {shown}\nresume with --new-code to run the current code, or resume "
                    f"from the checkout the run was submitted from"
                )
            code_changes = changed if changed else None
        elif new_code:
            code_changes = []
    elif new_code:
        raise UserError("--new-code goes with --resume (a new run always takes the current code)")
    return Opening(
        plan=plan, new=new, resume=resume, record=record,
        continuation=continuation_note(plan, chosen) if resume else None,
        reshard=resume_note(plan, chosen) if resume else None,
        code_changes=code_changes,
        notes=[starting_point] if starting_point else [],
    )


def mark_cancelled(run_dir: Path, *, user: str, job_ids: list[str], now: float | None = None) -> Path:
    """The CANCELLED mark (who, when, which jobs), written BEFORE any job is signalled so that the
    runtime reads the stop as a user cancel and never requeues; and the ledger's note of it."""
    now = time.time() if now is None else now
    marker = rundir.RunLayout.of(run_dir).cancelled
    write_private(marker, json.dumps({"time": now, "user": user, "job_ids": job_ids}) + "\n")
    return marker


def note_cancel(run_dir: Path, *, user: str, job_ids: list[str], now: float) -> None:
    rundir.Ledger(rundir.RunLayout.of(run_dir).ledger).write(
        rundir.LedgerNote(event="cancel_requested", time=now, fields={"user": user, "job_ids": job_ids})
    )


def resume_point(plan: LaunchPlan, choice: ResumeChoice) -> str:
    """What ``--resume`` starts from, and why: the newest complete checkpoint whose files match
    their checksums (:func:`choose_for_resume`: newer step directories that are incomplete or
    damaged are named with their reason), or step 0 for a run that never trained (nothing to lose).
    A run that trained but has no usable checkpoint is an error that says so, before anything is
    changed or submitted: its first attempt would train from step 0 over its step directories and
    its ledger, which only ``--new`` (archiving the old directory) may do."""
    ckpt_dir, name = plan.paths.checkpoint_dir, plan.run_name
    if choice.chosen is not None:
        return f"resuming from {choice.why}"
    in_bucket = _newest_in_bucket(plan)
    if in_bucket is not None:
        return in_bucket
    done, _ = rundir.read_done_step(plan.paths.run_dir)
    ledger = rundir.Ledger(rundir.RunLayout.of_plan(plan).ledger).attempts()
    trained = max((a.end_step or 0 for a in ledger), default=0)
    if not (choice.step_dirs or done or trained):  # step directories, none usable: something would be trained over
        return f"run '{name}' has no checkpoint and never trained past step 0: it starts at step 0"
    what = f"it trained to step {trained}" if trained else "it trained"
    raise UserError(
        f"run '{name}' has nothing to resume from: {what} but {choice.why} in {ckpt_dir}, "
        f"so --resume would train from step 0 over its step directories. Start over with --new (the old "
        f"run directory is kept as {name}.archived-<time>), or give this run another name (override: name=<new name>)"
    )


def _newest_in_bucket(plan: LaunchPlan) -> str | None:
    """For a run whose checkpoints are kept in a bucket too: where it resumes from when its disk has
    none (the runtime downloads it); None when there is no bucket or it holds none."""
    url, creds = plan.paths.checkpoint_store, plan.paths.checkpoint_store_credentials
    if not url or not creds:
        return None
    from lmcore.objects.checkpoints import CheckpointStore, ObjectStoreError

    try:
        names = CheckpointStore.at(url, creds).complete()
    except (ObjectStoreError, UserError) as exc:
        raise UserError(f"run '{plan.run_name}': this disk has no complete checkpoint and {url} cannot be read "
                        f"from here ({exc}); resume where the bucket can be read") from exc
    return f"resuming from {names[-1]} in {url} (this disk has none: the attempt downloads it)" if names else None


def continuation_note(plan: LaunchPlan, ckpt: CompleteCheckpoint | None = None) -> str | None:
    """For a resume of a run that finished (DONE): what continuing it to the plan's max_steps
    means (None when it did not finish). A finished run whose max_steps is not raised has
    nothing to train: an error, before anything is submitted."""
    done, step = rundir.read_done_step(plan.paths.run_dir)
    if not done:
        return None
    ckpt = ckpt or newest_complete(plan.paths.checkpoint_dir)
    if ckpt is not None:
        step = ckpt.step  # where it continues from (DONE's step may name a checkpoint that is not complete)
    new_max = plan.trainer.max_steps
    if step is None or step >= new_max:
        raise UserError(
            f"run '{plan.run_name}' already finished at step {step if step is not None else '?'} and "
            f"trainer.max_steps is {new_max}: nothing to train. To continue it, raise trainer.max_steps (the "
            f"override trainer.max_steps={max(new_max, step or 0) * 2}, or --max-steps for a local run)"
        )
    try:
        old = json.loads(Path(plan.paths.plan_json).read_text())
        old_max, old_optim = int(old["trainer"]["max_steps"]), old["spec"]["optim"]
    except (OSError, ValueError, KeyError, TypeError):
        old_max, old_optim = step, plan.spec["optim"]
    return extension_note(old_optim, plan.spec["optim"], step=step, old_max_steps=old_max, new_max_steps=new_max)


def resume_note(plan: LaunchPlan, ckpt: CompleteCheckpoint | None = None) -> str | None:
    """What resuming ``ckpt`` (default: the newest complete checkpoint) at this plan's topology
    means, or None when there is none. Another strategy's checkpoint is converted when the job
    starts (lmtrain.checkpoint.cross_format), except into DeepSpeed ZeRO: an error, before anything
    is submitted."""
    ckpt = ckpt or newest_complete(plan.paths.checkpoint_dir)
    if ckpt is None:
        return None
    try:
        old = Parallelism.of_meta(ckpt.meta())
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the runtime's own check reports an unreadable checkpoint
    now = plan.parallelism
    if not now.same_format(old):
        if now.zero:
            raise UserError(
                f"run '{plan.run_name}': its newest checkpoint ({ckpt.path.name}) was written with trainer.strategy "
                f"{old.strategy} and this plan uses DeepSpeed ZeRO, which loads only its own checkpoints. Resume with "
                f"trainer.strategy ddp or fsdp (with tensor or pipeline parallelism or without: lmtrain converts "
                f"the checkpoint to any of those), or export it (`lmlaunch export {plan.run_name} --to hf DIR`) and start a new run "
                f"with model.pretrained: DIR"
            )
        return (f"resuming {ckpt.path.name} (written by {old.describe()} on {old.world_size} ranks) with "
                f"{now.describe()} on {now.world_size}: converted from its format when the job starts (weights, "
                f"AdamW's moments, the schedule and the data order kept); the global batch stays "
                f"{plan.topology.global_batch_size}")
    if now.same_layout(old):
        return None
    split = (old.tensor, old.pipeline, now.tensor, now.pipeline) != (1, 1, 1, 1)  # then both meshes are said
    how = now.reshard_how()
    written, now_text = (f"{p.world_size} ranks" + (f", {p.mesh()}" if split else "") for p in (old, now))
    return (
        f"resuming {ckpt.path.name} (written on {written}) on {now_text}: {how}; the global batch "
        f"stays {plan.topology.global_batch_size} (gradient accumulation {plan.topology.grad_accum} per rank) "
        f"and the data order is kept"
    )
