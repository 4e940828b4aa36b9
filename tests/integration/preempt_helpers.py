"""Helpers of the preemption integration tests (tests/integration/test_preempt_*.py).

One tiny spec for every scenario (SPEC + BASE overrides): 2 nodes x 1 task, gloo, a loss in
the heartbeat at every step, a periodic checkpoint every 10 steps, the smaller model of
slurm_helpers.SMALL_MODEL. Scenarios that compare weights use the same overrides as the
uninterrupted reference run (only the run name differs, which does not enter the numbers); their
steps are paced by a sleep (slurm_helpers.pace: the reference's are not, a sleep changes no
number) so that a preemption lands while the run still trains.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import waiting
from slurm_helpers import PACE_S, REPO, SMALL_MODEL, TERMINAL, faults, gate, job_name, pace, wait_for

from launcher.cli import main
from launcher.context import Context
from lmcore import jsonlines
from lmcore.errors import UserError
from lmcore.run.rank_logs import rank_text
from lmcore.run.rundir import RunLayout
from lmcore.slurm import admin as rehearsal, client as slurm

SPEC = REPO / "jobs" / "tiny-cpu.yaml"
MAX_STEPS = 80
EVERY = 10
BASE = (
    f"trainer.max_steps={MAX_STEPS}",
    "optim.warmup_steps=3",
    "trainer.val_check_interval=null",
    "trainer.log_every_n_steps=1",
    "logging.heartbeat_every_n_steps=1",
    f"checkpoint.every_n_steps={EVERY}",
    "checkpoint.keep_last=2",
    *SMALL_MODEL,
)


def lm(environ: dict[str, str], *args: str) -> tuple[int, str, str]:
    """`lmlaunch ARGS` in-process with ``environ`` (registry and runs root of the caller)."""
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in args], Context(stdout=out, stderr=err, environ=dict(environ)))
    return code, out.getvalue(), err.getvalue()


def held_at(step: int, attempt: int = 1, *, until: Path | None = None) -> dict:
    """The fault rule that holds every rank of ``attempt`` at the end of ``step`` until it is told
    to stop (a preemption's signal, SLURM's SIGTERM: lmtrain.faults' gate) or the file ``until``
    exists: a test that acts on a running attempt acts on one that cannot have trained further, or
    ended, before the act lands. A fault that signals no surviving rank (a node that dies, whose
    peers learn it from their next collective) needs ``until``, created once the fault landed. The
    heartbeat shows ``step - 1`` while it is held (the gate comes before the step's metrics):
    :func:`wait_held`."""
    return gate("train.batch_end", until, step=step, attempt=attempt)


def wait_held(run_dir: Path, step: int, *, attempt: int = 1, job_id: str | None = None) -> int:
    """Wait until rank 0 of ``attempt`` waits at the gate of :func:`held_at` ``step`` (its log says
    so); the step its heartbeat shows (``step - 1``, or -1 held at step 1)."""
    waiting.until(
        lambda: is_held(run_dir, attempt, step=step), progress=run_progress(run_dir, job_id), poll=0.2,
        on_poll=(lambda: start_if_begin_time(job_id)) if job_id is not None else None,
        what=f"{run_dir.name}: held at step {step} (attempt {attempt})",
        explain=lambda: f"at step {current_step(run_dir, attempt)}; ledger {ledger(run_dir)}\n{log_tail(run_dir)}")
    return current_step(run_dir, attempt)


def is_held(run_dir: Path, attempt: int = 1, rank: int = 0, *, step: int | None = None) -> bool:
    """Whether ``rank`` of ``attempt`` reached a gate (of ``step``): lmtrain.faults logs it as it
    waits there."""
    said = r"fault injection: gate at " + ("" if step is None else rf"train\.batch_end \{{[^}}]*'step': {step}[,}}]")
    return re.search(said, rank_text(run_dir / "logs" / f"attempt-{attempt}", rank)) is not None


def submit(environ: dict[str, str], name: str, *overrides: str, pace_s: float | None = PACE_S,
           checkout: Path | None = None, holds: tuple[dict, ...] = ()) -> tuple[str, Path]:
    """Submit the tiny spec, its steps paced by ``pace_s`` (None: as fast as they go), with
    lmlaunch from ``checkout`` (a private_checkout; default: this one, in-process), with the fault
    rules ``holds`` (:func:`held_at`); return (job id, run dir)."""
    with faults(*([pace(pace_s)] if pace_s else []), *holds):
        args = ("submit", SPEC, f"name={name}", *BASE, *overrides)
        code, out, err = lm_from(checkout, environ, *args) if checkout else lm(environ, *args)
    assert code == 0, out + err
    job_id = re.search(r"job (\d+)", out).group(1)
    return job_id, Path(environ["LMLAUNCH_RUNS_ROOT"]) / name


def ddp_reference(environ: dict[str, str], jobs: list[str]) -> dict:
    """The uninterrupted run of SPEC + BASE: its per-step losses and final weights (tests share
    it: shared_results.shared("preempt-ddp-reference", ...))."""
    name = job_name("pr", "reference")
    job, run_dir = submit(environ, name, pace_s=None)  # nothing acts on it: as fast as it goes
    jobs.append(job)
    finish(job, run_dir)
    assert [e["reason"] for e in ends(run_dir)] == ["completed"]
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1)) and all(len(v) == 1 for v in losses.values())
    weights = final_weights(run_dir)
    return {"losses": {s: v[0] for s, v in losses.items()}, "weights": weights, "step": weights["step"],
            "digest": weights_digest(weights)}


def jsonl(path: Path) -> list[dict]:
    return jsonlines.read_jsonl(path)  # skips a line being written


def ledger(run_dir: Path) -> list[dict]:
    return jsonl(run_dir / "attempts.jsonl")


def starts(run_dir: Path) -> list[dict]:
    return [e for e in ledger(run_dir) if e.get("event") == "start"]


def ends(run_dir: Path) -> list[dict]:
    return [e for e in ledger(run_dir) if e.get("event") == "end"]


def beats(run_dir: Path) -> list[dict]:
    return jsonl(run_dir / "metrics" / "heartbeat.jsonl")


def current_step(run_dir: Path, attempt: int | None = None) -> int:
    """Newest step in the heartbeat (of ``attempt`` when given); -1 before the first."""
    steps = [b["step"] for b in beats(run_dir) if b.get("event") == "step" and (attempt is None or b["attempt"] == attempt)]
    return max(steps, default=-1)


def run_progress(run_dir: Path, job_id: str | None = None):
    """What advances while a run starts, trains, checkpoints and requeues: the files of its run
    directory, and its job's state when known (tests/waiting.py)."""
    parts = [waiting.tree(run_dir)]
    if job_id is not None:
        parts.append(waiting.job(job_id))
    return waiting.watching(*parts)


def wait_step(run_dir: Path, step: int, *, attempt: int | None = None, job_id: str | None = None) -> int:
    """Wait until the run logged ``step`` (in ``attempt``), while the run advances; return the
    step seen. Starts a requeued ``job_id`` at once while it waits for its BeginTime."""
    def reached() -> int | None:
        seen = current_step(run_dir, attempt)
        return seen if seen >= step else None

    return waiting.until(
        reached, progress=run_progress(run_dir, job_id), poll=0.2,
        on_poll=(lambda: start_if_begin_time(job_id)) if job_id is not None else None,
        what=f"{run_dir.name}: step {step} (attempt {attempt})",
        explain=lambda: f"at step {current_step(run_dir, attempt)}; ledger {ledger(run_dir)}\n{log_tail(run_dir)}")


_PENDING_SINCE: dict[tuple[str, str | None], float] = {}


def start_if_begin_time(job_id: str) -> None:
    """Start a job waiting for its requeue BeginTime, once no node is still cleaning up a job or
    its previous run and its BeginTime (set at the requeue) is 2 s old (see launcher.submit.rehearsal)."""
    info = slurm.show_job(job_id) or {}
    if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
        key = (job_id, info.get("Restarts"))
        first_seen = _PENDING_SINCE.setdefault(key, time.monotonic())
        if time.monotonic() - first_seen < 2.0 or not rehearsal.ready_to_start(job_id):
            return
        with contextlib.suppress(UserError):
            rehearsal.start_now(job_id)


def wait_attempt_running(run_dir: Path, attempt: int, job_id: str) -> None:
    """Wait until ``attempt`` wrote its ledger start line (starting the requeued job at once),
    while the run advances."""
    waiting.until(
        lambda: any(s["attempt"] == attempt for s in starts(run_dir)),
        progress=run_progress(run_dir, job_id), poll=0.2, on_poll=lambda: start_if_begin_time(job_id),
        what=f"attempt {attempt} of job {job_id} started",
        explain=lambda: f"{slurm.show_job(job_id)}\n{ledger(run_dir)}\n{log_tail(run_dir)}")


def finish(job_id: str, run_dir: Path) -> str:
    """Wait for the job to end COMPLETED, while the run advances, starting its requeued attempts
    at once (safely: see start_if_begin_time; slurm_helpers.wait_terminal starts them within the
    second of the requeue, which SLURM may kill as "Job credential revoked")."""
    def ended() -> str | None:
        state = slurm.job_state(job_id)
        return state if slurm.state_group(state) in TERMINAL else None

    state = waiting.until(ended, progress=run_progress(run_dir, job_id), on_poll=lambda: start_if_begin_time(job_id),
                          what=f"job {job_id} ended", explain=lambda: log_tail(run_dir))
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{ledger(run_dir)}\n{log_tail(run_dir)}"
    return state


def log_tail(run_dir: Path, chars: int = 1500) -> str:
    parts = []
    for _n, attempt_dir in RunLayout.of(run_dir).attempts_logged()[-2:]:  # rank 0's lines of its node's log
        parts.append(f"--- {attempt_dir}, rank 0\n" + rank_text(attempt_dir, 0)[-chars:])
    for p in sorted((run_dir / "submitit").glob("*_0_log.err"))[-1:]:  # the batch script's and srun's
        parts.append(f"--- {p}\n" + p.read_text(errors="replace")[-chars:])
    for p in sorted((run_dir / "submitit").glob("*_node-0_log.out"))[-1:]:  # the tasks' of node 0, labelled
        parts.append(f"--- {p}\n" + p.read_text(errors="replace")[-chars:])
    return "\n".join(parts)


def losses_by_step(run_dir: Path) -> dict[int, list[float]]:
    """Every loss the heartbeat recorded for each step (a step redone after a crash appears twice)."""
    out: dict[int, list[float]] = {}
    for b in beats(run_dir):
        if b.get("event") == "step" and b.get("loss") is not None:
            out.setdefault(int(b["step"]), []).append(b["loss"])
    return out


def assert_losses_match(run_dir: Path, reference: dict[int, float], missing_ok: frozenset[int] = frozenset()) -> None:
    """Every step's loss equals the reference's (a step redone after a kill too). ``missing_ok``:
    steps whose heartbeat line may be missing (a task killed after the step's checkpoint was
    complete but before the line was written; the next attempt starts after that step)."""
    got = losses_by_step(run_dir)
    missing = set(reference) - set(got)
    assert set(got) <= set(reference) and missing <= missing_ok, (
        f"steps logged {sorted(got)} != reference {sorted(reference)} (missing {sorted(missing)})")
    diff = {s: (v, reference[s]) for s, vs in got.items() for v in vs if v != reference[s]}
    assert not diff, f"per-step losses differ from the uninterrupted run at steps {sorted(diff)}: {diff}"


def final_weights(run_dir: Path, ckpt_dir: Path | None = None) -> dict:
    """The model weights of the newest complete checkpoint (what the runtime resumes from), in the
    run's checkpoint directory (``ckpt_dir`` when the spec's checkpoint.dir put it elsewhere)."""
    import torch

    from lmtrain.checkpoint.manager import newest_complete

    ckpt = newest_complete(ckpt_dir or run_dir / "checkpoints")
    assert ckpt is not None, f"{run_dir}: no complete checkpoint"
    state = torch.load(ckpt.lightning_path, map_location="cpu", weights_only=True)
    return {"step": ckpt.step, "state_dict": state["state_dict"]}


def weights_digest(weights: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(weights["state_dict"]):
        t = weights["state_dict"][name]
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def assert_weights_identical(run_dir: Path, reference: dict) -> None:
    got = final_weights(run_dir)
    assert got["step"] == reference["step"] == MAX_STEPS, (got["step"], reference["step"])
    assert weights_digest(got) == reference["digest"], (
        f"final weights of {run_dir.name} differ from the uninterrupted run: "
        + ", ".join(n for n, t in got["state_dict"].items() if not t.equal(reference["weights"]["state_dict"][n]))
    )


def preempt(environ: dict[str, str], run: str, mode: str, *extra: str) -> dict:
    """`lmlaunch preempt RUN --mode MODE --json`; returns its JSON."""
    code, out, err = lm(environ, "preempt", run, "--mode", mode, "--json", *extra)
    assert code == 0, f"lmlaunch preempt {run} --mode {mode} exited {code}: {out}{err}"
    return json.loads(out)


@contextlib.contextmanager
def user_signal_on_preemption(enabled: bool):
    """Switch the cluster's SlurmctldParameters=preempt_send_user_signal, restore it afterwards."""
    from launcher.localcluster import cluster

    settings = cluster.status().settings
    previous = settings.preempt_send_user_signal if settings else False
    lines: list[str] = []
    if previous != enabled:
        cluster.up(lines.append, preempt_send_user_signal=enabled)
    try:
        yield
    finally:
        if previous != enabled:
            cluster.up(lines.append, preempt_send_user_signal=previous)


def cluster_sends_user_signal() -> bool:
    return "preempt_send_user_signal" in slurm.config().get("SlurmctldParameters", "")


def wait_ended(job_id: str) -> str:
    """Wait for the job to leave the queue, while it advances (no BeginTime skipping: nothing
    should requeue it)."""
    return wait_for(job_id, {"completed", "cancelled", "failed", "timeout", "preempted"}, poll=1.0)


def private_checkout(where: Path) -> Path:
    """A copy of the checkout's code (launcher/, src/lmcore/, src/lmtrain/, cluster_profiles/) in ``where``, for a test that edits
    the code a run was submitted from, as a user edits a live checkout, while other tests' jobs
    snapshot and import the shared one. `lm_from` runs lmlaunch from it. Its module.py carries a
    marker line, so a snapshot shows which checkout it was taken from."""
    shutil.copytree(REPO / "launcher", where / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "src" / "lmtrain", where / "src" / "lmtrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "src" / "lmcore", where / "src" / "lmcore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "cluster_profiles", where / "cluster_profiles")  # found beside launcher/
    module = where / "src" / "lmtrain" / "model" / "module.py"
    module.write_text(module.read_text() + f"\n# {CHECKOUT_MARKER} {where}\n")
    return where


CHECKOUT_MARKER = "private checkout of a test:"


def lm_from(checkout: Path, environ: dict[str, str], *args: str) -> tuple[int, str, str]:
    """`lmlaunch ARGS` as a process that imports lmlaunch from ``checkout`` (a private_checkout),
    with ``environ`` over this process's environment (the fault rules of a `faults` block)."""
    env = {**os.environ, **environ, "PYTHONPATH": f"{checkout}:{checkout / 'src'}"}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from launcher.cli import main; sys.exit(main(sys.argv[1:]))", *args],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=waiting.HANG_S)
    return proc.returncode, proc.stdout, proc.stderr


@contextlib.contextmanager
def edited_checkout(checkout: Path):
    """Edit the checkout's loss (x3) for the duration: a task that imported the checkout instead
    of its run's code snapshot would log other losses than the uninterrupted run."""
    path = checkout / "src" / "lmtrain" / "model" / "module.py"
    original = path.read_text()
    edited = original.replace("return self(input_ids, labels=labels).loss", "return self(input_ids, labels=labels).loss * 3.0")
    assert edited != original, "the line to edit is gone from lmtrain/model/module.py"
    path.write_text(edited)
    try:
        yield
    finally:
        path.write_text(original)

