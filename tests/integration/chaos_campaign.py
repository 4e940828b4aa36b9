"""A chaos campaign: one training run on a local worker cluster (2 nodes x 1 rank and a spare, a
checkpoint every few steps, the warm restart in place on), the faults of a schedule
(chaos_schedule.py) landed on it for real (chaos_faults.py) at their steps, and the verdict
(chaos_verdict.py) read off what the run and the cluster say once it ends.

The suite runs a short campaign with a fresh seed (tests/integration/test_chaos.py); the bench a
long one (bench/chaos.py). Both call :func:`run`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import waiting
from chaos_faults import FILLER, Done, Target, checkpoint_dir, inject, undo_when_possible
from chaos_schedule import Fault, Schedule
from preempt_helpers import (
    beats,
    current_step,
    ends,
    final_weights,
    finish,
    ledger,
    log_tail,
    losses_by_step,
    run_progress,
    start_if_begin_time,
    starts,
    submit,
    weights_digest,
)
from slurm_helpers import TERMINAL

from launcher.localcluster import cluster
from launcher.localcluster.config import Layout
from launcher.runs.run_lock import watcher_alive
from lmcore.errors import UserError
from lmcore.run.checkpoint_index import complete_checkpoints
from lmcore.slurm import admin as rehearsal, client as slurm

# What the run asks beyond the uninterrupted reference's spec (none of it changes a number): a
# spare node, retries enough for every fault a schedule may hold, a hang watchdog that fires
# within seconds (a stopped rank), a warning signal early enough that a lowered time limit leaves
# time to checkpoint, the checkpoints on the campaign's small filesystem, and a shorter checkpoint
# interval given by the schedule.
WARNING_S = 150


def overrides(schedule: Schedule, small_fs: Path | None = None, bucket: str | None = None) -> tuple[str, ...]:
    n = len(schedule.faults) + 5
    where = bucket or (str(checkpoint_dir(Path(), small_fs)) if small_fs is not None else None)
    return (f"trainer.max_steps={schedule.max_steps}", f"checkpoint.every_n_steps={schedule.every}",
            "resources.spare_nodes=1", f"preemption.max_crash_retries={n}", f"preemption.max_requeues={n}",
            f"preemption.max_timeouts={n}", f"preemption.warning_seconds={WARNING_S}",
            f"preemption.no_progress_attempts={n}", "watchdog.hang_timeout_s=10", "watchdog.exit_grace_s=5",
            *([f"checkpoint.dir={where}"] if where else ()))


@contextlib.contextmanager
def _in_a_bucket(schedule: Schedule, env: dict[str, str], name: str) -> Iterator[tuple[dict[str, str], str | None]]:
    """A schedule that stops the S3 gateway runs with its checkpoints in a bucket of its own on the
    local cluster's gateway (its disk's in the run directory: a full disk does not land then), the
    gateway held alone meanwhile (tests/gateway.py): (the environment, whose profile names the
    gateway's credentials, and the bucket's location). Any other: (env, None), the gateway untouched."""
    if "gateway_stop" not in {f.kind for f in schedule.faults}:
        yield env, None
        return
    import uuid

    import gateway

    from launcher.localcluster import object_store
    from lmcore.objects.credentials import s3_client

    with gateway.alone():
        creds = object_store.up(lambda line: None)
        client, bucket = s3_client(creds), f"chaos-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        profiles = Path(env["LMLAUNCH_RUNS_ROOT"]) / f".{name}-profiles"
        profiles.mkdir(parents=True, exist_ok=True)
        shipped = Path(__file__).resolve().parents[2] / "cluster_profiles" / "local.yaml"
        (profiles / "local.yaml").write_text(shipped.read_text()
                                             + f"object_store_credentials: {object_store.store_layout().credentials}\n")
        try:
            yield {**env, "LMLAUNCH_PROFILES_DIR": str(profiles)}, f"s3://{bucket}/runs/{name}"
        finally:
            object_store.up(lambda line: None)  # a gateway a stalled campaign left stopped
            object_store.remove_bucket(client, bucket)


def _bucket_state(url: str, env: dict[str, str]) -> tuple[list[str], int]:
    """The bucket's complete checkpoints at the run's end, and the multipart uploads left open in it."""
    from launcher.localcluster import object_store
    from lmcore.objects.checkpoints import CheckpointStore

    store = CheckpointStore.at(url, object_store.store_layout().credentials)
    uploads = store.client.list_multipart_uploads(Bucket=store.url.bucket).get("Uploads", [])
    return store.complete(), len(uploads)


@dataclass
class Landing:
    """One fault as it landed: when, at which step of which attempt, with which checkpoints complete."""

    fault: Fault
    at: float
    step: int  # the newest step in the heartbeat when it landed
    attempt: int | None  # the attempt running when it landed (None: none was)
    complete: tuple[int, ...]  # the complete checkpoints' steps just before it landed
    done: Done
    undone: str = ""


@dataclass
class Campaign:
    schedule: Schedule
    name: str
    job: str  # the run's job now
    run_dir: Path
    small_fs: Path | None = None
    bucket: str | None = None  # checkpoint.dir s3://... (a schedule that stops the gateway)
    bucket_complete: list[str] = field(default_factory=list)  # its complete checkpoints at the end
    bucket_open: int = 0  # multipart uploads left open in it at the end
    landings: list[Landing] = field(default_factory=list)
    final_state: str = ""
    began: float = 0.0
    ended: float = 0.0
    jobs: list[str] = field(default_factory=list)  # every job of the run, the first one first
    resumed: list[str] = field(default_factory=list)  # why the run was resubmitted by hand, each time
    pace_s: float | None = None

    @property
    def ckpt_dir(self) -> Path:
        return checkpoint_dir(self.run_dir, self.small_fs)


def _attempt_now(run_dir: Path, job: str) -> int | None:
    info = slurm.show_job(job) or {}
    begun = starts(run_dir)
    return begun[-1]["attempt"] if info.get("JobState") == "RUNNING" and begun else None


def _start_early(job: str) -> None:
    """A requeued job waits for its BeginTime (~2 min here); start it once it may (tests' own rule,
    preempt_helpers.start_if_begin_time), also when SLURM gives another reason (a job requeued after
    its batch node failed pends as JobLaunchFailure until the same BeginTime)."""
    info = slurm.show_job(job) or {}
    if info.get("JobState") == "PENDING" and info.get("Reason") in ("JobLaunchFailure", "NodeDown"):
        begins = slurm.parse_time(info.get("EligibleTime"))
        if begins is not None and begins > time.time() and rehearsal.ready_to_start(job):
            with contextlib.suppress(UserError):
                rehearsal.start_now(job)
        return
    start_if_begin_time(job)


def _wait(c: Campaign, target: Target, reached: Callable[[], object], what: str) -> object:
    """Until ``reached()`` or the run's job ended for good, starting a requeued job at once and
    resuming a run a full disk stopped, while the run advances."""
    def check():
        if reached():
            return True
        if slurm.state_group(slurm.job_state(c.job)) not in TERMINAL or watcher_alive(c.run_dir):
            return False  # the run's watcher may requeue it yet (its batch node lost, its keeper gone)
        return "ended" if not _resumed_after_disk_full(c, target) else False

    progress = waiting.watching(run_progress(c.run_dir), lambda: waiting.job(c.job)())  # the job of now
    return waiting.until(check, progress=progress, poll=0.2,
                         on_poll=lambda: _start_early(c.job), what=f"{c.run_dir.name}: {what}",
                         explain=lambda: f"ledger {ledger(c.run_dir)}\n{log_tail(c.run_dir)}\n"
                                         f"{slurm_logs(target.layout, c.began)}")


NOISE = ("cgroup", "differs from hardware", "frequency setting", "_handle_stray_script", "vanished from configuration")


def slurm_logs(layout: Layout, since: float, lines: int = 25) -> str:
    """The worker cluster's daemons' log lines since the campaign began (the controller's and each
    node's), the last ``lines`` of each: what SLURM did that the run's files cannot say."""
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 1))
    parts = []
    for path in sorted(layout.log.glob("slurm*.log")):
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        kept = [line for line in text if line[1:20] >= start and not any(n in line for n in NOISE)]
        if kept:
            parts.append(f"--- {path.name}\n" + "\n".join(kept[-lines:]))
    return "\n".join(parts)


def stopped_by_full_disk(end: dict) -> bool:
    """An attempt's end that only its user can follow: a stop-time or final checkpoint that found no
    room (``disk_full``), or a restart whose preflight found the checkpoint directory full on every
    node (``preflight_failed``: the setup, not a node); neither is requeued (docs/preemption.md)."""
    return end.get("reason") == "disk_full" or (
        end.get("reason") == "preflight_failed" and "No space left on device" in str(end.get("detail")))


def _resumed_after_disk_full(c: Campaign, target: Target) -> bool:
    """A run a full disk stopped (:func:`stopped_by_full_disk`): the campaign does what its user would,
    once the room is back (the fault undone): `lmlaunch submit --resume` with the same spec. Whether it did."""
    last = (ends(c.run_dir) or [{}])[-1]
    if not stopped_by_full_disk(last) or (c.run_dir / "DONE").exists():
        return False
    if c.small_fs is not None and (c.small_fs / FILLER).exists():
        return True  # not yet: the room comes back when the fault is undone
    job, _ = submit(target.env, c.name, *overrides(c.schedule, c.small_fs, c.bucket), "--resume", pace_s=c.pace_s)
    c.resumed.append(f"attempt {last.get('attempt')} ended {last.get('reason')}: resubmitted as job {job}")
    c.job = target.job = job
    c.jobs.append(job)
    return True


def _training_since(run_dir: Path, t: float) -> bool:
    """Whether the run trains again after time ``t``: its newest step came later, in an attempt that
    has not ended."""
    steps = [b for b in beats(run_dir) if b.get("event") == "step"]
    ended = {e["attempt"] for e in ends(run_dir)}
    return bool(steps) and steps[-1]["time"] > t + 0.5 and steps[-1]["attempt"] not in ended


def _land(c: Campaign, target: Target, f: Fault, say: Callable[[str], None]) -> Landing:
    complete = tuple(ck.step for ck in complete_checkpoints(c.ckpt_dir))
    step, attempt = current_step(c.run_dir), _attempt_now(c.run_dir, c.job)
    at = time.time()  # before it lands: the keeper may end the attempt before a node fault's inject returns
    done = inject(target, f)
    landing = Landing(f, at, step, attempt, complete, done)
    say(f"{time.time() - c.began:7.1f}s  step {step:>4}  {f.label()}: "
        f"{done.what if done.landed else 'did not land: ' + done.what}")
    return landing


def _undo_later(landing: Landing, say: Callable[[str], None], layout: Layout) -> threading.Thread:
    def later() -> None:
        time.sleep(landing.fault.hold_s)
        try:
            with cluster.own_conf(layout):
                landing.undone = undo_when_possible(landing.done)
        except Exception as exc:  # the verdict names a fault left in place, whatever stopped its undo
            landing.undone = f"undo failed: {type(exc).__name__}: {exc}"[:400]
        say(f"          #{landing.fault.index} undone: {landing.undone}")

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    return thread


def run(schedule: Schedule, env: dict[str, str], layout: Layout, name: str, *,
        pace_s: float, small_fs: Path | None = None, say: Callable[[str], None] = print) -> Campaign:
    """Submit the run, land every fault of ``schedule`` on it, wait for its end and every fault to be
    undone. ``env``: lmlaunch's environment on the worker cluster ``layout``; the caller is inside
    ``cluster.own_conf(layout)``. ``small_fs``: a filesystem of the campaign's own for the
    checkpoints (chaos_faults.small_filesystem; without it, or with the checkpoints in a bucket, a
    full disk does not land)."""
    with _in_a_bucket(schedule, env, name) as (env, bucket):
        c = _run(schedule, env, layout, name, pace_s=pace_s, small_fs=None if bucket else small_fs, say=say,
                 bucket=bucket)
        if bucket is not None:
            c.bucket_complete, c.bucket_open = _bucket_state(bucket, env)
        return c


def _run(schedule: Schedule, env: dict[str, str], layout: Layout, name: str, *, pace_s: float,
         small_fs: Path | None, say: Callable[[str], None], bucket: str | None) -> Campaign:
    job, run_dir = submit(env, name, *overrides(schedule, small_fs, bucket), pace_s=pace_s)
    c = Campaign(schedule, name, job, run_dir, small_fs, bucket, began=time.time(), jobs=[job], pace_s=pace_s)
    target = Target(env, layout, name, job, run_dir, WARNING_S, small_fs, bucket)
    say(f"campaign seed {schedule.seed}: run {name}, job {job}, {len(schedule.faults)} faults over "
        f"{schedule.max_steps} steps (a checkpoint every {schedule.every})")
    undoing: list[threading.Thread] = []
    for i, f in enumerate(schedule.faults):
        if not f.overlap:
            _wait(c, target, lambda s=f.after_step: current_step(run_dir) >= s, f"step {f.after_step}")
        if i and c.landings and schedule.alone and {f.kind, schedule.faults[i - 1].kind} & set(schedule.alone):
            since = c.landings[-1].at
            _wait(c, target, lambda t=since: _training_since(run_dir, t), f"training again before #{f.index}")
        time.sleep(f.delay_s)
        landing = _land(c, target, f, say)
        c.landings.append(landing)
        if landing.done.landed and landing.done.undo is not None:
            undoing.append(_undo_later(landing, say, layout))
    for thread in undoing:  # a node DOWN or the controller away would keep the run from ending
        thread.join()
    _wait(c, target, lambda: False, "the job's end")
    c.final_state, c.ended = slurm.job_state(c.job), time.time()
    say(f"{c.ended - c.began:7.1f}s  job {c.job} ended {c.final_state}" + "".join(f"; {r}" for r in c.resumed))
    return c


def reference(env: dict[str, str], name: str, max_steps: int) -> dict:
    """The uninterrupted run of the campaign's numbers (as fast as it goes, nothing acting on it): its
    per-step losses and the digest of its final weights."""
    job, run_dir = submit(env, name, f"trainer.max_steps={max_steps}", pace_s=None)
    state = finish(job, run_dir)
    assert state == "COMPLETED", f"the reference run {name} ended {state}\n{log_tail(run_dir)}"
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, max_steps + 1)), sorted(losses)
    weights = final_weights(run_dir)
    return {"losses": {s: v[0] for s, v in losses.items()}, "step": weights["step"], "digest": weights_digest(weights),
            "name": name}
